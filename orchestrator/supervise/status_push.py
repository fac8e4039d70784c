"""The supervisor's end of status: its row pushed to the controller, so that reading status asks no supervisor.

What changes how often, and why it is pushed as it is:
- state, error, restarts, pid and history change on events (a transition, a spawn, a restart): each event wakes
  the pusher, which sends the new row at once;
- KV usage and stranded KV change with every request; they (and the kernels) are only *read* on the supervisor's
  health poll (`supervisor.py`, every `HealthPolicy.interval_s`), and a reading that changed the row wakes the
  pusher, so they are pushed on change at most once per poll. Reading them at each `status` instead would put an
  HTTP call per worker back on the read path this module takes off it; Prometheus scrapes the workers for the
  time series;
- pinning (nvidia-smi on a GPU machine: slow) is read at READY and every `PINNING_EVERY_POLLS` polls;
- a troubled worker's log tail is read when its row is pushed (on an event, or with a heartbeat).
An unchanged row is sent again every `HEARTBEAT_S`: the controller tells a supervisor that has nothing new from
one that stopped pushing (dead or hung) by the age of its last push (`row_store.py`).

This module imports Ray only inside `ControllerSink`, which runs in an actor (Ray's environment is set there).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Callable

from dsv4_cluster.core import WorkerStatus

HEARTBEAT_S = 4.0  # two health polls: an unchanged row is pushed again this often
RETRY_S = 1.0  # after a failed push, the next try (the row of that moment) comes this much later at the latest
PUSH_TIMEOUT_S = 10.0  # one report's wait for the controller's answer
logger = logging.getLogger(__name__)


class PushError(RuntimeError):
    """A row did not reach the controller (it is dead, restarting or busy); the next push sends the latest."""


def _content(row: WorkerStatus) -> WorkerStatus:
    """The row without its read time: what a push compares to tell a change."""
    return dataclasses.replace(row, reported_at=None)


class StatusPusher:
    """Sends `read()`'s row through `send` on every `changed()` that changed it, and every `HEARTBEAT_S` anyway.

    One thread, one send at a time: rows arrive in the order they were read. A failed send is retried by the
    next wake-up or heartbeat, with the row of that moment."""

    def __init__(self, name: str, read: Callable[[], WorkerStatus], send: Callable[[WorkerStatus], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._name, self._read, self._send, self._clock = name, read, send, clock
        self._wake = threading.Event()
        self._sent: WorkerStatus | None = None  # the content of the last row the controller took
        self._due = float("-inf")  # when the row goes even unchanged (a heartbeat, or a retry)
        self._thread = threading.Thread(target=self._run, name=f"status-push-{name}", daemon=True)

    def start(self) -> None:
        self._wake.set()  # announce: the first row goes at once (a restarted supervisor's too)
        self._thread.start()

    def changed(self) -> None:
        """Something in the row may have changed: push it now if it did."""
        self._wake.set()

    def push_once(self) -> bool:
        """Read the row and send it if it changed or a heartbeat is due; whether it was sent."""
        row = self._read()
        content, now = _content(row), self._clock()
        if content == self._sent and now < self._due:
            return False
        try:
            self._send(row)
        except PushError as e:
            logger.debug("%s: status not pushed (%s); trying again", self._name, e)
            self._sent, self._due = None, now + RETRY_S  # whatever the controller has, the row goes again
            return False
        self._sent, self._due = content, now + HEARTBEAT_S
        return True

    def _run(self) -> None:
        while True:
            self._wake.wait(max(self._due - self._clock(), 0.0))
            self._wake.clear()
            self.push_once()


class ControllerSink:
    """`send` for a supervisor actor: the row to the controller actor's `report`, one call outstanding at most
    (a report left unanswered is waited for before the next is sent, so a controller that is away does not
    collect a queue of rows)."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller
        self._pending: Any = None  # the ObjectRef of a report not answered in time

    def __call__(self, row: WorkerStatus) -> None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        if self._pending is not None:
            ready, _ = ray.wait([self._pending], timeout=PUSH_TIMEOUT_S)
            if not ready:
                raise PushError("the previous report is still unanswered")
            self._pending = None  # answered or failed: either way a newer row goes now
        ref = self._controller.report.remote(row)
        try:
            ray.get(ref, timeout=PUSH_TIMEOUT_S)
        except GetTimeoutError:
            self._pending = ref
            raise PushError(f"no answer within {PUSH_TIMEOUT_S:.0f}s") from None
        except (RayActorError, RayTaskError) as e:
            raise PushError(str(e).split("\n")[0]) from None

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return ControllerSink, (self._controller,)  # travels to the actor without a pending call
