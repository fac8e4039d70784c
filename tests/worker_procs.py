"""Test helper: a real embedded prefill + decode pair as subprocesses on free loopback ports."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from .helpers import wait_for
from .servers import free_ports


@dataclass
class WorkerPair:
    prefill_url: str
    bootstrap_port: int
    decode_url: str
    procs: list[subprocess.Popen]
    logs: list[Path]
    cmds: list[list[str]]

    def bootstrap(self, room: int, rid: str) -> dict:
        return {"bootstrap_host": "127.0.0.1", "bootstrap_port": self.bootstrap_port, "bootstrap_room": room,
                "rid": rid}

    def generate(self, prompt: str, max_new_tokens: int, timeout_s: float = 300.0) -> tuple[httpx.Response,
                                                                                                httpx.Response]:
        """One greedy request through the pair, as the router sends it: the same body to prefill and decode at
        once (a fresh room and rid). Returns (prefill's response, decode's response)."""
        body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
                **self.bootstrap(secrets.randbits(63), secrets.token_hex(8))}

        async def both():
            async with httpx.AsyncClient(timeout=timeout_s) as c:
                return await asyncio.gather(c.post(self.prefill_url + "/generate", json=body),
                                            c.post(self.decode_url + "/generate", json=body))

        return asyncio.run(both())


def _wait(url: str, procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 60.0) -> None:
    """Until the worker at `url` answers; fails at once when any of `procs` (the pair) exited, with its log."""
    def answers() -> bool:
        for p, log in zip(procs, logs):
            if p.poll() is not None:
                raise RuntimeError(f"worker exited with {p.returncode}:\n{log.read_text()[-3000:]}")
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False
    wait_for(answers, timeout_s, f"{url} to answer", interval_s=0.2)


def start_pair(tmp: Path, extra: list[str] = (), prefill_extra: list[str] = (),
               decode_extra: list[str] = (), env: dict[str, str] | None = None,
               ready_timeout_s: float = 60.0) -> WorkerPair:
    p_port, b_port, d_port = free_ports(3)
    common = ["--host", "127.0.0.1", "--max-total-tokens", "4096", "--context-length", "1024", *extra]
    cmds = [
        [sys.executable, "-m", "dsv4_cluster.workers.prefill", "--port", str(p_port),
         "--disaggregation-bootstrap-port", str(b_port), *common, *prefill_extra],
        [sys.executable, "-m", "dsv4_cluster.workers.decode", "--port", str(d_port), *common, *decode_extra],
    ]
    logs = [tmp / "prefill.log", tmp / "decode.log"]
    procs = [subprocess.Popen(c, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env) for c, log in zip(cmds, logs)]
    pair = WorkerPair(f"http://127.0.0.1:{p_port}", b_port, f"http://127.0.0.1:{d_port}", procs, logs, cmds)
    try:
        wait_ready(pair, ready_timeout_s)
    except BaseException:
        stop_pair(pair)
        raise
    return pair


def wait_ready(pair: WorkerPair, timeout_s: float = 60.0) -> None:
    for url in (pair.prefill_url + "/health", f"http://127.0.0.1:{pair.bootstrap_port}/route",
                pair.decode_url + "/health"):
        _wait(url, pair.procs, pair.logs, timeout_s)


def restart(pair: WorkerPair, index: int) -> None:
    """Start worker `index` (0 prefill, 1 decode) again with its old command line (same ports, same
    NIXL agent name), after whatever ended it, and wait until the pair is ready."""
    pair.procs[index].wait(10)
    with pair.logs[index].open("a") as log:
        pair.procs[index] = subprocess.Popen(pair.cmds[index], stdout=log, stderr=subprocess.STDOUT)
    wait_ready(pair)


def stop_pair(pair: WorkerPair) -> None:
    for p in pair.procs:
        p.terminate()
    for p in pair.procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
