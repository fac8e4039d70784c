"""`up`'s preflight through the real CLI: a problem it names stops `up` before any process starts."""

from __future__ import annotations

from pathlib import Path

from bench.local_cluster import run_cli, write_topology


def test_a_run_dir_up_cannot_create_is_named_and_nothing_starts(tmp_path: Path) -> None:
    """Seen by a review: `cluster.run_dir` under a file made `up` die with a traceback as it started the Ray head."""
    cluster = write_topology(tmp_path)
    (tmp_path / "taken").write_text("a file, not a folder\n")
    cluster.topology.write_text(cluster.topology.read_text().replace("run_dir: run", "run_dir: taken/run"))
    r = run_cli(cluster.home, "up", str(cluster.topology), timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "nothing was started" in r.stderr and f"cluster.run_dir {tmp_path / 'taken' / 'run'}: cannot create" \
        in r.stderr, r.stderr
    assert not (cluster.home / "current.json").exists()
