"""The orchestrator's typed errors, in a module free of Ray so the CLI can catch them before
it imports Ray (see ray_env)."""

from __future__ import annotations


class PreflightError(RuntimeError):
    """The topology is valid but cannot start here; `problems` lists why. Nothing was started."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


class ClusterStartError(RuntimeError):
    """The cluster did not come up; what was started has been stopped. The message lists each
    failed process with its log tail."""


class AlreadyUpError(RuntimeError):
    """A cluster is already recorded, or its namespace already has a controller; nothing was
    started."""


class RayClusterError(RuntimeError):
    """The Ray head could not be started, reached or stopped."""


class NotUpError(RuntimeError):
    """There is no cluster to report on or stop."""


CLEAN_UP = "; run `dsv4-cluster down` to clean up"   # a NotUpError's advice, which `down` itself leaves out


class ForeignControllerError(NotUpError):
    """The recorded cluster's Ray namespace holds another cluster's controller: the recorded one is gone, and
    nothing found there may be touched."""


class UnknownWorkerError(ValueError):
    """An operation named a worker the cluster does not have; the message lists the names."""
