"""Security checks of the reliability bench, on a running cluster (`reliability.py`) and its processes.

  bind          every worker and bootstrap socket listens on the node's address (127.0.0.1 here), never on
                0.0.0.0 or ::, read from /proc/net/tcp* and the owning pid's fds (`proc_probe.py`);
  keys          a second router on the same workers, with `api_keys` and an `admin_token`, logging at debug:
                401 without or with a wrong key/token, 200 with the right one; afterwards none of the key, the
                wrong key, the token (nor the cluster's own admin token) appears in any log of the router(s)
                or workers;
  prompt text   a marker sent in a prompt appears in no log and in neither router's `/metrics`;
  no shell      no `shell=True`, `os.system` or `os.popen` in the package's code, and a topology string with
                shell syntax reaches a worker's argv as one verbatim argument (`plan`).
"""

from __future__ import annotations

import ast
import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dsv4_cluster.orchestrator.launch.ports import free_ports

from . import proc_probe
from .reliability_faults import Cluster

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
CODE_DIRS = ("orchestrator", "router", "workers", "dsv4_cluster", "deploy", "kernels")


def _check(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def bind_check(cluster: Cluster) -> dict:
    worker_ports = {cluster.ports["prefill"], cluster.ports["bootstrap"], cluster.ports["decode"]}
    found = proc_probe.listeners(worker_ports)
    wide = [f"{x.address}:{x.port} (pid {x.pid})" for x in found if x.address in ("0.0.0.0", "::")]
    seen = sorted({f"{x.address}:{x.port}" for x in found})
    ok = not wide and {x.port for x in found} == worker_ports and all(x.pid for x in found)
    return _check("workers bind the node's address", ok,
                  f"listening: {', '.join(seen)}" + (f"; WIDE OPEN: {wide}" if wide else ""))


def _second_router(cluster: Cluster, folder: Path, key: str, token: str) -> tuple[subprocess.Popen, str, Path]:
    (port,) = free_ports(1)
    settings = {"host": "127.0.0.1", "port": port, "model_name": "dsv4-tiny", "api_keys": [key], "admin_token": token,
                "prefill": [{"name": "prefill-0", "url": cluster.url("prefill"), "bootstrap_host": "127.0.0.1",
                             "bootstrap_port": cluster.ports["bootstrap"]}],
                "decode": [{"name": "decode-0", "url": cluster.url("decode")}]}
    config, log = folder / "router-keys.json", folder / "router-keys.log"
    config.write_text(json.dumps(settings))
    proc = subprocess.Popen([sys.executable, "-m", "dsv4_cluster.router", "--config", str(config), "--log-level",
                             "debug"], stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the second router did not come up: {log.read_text()[-2000:]}")


def _statuses(url: str, key: str, token: str, marker: str) -> dict[str, int]:
    chat = {"model": "dsv4-tiny", "max_tokens": 3, "messages": [{"role": "user", "content": marker}]}
    out = {}
    with httpx.Client(timeout=60) as c:
        for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer wrong-" + key}),
                               ("right key", {"Authorization": f"Bearer {key}"})):
            out[f"chat, {label}"] = c.post(url + "/v1/chat/completions", json=chat, headers=headers).status_code
            out[f"stream, {label}"] = c.post(url + "/v1/chat/completions", json={**chat, "stream": True},
                                             headers=headers).status_code
        for label, headers in (("no token", {}), ("wrong token", {"Authorization": "Bearer wrong-" + token}),
                               ("right token", {"Authorization": f"Bearer {token}"})):
            out[f"admin, {label}"] = c.get(url + "/admin/workers", headers=headers).status_code
        out["metrics"] = c.get(url + "/metrics").status_code
    return out


def _logs(cluster: Cluster) -> list[Path]:
    rows = cluster.rows()
    return [Path(r["log_path"]) for r in rows.values() if r.get("log_path")]


def keys_and_prompts(cluster: Cluster, folder: Path) -> list[dict]:
    key, token = "sk-" + secrets.token_hex(16), "adm-" + secrets.token_hex(16)
    marker = "reliability-marker-" + secrets.token_hex(8)
    proc, url, log = _second_router(cluster, folder, key, token)
    try:
        got = _statuses(url, key, token, marker)
        metrics = httpx.get(url + "/metrics", timeout=10).text + httpx.get(cluster.router_url + "/metrics",
                                                                            timeout=10).text
    finally:
        proc.terminate()
        proc.wait(10)
    want = {k: (200 if "right" in k or k == "metrics" else 401) for k in got}
    logs = [log, *_logs(cluster)]
    text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
    cluster_token = json.loads((cluster.home / "current.json").read_text()).get("admin_token") or "(none)"
    secrets_found = [name for name, s in (("api key", key), ("wrong key", "wrong-" + key), ("admin token", token),
                                          ("cluster admin token", cluster_token)) if s in text]
    return [
        _check("API key and admin token enforced", got == want,
               ", ".join(f"{k}: {v}" for k, v in got.items()) + ("" if got == want else f"; wanted {want}")),
        _check("keys and tokens never logged", not secrets_found and len(text) > 0,
               f"searched {len(logs)} logs ({len(text)} chars, router at debug level): "
               + (f"FOUND {secrets_found}" if secrets_found else "none found")),
        _check("no prompt text in logs or metrics", marker not in text and marker not in metrics,
               "the prompt's marker is " + ("PRESENT" if marker in text or marker in metrics else "absent")
               + f" in {len(logs)} logs and both routers' /metrics"),
    ]


def _shell_calls() -> list[str]:
    found = []
    for folder in CODE_DIRS:
        for path in (PACKAGE_ROOT / folder).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                if name in ("os.system", "os.popen") or any(
                        k.arg == "shell" and not (isinstance(k.value, ast.Constant) and k.value.value is False)
                        for k in node.keywords):
                    found.append(f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno} {name}")
    return found


def no_shell(folder: Path) -> dict:
    from dsv4_cluster.orchestrator.launch.plan import cluster_plans
    from dsv4_cluster.orchestrator.topology.load import load_topology

    evil = "$(touch pwned); `id` && echo 'x' | sh"
    path = folder / "evil.yaml"
    path.write_text(f"""
engine: embedded
model: {{name: dsv4-tiny, context_length: 512}}
router: {{host: 127.0.0.1, port: 30001}}
defaults: {{max_total_tokens: 4096}}
prefill:
  - {{name: prefill-0, device: cpu, port: 30100, bootstrap_port: 30198, extra_args: [{json.dumps(evil)}]}}
decode:
  - {{name: decode-0, device: cpu, port: 30200}}
""")
    workers, _ = cluster_plans(load_topology(path))
    verbatim = evil in workers[0].argv
    calls = _shell_calls()
    return _check("topology strings never reach a shell", verbatim and not calls,
                  f"shell calls in the code: {calls or 'none'}; a topology string with shell syntax is "
                  + ("one verbatim argv element" if verbatim else "NOT passed verbatim"))


def security_checks(cluster: Cluster) -> dict:
    import tempfile
    with tempfile.TemporaryDirectory(prefix="dsv4-security-") as tmp:
        checks = [bind_check(cluster), *keys_and_prompts(cluster, Path(tmp)), no_shell(Path(tmp))]
    return {"checks": checks, "ok": all(c["ok"] for c in checks)}
