"""`wait_started`: the supervisors' `start` calls of one `up`, as they finish. A fake `ray.wait` hands the calls out in a
scripted order (the clock is real: the grace is short)."""

from __future__ import annotations

from typing import Any

from ray.exceptions import RayTaskError

from dsv4_cluster.orchestrator.supervise.start_wait import wait_started


class _Failed(RayTaskError):
    def __init__(self, message: str) -> None:   # what a supervisor's WorkerStartError arrives as
        Exception.__init__(self, message)
        self.cause = RuntimeError(message)


class _Calls:
    """Each wait returns the next scripted call that is still pending; `None` in the script: nothing more finishes
    (the wait returns nothing once its timeout passes, or would block forever)."""

    def __init__(self, order: list[str | None], outcomes: dict[str, Any]) -> None:
        self.order, self.outcomes, self.timeouts = list(order), outcomes, []

    def wait(self, pending: list[str], num_returns: int, timeout: float | None) -> tuple[list[str], list[str]]:
        assert num_returns == 1
        self.timeouts.append(timeout)
        nxt = self.order.pop(0) if self.order else None
        if nxt is None:
            assert timeout is not None, "a wait without a timeout for a call that never finishes: up would hang"
            return [], pending
        return [nxt], [p for p in pending if p != nxt]

    def get(self, ref: str) -> Any:
        outcome = self.outcomes[ref]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_every_call_ready_returns_every_row_and_no_failure() -> None:
    calls = _Calls(["decode-0", "prefill-0"], {"prefill-0": "row p", "decode-0": "row d"})
    rows, failures = wait_started({"prefill-0": "prefill-0", "decode-0": "decode-0"}, wait=calls.wait, get=calls.get)
    assert (rows, failures) == (["row d", "row p"], [])
    assert calls.timeouts == [None, None]   # no failure: each start may take as long as its own timeout


def test_a_failure_ends_the_wait_after_the_grace_and_names_those_still_starting() -> None:
    """decode-0 fails at once; prefill-0 is still loading its model: up does not wait for it."""
    calls = _Calls(["decode-0", None], {"decode-0": _Failed("exited with code 2: unrecognized --no-such-flag"),
                                        "prefill-0": "row p"})
    rows, failures = wait_started({"prefill-0": "prefill-0", "decode-0": "decode-0"}, grace_s=0.5,
                                  wait=calls.wait, get=calls.get)
    assert rows == []
    assert failures == ["decode-0: exited with code 2: unrecognized --no-such-flag",
                        "prefill-0: still starting when the failure above stopped the cluster"]
    assert calls.timeouts[0] is None and 0 < calls.timeouts[1] <= 0.5


def test_failures_within_the_grace_are_all_listed_in_the_plans_order() -> None:
    calls = _Calls(["decode-1", "prefill-0", "decode-0"],
                   {"decode-1": _Failed("port 30101 is in use"), "prefill-0": "row p",
                    "decode-0": _Failed("never became ready: CUDA out of memory")})
    rows, failures = wait_started({"prefill-0": "prefill-0", "decode-0": "decode-0", "decode-1": "decode-1"},
                                  wait=calls.wait, get=calls.get)
    assert rows == ["row p"]
    assert failures == ["decode-0: never became ready: CUDA out of memory", "decode-1: port 30101 is in use"]
