"""The record of the running cluster (`<home>/current.json`, private to its owner), so `status` and `down` need no
arguments: Ray address, namespace, whether `up` started the Ray head, endpoint, the router's admin token.
`<home>` is `~/.dsv4-cluster`, or `$DSV4_CLUSTER_HOME`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

HOME_ENV = "DSV4_CLUSTER_HOME"
RECORD_FILE = "current.json"


class RecordError(RuntimeError):
    """No cluster is recorded, or the record file is unreadable."""


def cluster_home() -> Path:
    """The folder holding the cluster record; the one place HOME_ENV is read."""
    override = os.environ.get(HOME_ENV)
    return Path(override) if override else Path.home() / ".dsv4-cluster"


@dataclass(frozen=True)
class HeadProcess:
    """A Ray head `up` started: `ray start --head --block`, the leader of its process group."""

    pid: int
    log_path: str


@dataclass(frozen=True)
class ClusterRecord:
    address: str
    namespace: str
    endpoint: str
    topology_path: str
    run_dir: str
    head: HeadProcess | None  # None: `up` joined a Ray cluster someone else started
    admin_token: str | None = field(default=None, repr=False)  # the router's admin API token


class _HeadModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pid: int
    log_path: str


class _RecordModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    address: str
    namespace: str
    endpoint: str
    topology_path: str
    run_dir: str
    head: _HeadModel | None
    admin_token: str | None = None


def record_path() -> Path:
    return cluster_home() / RECORD_FILE


def write_record(record: ClusterRecord) -> Path:
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # it holds the admin token
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(asdict(record), indent=2) + "\n")
    tmp.replace(path)
    return path


def read_record() -> ClusterRecord:
    """The recorded cluster; raises RecordError when there is none."""
    path = record_path()
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"no cluster is up (no {path}); start one with `dsv4-cluster up FILE`") from None
    except (OSError, json.JSONDecodeError) as e:
        raise RecordError(f"cannot read the cluster record {path}: {e}; remove it if no cluster "
                          "is running") from e
    try:
        m = _RecordModel.model_validate(raw)
    except ValidationError as e:
        raise RecordError(f"the cluster record {path} is invalid ({e.error_count()} errors); "
                          "remove it if no cluster is running") from e
    head = HeadProcess(m.head.pid, m.head.log_path) if m.head else None
    return ClusterRecord(m.address, m.namespace, m.endpoint, m.topology_path, m.run_dir, head, m.admin_token)


def clear_record() -> None:
    record_path().unlink(missing_ok=True)
