"""What one running router holds: settings, pool, the upstream connections, metrics and background tasks."""

from __future__ import annotations

from dataclasses import dataclass

from .metrics import RouterMetrics
from .pool import WorkerPool
from .settings import RouterSettings
from .tasks import TaskSet
from .upstream import Upstream


@dataclass(frozen=True)
class RouterState:
    """Built in the app's lifespan (the upstream connections live there) and kept on `app.state.router`."""

    settings: RouterSettings
    pool: WorkerPool
    upstream: Upstream
    tasks: TaskSet
    metrics: RouterMetrics
    created: int
