"""The record of the running cluster (`<home>/current.json`, private to its owner), so `status` and `down` need no
arguments: Ray address, namespace, whether `up` started the Ray head, endpoint, the router's admin token.
`<home>` is `~/.dsv4-cluster`, or `$DSV4_CLUSTER_HOME`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import ConfigDict, TypeAdapter, ValidationError

from dsv4_cluster.orchestrator.errors import NotUpError
from dsv4_cluster.orchestrator.processes import write_atomically

HOME_ENV = "DSV4_CLUSTER_HOME"
RECORD_FILE = "current.json"
LAST_FILE = "last.json"   # the last cluster's run folder, once its record is gone


class RecordError(NotUpError):
    """No cluster is recorded, or the record file is unreadable (to the CLI: nothing is up)."""


def cluster_home() -> Path:
    """The folder holding the cluster record; the one place HOME_ENV is read."""
    override = os.environ.get(HOME_ENV)
    return Path(override) if override else Path.home() / ".dsv4-cluster"


@dataclass(frozen=True)
class HeadProcess:
    """A Ray head `up` started: `ray start --head --block`, the leader of its process group."""

    __pydantic_config__ = ConfigDict(extra="forbid")   # read back with pydantic (`read_record`)
    pid: int
    log_path: str


@dataclass(frozen=True)
class ClusterRecord:
    __pydantic_config__ = ConfigDict(extra="forbid")
    address: str
    namespace: str
    endpoint: str
    topology_path: str
    run_dir: str
    head: HeadProcess | None  # None: `up` joined a Ray cluster someone else started
    admin_token: str | None = field(default=None, repr=False)  # the router's admin API token


def record_path() -> Path:
    return cluster_home() / RECORD_FILE


def no_record() -> RecordError | None:
    """What `read_record` raises when no cluster is recorded (no record file), else None (one, readable or not)."""
    path = record_path()
    return None if path.exists() else _none_at(path)


def _none_at(path: Path) -> RecordError:
    return RecordError(f"no cluster is up (no {path}); start one with `dsv4-cluster up FILE`")


def write_record(record: ClusterRecord) -> Path:
    path = record_path()
    write_atomically(path, json.dumps(asdict(record), indent=2) + "\n", mode=0o600)  # it holds the admin token
    return path


def read_record() -> ClusterRecord:
    """The recorded cluster; raises RecordError when there is none."""
    path = record_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise _none_at(path) from None
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"cannot read the cluster record {path}: {e}; remove it if no cluster "
                          "is running") from e
    try:
        return TypeAdapter(ClusterRecord).validate_python(raw)
    except ValidationError as e:
        raise RecordError(f"the cluster record {path} is invalid ({e.error_count()} errors); "
                          "remove it if no cluster is running") from e


def clear_record() -> None:
    """Remove the record; keep where the cluster's logs are (`last_run`), for `logs` once it is gone."""
    path = record_path()
    try:
        last = {"run_dir": json.loads(path.read_text())["run_dir"], "ended": time.time()}
        write_atomically(cluster_home() / LAST_FILE, json.dumps(last) + "\n")
    except (OSError, ValueError, KeyError, TypeError):
        pass   # no record, or an unreadable one: nothing to keep
    path.unlink(missing_ok=True)


def last_run() -> tuple[Path, float] | None:
    """(run folder, when it ended) of the last cluster `down` stopped (or found gone), None if none is known."""
    try:
        last = json.loads((cluster_home() / LAST_FILE).read_text())
        return Path(last["run_dir"]), float(last["ended"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
