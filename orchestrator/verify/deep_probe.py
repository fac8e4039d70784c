"""The deep probe: periodically, the router's 2-token greedy `/generate` with a fresh room, POSTed to each
prefill -> decode pair at once. SGLang's `/health` never tests the P<->D link; this does. It changes no state.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import httpx

from dsv4_cluster.core import ProbeResult, Role
from dsv4_cluster.orchestrator.launch.plan import LaunchPlan

logger = logging.getLogger(__name__)
STOP_WAIT_S = 2.0  # how long `stop` waits for a probe in flight
PROBE_BODY = {"text": "deep probe", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}


@dataclass(frozen=True)
class PairEndpoints:
    prefill: str
    decode: str
    prefill_url: str
    bootstrap_host: str
    bootstrap_port: int
    decode_url: str

    @classmethod
    def of(cls, prefill: LaunchPlan, decode: LaunchPlan) -> PairEndpoints:
        boot = urlsplit(prefill.readiness_urls[0])  # the bootstrap server's /health (plan.worker_plan)
        return cls(prefill.name, decode.name, prefill.health_url.removesuffix("/health"),
                   str(boot.hostname), int(boot.port or 8998), decode.health_url.removesuffix("/health"))


def probe_pair(client: httpx.Client, pair: PairEndpoints) -> ProbeResult:
    """One request through the pair; never raises."""
    room = secrets.randbits(63)
    body = {**PROBE_BODY, "bootstrap_host": pair.bootstrap_host, "bootstrap_port": pair.bootstrap_port,
            "bootstrap_room": room, "rid": f"deep-probe-{room:x}"}
    started, at = time.monotonic(), time.time()
    with ThreadPoolExecutor(2) as pool:
        legs = [pool.submit(client.post, url + "/generate", json=body) for url in (pair.prefill_url, pair.decode_url)]
        errors = []
        for name, leg in zip((pair.prefill, pair.decode), legs):
            try:
                r = leg.result()
            except httpx.HTTPError as e:
                errors.append(f"{name}: {type(e).__name__}")
                continue
            if r.status_code != 200:
                errors.append(f"{name}: HTTP {r.status_code} {r.text[:200]}")
    return ProbeResult(pair.prefill, pair.decode, not errors, time.monotonic() - started, at,
                       "; ".join(errors) or None)


class DeepProber:
    """Probes every prefill x decode pair every `interval_s` on its own thread until `stop`."""

    def __init__(self, workers: tuple[LaunchPlan, ...], interval_s: float, timeout_s: float = 30.0,
                 ready: Callable[[str], bool] = lambda name: True) -> None:
        """`ready(name)`: whether a worker is READY now; a pair with one that is not (drained, stopped, restarting)
        is not probed, and its last result is dropped (it spoke of a process that is gone or going)."""
        self._ready = ready
        prefill = [w for w in workers if w.role is Role.PREFILL]
        decode = [w for w in workers if w.role is Role.DECODE]
        self._pairs = [PairEndpoints.of(p, d) for p in prefill for d in decode]
        self._interval_s = interval_s
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=2.0), trust_env=False)
        self._results: dict[tuple[str, str], ProbeResult] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deep-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pair in self._pairs:
                if not (self._ready(pair.prefill) and self._ready(pair.decode)):
                    with self._lock:
                        self._results.pop((pair.prefill, pair.decode), None)
                    continue
                result = probe_pair(self._client, pair)
                if self._stop.is_set():  # stopped while it was in flight: its answer is no one's business
                    return
                if not result.ok:
                    logger.warning("deep probe %s -> %s failed: %s", result.prefill, result.decode, result.error)
                with self._lock:
                    self._results[(pair.prefill, pair.decode)] = result
            self._stop.wait(self._interval_s)

    def results(self) -> tuple[ProbeResult, ...]:
        with self._lock:
            return tuple(self._results.values())

    def stop(self) -> None:
        """Stop probing. A probe in flight is not waited for past STOP_WAIT_S: a pair whose decode died mid-probe
        holds it until the prefill's stranded-KV timeout (30 s by default), and `down` would wait that long. The
        thread is a daemon and ends with the controller's process; the client is closed once the thread is done."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(STOP_WAIT_S)
        if not self._thread.is_alive():
            self._client.close()
