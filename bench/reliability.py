"""Reliability bench: faults under in-flight requests, bad input, security checks and a load soak, on a real
embedded cluster (Ray, supervisors, NIXL, router; loopback only), in one command (docs/benchmarks.md).

    python -m bench.reliability [--only faults,input,security,soak] [--fault NAME] [--soak-requests 2000] \
        [--fuzz-cases 500] [--out bench/results/reliability]

One cluster (1 prefill + 1 decode with `--test-hooks`, free ports) brought up with the real CLI; the faults
(`reliability_faults.py`), bad input (`reliability_input.py`), security and the soak (below); then `down`, and
/proc must show nothing of it left. Exit status 0 only if every check passed. The soak: every other request
streaming, prompts up to the context, one streaming request in twenty hanging up after 2 tokens; no request `lost`,
`hung` or `reset`, each process's RSS from the warm-up (the first tenth) to the end under 10%, KV usage back to 0.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import random
import secrets
import sys
import tempfile
import time
from pathlib import Path

import httpx

from dsv4_cluster.orchestrator.launch.ports import free_ports
from dsv4_cluster.workers.engine.tokenizer import ByteTokenizer

from . import proc_probe
from .common import RESULTS, cell, machine, md_table, pct, process, rss_bytes, write
from .local_cluster import write_topology
from .reliability_faults import Cluster, all_faults, chat, kv_back_to
from .router import ours_argv

PARTS = ("faults", "input", "security", "soak")
HOOKS = ", extra_args: [--test-hooks]"
CONTEXT, GROWTH_LIMIT_PCT = 512, 10.0


def plan(n: int, seed: int = 0) -> list[tuple[int, int, bool, int | None]]:
    """(prompt chars, max_tokens, stream, leave_after) per soak request."""
    overhead = len(ByteTokenizer().apply_chat_template([{"role": "user", "content": ""}]))
    rng, room, out = random.Random(seed), CONTEXT - overhead - 8, []   # "i: " prefix and a margin
    for i in range(n):
        max_tokens = rng.randint(1, 24)
        chars = room - max_tokens if i % 10 == 0 else rng.randint(1, room - max_tokens)
        stream = i % 2 == 0
        out.append((chars, max_tokens, stream, 2 if stream and i % 20 == 0 and max_tokens > 4 else None))
    return out


async def soak(cluster: Cluster, requests: int, concurrency: int = 32) -> dict:
    pids = {name: r["pid"] for name, r in (await asyncio.to_thread(cluster.rows)).items() if r.get("pid")}
    rss = lambda: {name: rss_bytes(pid) or 0 for name, pid in pids.items()}  # noqa: E731
    text = "the quick brown fox jumps over the lazy dog while the cluster serves. " * 10
    work, warm_n, outcomes, warm = plan(requests), max(1, requests // 10), [], {}
    sem, warmed = asyncio.Semaphore(concurrency), asyncio.Event()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        chars, max_tokens, stream, leave = work[i]
        async with sem:
            prompt = (f"{i}: " + text * (chars // len(text) + 1))[:chars]
            outcomes.append(await chat(client, cluster.router_url, prompt, max_tokens, stream, leave_after=leave))
        if len(outcomes) == warm_n:
            warmed.set()

    limits, started = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency), time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10), limits=limits) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(requests)]
        await warmed.wait()
        warm = rss()
        await asyncio.gather(*tasks)
    wall, end = time.monotonic() - started, rss()
    kv_end = await kv_back_to(cluster, {"prefill": 0, "decode": 0})
    kinds = {k: sum(o.kind == k for o in outcomes) for k in ("completed", "errored", "left", "reset", "hung", "lost")}
    latencies = [o.latency_s for o in outcomes if o.kind == "completed"]
    growth = {name: {"warm_mib": round(warm[name] / 2**20, 1), "end_mib": round(end[name] / 2**20, 1),
                     "growth_pct": round(100 * (end[name] - warm[name]) / warm[name], 2) if warm[name] else float("nan")}
              for name in pids}
    ok = (kinds["lost"] == kinds["hung"] == kinds["reset"] == 0 and len(outcomes) == requests
          and all(v["growth_pct"] < GROWTH_LIMIT_PCT for v in growth.values()) and all(v == 0 for v in kv_end.values()))
    return {"requests": requests, "concurrency": concurrency, **kinds, "p50_s": pct(latencies, 50) if latencies else None,
            "p99_s": pct(latencies, 99) if latencies else None, "wall_s": round(wall, 1), "rss": growth, "kv_end": kv_end,
            "near_context_requests": sum(1 for i in range(requests) if i % 10 == 0),
            "samples": [f"{o.kind}: {o.detail}"[:240] for o in outcomes if o.kind not in ("completed", "left")][:6],
            "ok": ok}


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


def _statuses(url: str, key: str, token: str, marker: str) -> dict[str, int]:
    chat = {"model": "dsv4-tiny", "max_tokens": 3, "messages": [{"role": "user", "content": marker}]}
    out = {}
    with httpx.Client(timeout=60) as c:
        for what, secret in (("key", key), ("token", token)):
            for label, headers in ((f"no {what}", {}), (f"wrong {what}", {"Authorization": f"Bearer wrong-{secret}"}),
                                   (f"right {what}", {"Authorization": f"Bearer {secret}"})):
                if what == "key":
                    out[f"chat, {label}"] = c.post(url + "/v1/chat/completions", json=chat, headers=headers).status_code
                    out[f"stream, {label}"] = c.post(url + "/v1/chat/completions", json={**chat, "stream": True},
                                                     headers=headers).status_code
                else:
                    out[f"admin, {label}"] = c.get(url + "/admin/workers", headers=headers).status_code
        out["metrics"] = c.get(url + "/metrics").status_code
    return out


def keys_and_prompts(cluster: Cluster, folder: Path) -> list[dict]:
    key, token = "sk-" + secrets.token_hex(16), "adm-" + secrets.token_hex(16)
    marker = "reliability-marker-" + secrets.token_hex(8)
    (port,) = free_ports(1)
    url, log = f"http://127.0.0.1:{port}", folder / "router-keys.log"
    argv = ours_argv(port, [(cluster.url("prefill"), cluster.ports["bootstrap"])], [cluster.url("decode")], folder,
                     "debug", model_name="dsv4-tiny", api_keys=[key], admin_token=token)
    with process(argv, url + "/health", log, timeout_s=60):
        got = _statuses(url, key, token, marker)
        metrics = httpx.get(url + "/metrics", timeout=10).text + httpx.get(cluster.router_url + "/metrics",
                                                                            timeout=10).text
    want = {k: (200 if "right" in k or k == "metrics" else 401) for k in got}
    logs = [log, *(Path(r["log_path"]) for r in cluster.rows().values() if r.get("log_path"))]
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
    with tempfile.TemporaryDirectory(prefix="dsv4-security-") as tmp:
        checks = [bind_check(cluster), *keys_and_prompts(cluster, Path(tmp)), no_shell(Path(tmp))]
    return {"checks": checks, "ok": all(c["ok"] for c in checks)}


def render(out: dict) -> str:
    m, yes = out["machine"], lambda ok: "yes" if ok else "NO"  # noqa: E731
    lines = ["# Reliability: faults, bad input, security, soak on the embedded cluster", "",
             f"`{out.get('command', '')}`: {m['cpus']} CPUs, load average {m['loadavg_before'][0]:.1f} before -> "
             f"{m['loadavg_after'][0]:.1f} after (the machine is shared with other work), {out['wall_s']} s. "
             f"Passed: {yes(out.get('passed'))}.", ""]
    if "faults" in out:
        rows = [[f["fault"], f["in_flight"], f["completed"], f["errored"], f.get("held", 0), f["reset"], f["hung"],
                 f["lost"], cell(f["latest_end_after_fault_s"], ".2f"), cell(f["recovery_s"], ".2f"),
                 f"{f['after_ok']}/{f['after_total']}",
                 "yes" if f["kv_after"] == f["kv_baseline"] else f"no: {f['kv_baseline']} -> {f['kv_after']}",
                 len(f["orphans"]), yes(f["ok"])] for f in out["faults"]]
        lines += ["## Faults (explicit error or answer within 10 s of the fault, or held for the worker's return "
                  "and completed; hung and lost must be 0)", "",
                  *md_table(["fault", "in flight", "completed", "errored explicitly", "held, then completed", "reset",
                             "hung", "lost", "latest end after fault (s)", "recovery (s)", "after recovery ok",
                             "KV back to baseline", "orphans", "ok"], rows), "",
                  *(f"- {f['fault']}: {s}" for f in out["faults"] for s in f["samples"]), ""]
    if "soak" in out:
        s = out["soak"]
        lines += ["## Soak", "", *md_table(
            ["requests", "concurrency", "completed", "errored explicitly", "left on purpose", "hung", "lost", "p50 (s)",
             "p99 (s)", "wall (s)", "RSS growth warm-up -> end", "KV at end", "ok"],
            [[s["requests"], s["concurrency"], s["completed"], s["errored"], s["left"], s["hung"], s["lost"],
              cell(s["p50_s"], ".2f"), cell(s["p99_s"], ".2f"), cell(s["wall_s"], ".2f"),
              ", ".join(f"{k} {v['growth_pct']:+.1f}%" for k, v in s["rss"].items()), str(s["kv_end"]),
              yes(s["ok"])]]), ""]
    if "input" in out:
        lines += ["## Bad input", "", *md_table(["check", "cases", "5xx", "schema-breaking", "other failures", "ok"], [
            [c["name"], c["cases"], c["server_errors"], c.get("schema_breaking", "-"), len(c["failures"]), yes(c["ok"])]
            for c in out["input"]["checks"]]), ""]
    if "security" in out:
        lines += ["## Security", "", *md_table(["check", "result", "ok"], [
            [c["name"], c["detail"], yes(c["ok"])] for c in out["security"]["checks"]]), ""]
    lines.append(f"Processes left after `down`: {out['after_down']['leftover_processes'] or 'none'}.")
    return "\n".join(lines) + "\n"


def run(parts: set[str], args: argparse.Namespace, workdir: Path) -> dict:
    local = write_topology(workdir, context_length=CONTEXT, extra_decode=HOOKS, extra_prefill=HOOKS)
    before = machine()
    out: dict = {"machine": {"cpus": before["cpus"], "loadavg_before": before["loadavg"]}, "parts": sorted(parts)}
    started = time.monotonic()
    with local.running() as c:
        cluster = Cluster(c.router_url, c.ports, c.home)
        if "security" in parts:
            out["security"] = security_checks(cluster)
        if "input" in parts:
            from .reliability_input import input_checks
            out["input"] = input_checks(cluster, args.fuzz_cases)
        if "faults" in parts:
            out["faults"] = [r.to_dict() for r in asyncio.run(all_faults(cluster, only=set(args.fault or []) or None))]
        if "soak" in parts:
            out["soak"] = asyncio.run(soak(cluster, args.soak_requests, args.concurrency))
    ports = set(local.ports.values())
    left = proc_probe.orphans(ports, set()) + [f"port {p}: worker pid(s) {pids} still running after down"
                                               for p, pids in proc_probe.worker_processes(ports).items() if pids]
    out["after_down"] = {"leftover_processes": left}
    out["machine"]["loadavg_after"] = machine()["loadavg"]
    out["wall_s"] = round(time.monotonic() - started, 1)
    out["passed"] = (not left and all(f["ok"] for f in out.get("faults", []))
                     and all(out.get(k, {}).get("ok", True) for k in ("soak", "input", "security")))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {PARTS}")
    p.add_argument("--fault", action="append", help="run only the faults whose name contains this (repeatable)")
    p.add_argument("--soak-requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--fuzz-cases", type=int, default=500, help="schemathesis cases per API (router, worker)")
    p.add_argument("--out", type=Path, default=RESULTS / "reliability", help="writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    parts = {x.strip() for x in a.only.split(",") if x.strip()}
    if parts - set(PARTS):
        p.error(f"--only: unknown part(s) {sorted(parts - set(PARTS))}; choose from {PARTS}")
    with tempfile.TemporaryDirectory(prefix="dsv4-reliability-") as tmp:
        out = run(parts, a, Path(tmp))
    out["command"] = "python -m bench.reliability " + " ".join(argv if argv is not None else sys.argv[1:])
    text = render(out)
    write(a.out, out, text)
    print(text)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
