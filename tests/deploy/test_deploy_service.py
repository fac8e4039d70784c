"""`dsv4-cluster install-service`: the rendered unit passes `systemd-analyze verify`, says what
the issue asks (Restart=always with a start limit, after the network, a stop timeout that covers
`down`, journald), and bad input is refused with a clear error."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4_cluster.orchestrator.cluster.options import DownOptions
from dsv4_cluster.orchestrator.cli.service import stop_timeout_s

from bench.local_cluster import run_cli, write_topology
from tests.deploy_tools import require_tool


def _unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read_string(text)
    return parser


def test_install_service_writes_a_unit_systemd_accepts(tmp_path: Path) -> None:
    tool = require_tool("systemd-analyze")
    cluster = write_topology(tmp_path)
    units = tmp_path / "units"
    units.mkdir()
    out = run_cli(cluster.home, "install-service", str(cluster.topology), "--unit-dir", str(units),
                  "--name", "dsv4-test", timeout=60)
    assert out.returncode == 0, out.stderr
    unit_path = units / "dsv4-test.service"
    for line in ("systemctl enable --now dsv4-test", "systemctl status dsv4-test",
                 "journalctl -u dsv4-test -f", str(unit_path)):
        assert line in out.stdout
    text = unit_path.read_text()
    assert "@" not in text.replace("(@…@)", "")  # every placeholder filled
    verify = subprocess.run([tool, "verify", str(unit_path)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr

    unit = _unit(text)
    svc = unit["Service"]
    assert svc["ExecStart"] == (f"{sys.executable} -m dsv4_cluster.orchestrator up --foreground "
                                f"--timeout 600 {cluster.topology}")
    assert (svc["Restart"], svc["KillMode"], svc["StandardOutput"]) == ("always", "mixed", "journal")
    assert int(unit["Unit"]["StartLimitBurst"]) > 1 and int(unit["Unit"]["StartLimitIntervalSec"]) > 0
    assert unit["Unit"]["After"] == "network-online.target"
    assert int(svc["TimeoutStopSec"]) == stop_timeout_s(DownOptions().timeout_s)
    assert int(svc["TimeoutStopSec"]) > 3 * DownOptions().timeout_s
    assert f"DSV4_CLUSTER_HOME={cluster.home}" in text  # status/down as that user find the cluster
    assert svc["WorkingDirectory"] == str(cluster.topology.parent)


def test_verify_rejects_a_broken_unit(tmp_path: Path) -> None:
    """The check above can fail: systemd-analyze refuses a unit whose program is missing."""
    tool = require_tool("systemd-analyze")
    cluster = write_topology(tmp_path)
    out = run_cli(cluster.home, "install-service", str(cluster.topology), "--dry-run", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "nothing written" in out.stderr
    broken = tmp_path / "dsv4-cluster.service"
    broken.write_text(out.stdout.replace(sys.executable, str(tmp_path / "no-such-python")))
    verify = subprocess.run([tool, "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert verify.returncode != 0 and "no-such-python" in verify.stderr


@pytest.mark.parametrize("args, needle", [
    (["--user", "no-such-user-xyz"], "user 'no-such-user-xyz' does not exist"),
    (["--unit-dir", "/nonexistent-dir"], "/nonexistent-dir is not a directory"),
    (["--name", "bad name"], "a unit name takes"),
])
def test_install_service_refuses_bad_input(tmp_path: Path, args: list[str], needle: str) -> None:
    cluster = write_topology(tmp_path)
    out = run_cli(cluster.home, "install-service", str(cluster.topology), *args, timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr
    assert out.stdout == ""


def test_install_service_names_topology_problems(tmp_path: Path) -> None:
    bad = tmp_path / "topology.yaml"
    bad.write_text("engine: embedded\nmodel: {name: x, context_length: 8}\nprefill: []\ndecode: []\n")
    out = run_cli(tmp_path / "home", "install-service", str(bad), "--dry-run", timeout=60)
    assert out.returncode == 2 and "no unit was written" in out.stderr and "prefill" in out.stderr
