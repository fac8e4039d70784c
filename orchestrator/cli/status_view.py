"""`dsv4-cluster status` from the controller's status endpoint (`supervise/status_endpoint.py`): its status
now, over loopback HTTP, without Ray and without the other commands' imports."""

from __future__ import annotations

import json

from dsv4_cluster.core import ClusterStatus
from dsv4_cluster.orchestrator.cli.table import render_table
from dsv4_cluster.orchestrator.cluster.record import RecordError, read_record
from dsv4_cluster.orchestrator.supervise.status_endpoint import EndpointUnavailable, read_status


def endpoint_status() -> tuple[ClusterStatus | None, str | None]:
    """The controller's status through its endpoint; else (None, why not: None when no cluster is recorded,
    which the Ray path reports)."""
    try:
        record = read_record()
    except RecordError:
        return None, None
    try:
        return read_status(record.run_dir), None
    except EndpointUnavailable as e:
        return None, f"{e}; asking the controller through Ray"


def print_status(status: ClusterStatus, as_json: bool) -> None:
    print(json.dumps(status.to_dict(), indent=2) if as_json else render_table(status), flush=True)
