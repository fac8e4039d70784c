"""Background work that outlives one request handler: draining a prefill leg, aborting legs.

Tasks are kept in a set until done (asyncio holds only weak references to tasks), their failures
are logged, and the app's lifespan cancels whatever is left at shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class TaskSet:
    """Owns background tasks from spawn to completion."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())

    async def aclose(self) -> None:
        """Cancel what is still running and wait for it to finish."""
        pending = list(self._tasks)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
