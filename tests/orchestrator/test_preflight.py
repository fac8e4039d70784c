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


def test_the_run_dir_check_makes_no_folder_and_names_a_dangling_logs_link(tmp_path: Path) -> None:
    """The check leaves nothing behind (a failed preflight left an empty `<run_dir>/logs`); a `logs` that is a link to
    nothing is named here, not a FileExistsError once the head's start makes the folder."""
    from types import SimpleNamespace

    from dsv4_cluster.orchestrator.launch.preflight import run_dir_problems

    run = tmp_path / "run"
    assert run_dir_problems(SimpleNamespace(run_dir_path=str(run))) == [] and not run.exists()
    run.mkdir()
    (run / "logs").symlink_to(tmp_path / "nowhere")
    assert run_dir_problems(SimpleNamespace(run_dir_path=str(run))) == [
        f"cluster.run_dir {run}: cannot create {run / 'logs'} ({run / 'logs'} is not a folder) — pick a folder this "
        "user can write"]
