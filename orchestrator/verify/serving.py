"""What `verify` asks of a cluster through its router: right answers (the answer set, SGLang only: the embedded
model's text is meaningless) and no collapse in speed against the last good run (an eager-mode fallback
answers correctly, only slower).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from dsv4_cluster.kernels.sglang_plugin.attestation import read_json
from dsv4_cluster.orchestrator.processes import write_atomically
from dsv4_cluster.orchestrator.verify.answer_set import ANSWERS, MAX_TOKENS, PASS_RATE

PROBE_REQUESTS = 4
PROBE_TOKENS = 64
DROP_WARN = 0.5  # warn when throughput falls below half the last good run
LAST_GOOD = "last-good-throughput.json"
NO_THINKING = {"thinking": False}  # DeepSeek's chat template: answer directly, no reasoning preamble
_INT = re.compile(r"-?\d[\d,]*")


@dataclass(frozen=True)
class AnswerReport:
    passed: int
    total: int
    misses: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.passed >= PASS_RATE * self.total

    def summary(self) -> str:
        head = f"answers: {self.passed}/{self.total} exact (pass rate {PASS_RATE:.0%})"
        return head if self.ok else head + "; misses:\n  " + "\n  ".join(self.misses)


def first_integer(text: str) -> int | None:
    match = _INT.search(text or "")
    return int(match.group().replace(",", "")) if match else None


def _chat(client: httpx.Client, base: str, model: str, prompt: str, max_tokens: int,
          **extra: Any) -> dict[str, Any]:
    r = client.post(f"{base}/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, **extra})
    r.raise_for_status()
    return r.json()


def check_answers(base: str, model: str, timeout_s: float = 120.0) -> AnswerReport:
    """Send every shipped question through the router at `base` (".../v1")."""
    passed, misses = 0, []
    with httpx.Client(timeout=timeout_s) as client:
        for prompt, answer in ANSWERS:
            try:
                body = _chat(client, base, model, prompt, MAX_TOKENS, chat_template_kwargs=NO_THINKING)
                reply = body["choices"][0]["message"].get("content") or ""
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                misses.append(f"{prompt!r}: request failed: {e}")
                continue
            got = first_integer(reply)
            if got == answer:
                passed += 1
            else:
                misses.append(f"{prompt!r}: expected {answer}, got {reply[:80]!r}")
    return AnswerReport(passed, len(ANSWERS), tuple(misses))


def probe_throughput(base: str, model: str, timeout_s: float = 120.0) -> float:
    """Completion tokens per second over `PROBE_REQUESTS` sequential requests of `PROBE_TOKENS`."""
    tokens, started = 0, time.monotonic()
    with httpx.Client(timeout=timeout_s) as client:
        for i in range(PROBE_REQUESTS):
            body = _chat(client, base, model, f"Count from {i} upwards, one number per line.", PROBE_TOKENS)
            tokens += int(body.get("usage", {}).get("completion_tokens", 0))
    elapsed = time.monotonic() - started
    if tokens == 0:
        raise httpx.HTTPError("the throughput probe got no completion tokens back")
    return tokens / elapsed


def compare_with_last_good(run_dir: str | Path, tokens_per_s: float) -> str | None:
    """A warning when `tokens_per_s` fell past DROP_WARN of the stored last good run, else None."""
    data = read_json(Path(run_dir) / LAST_GOOD)
    last = data.get("tokens_per_s") if data else None
    if isinstance(last, (int, float)) and last > 0 and tokens_per_s < DROP_WARN * last:
        return (f"throughput {tokens_per_s:.1f} tok/s is {tokens_per_s / last:.0%} of the last good run "
                f"({last:.1f} tok/s, {data.get('time', '?')}): an eager-mode fallback or a slow kernel looks like this")
    return None


def store_last_good(run_dir: str | Path, tokens_per_s: float) -> None:
    write_atomically(Path(run_dir) / LAST_GOOD, json.dumps(
        {"tokens_per_s": tokens_per_s, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}) + "\n")
