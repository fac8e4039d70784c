"""`up` again while a cluster is recorded: the same topology file reports the cluster and starts nothing, however
its path is spelled; another file is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsv4_cluster.orchestrator.cluster import deployment
from dsv4_cluster.orchestrator.cluster.record import ClusterRecord
from dsv4_cluster.orchestrator.errors import AlreadyUpError

from dsv4_cluster.core import ClusterStatus


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    topology = tmp_path / "conf" / "topology.yaml"
    topology.parent.mkdir()
    topology.write_text((Path(__file__).resolve().parents[2] / "examples" / "local.yaml").read_text())
    record = ClusterRecord(address="127.0.0.1:1", namespace="n", endpoint="http://127.0.0.1:2/v1",
                           topology_path=str(topology), run_dir=str(tmp_path / "run"), head=None)
    monkeypatch.setattr(deployment, "_existing_cluster", lambda: record)
    monkeypatch.setattr(deployment, "status", lambda: ClusterStatus(record.endpoint, ()))
    return topology


def test_up_again_with_the_same_file_by_another_path_starts_nothing(recorded: Path, monkeypatch) -> None:
    """Seen by a review: `up ../conf/topology.yaml` (or through a symlink) of the running cluster's own file said
    'a cluster is already up ... run `dsv4-cluster down` first' and exited 1."""
    (recorded.parent.parent / "link.yaml").symlink_to(recorded)
    (recorded.parent.parent / "other").mkdir()
    monkeypatch.chdir(recorded.parent.parent / "other")
    for spelling in ["../conf/topology.yaml", "../link.yaml", str(recorded)]:
        result = deployment.up(spelling, deployment.UpOptions())
        assert result.already_up, spelling


def test_up_with_another_file_is_refused(recorded: Path) -> None:
    other = recorded.parent / "other.yaml"
    other.write_text(recorded.read_text())
    with pytest.raises(AlreadyUpError, match="a cluster is already up"):
        deployment.up(str(other), deployment.UpOptions())
