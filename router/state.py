"""What one running router holds: settings, pools, the upstream client and its background tasks."""

from __future__ import annotations

from dataclasses import dataclass

from .pool import WorkerPool
from .settings import RouterSettings
from .tasks import TaskSet
from .upstream import Upstream


@dataclass(frozen=True)
class RouterState:
    """Built in the app's lifespan (the httpx client lives there) and kept on `app.state.router`."""

    settings: RouterSettings
    pool: WorkerPool
    upstream: Upstream
    tasks: TaskSet
    created: int
