"""`dsv4-cluster install-service FILE`: the systemd unit of one topology, rendered with real paths.

Every `@NAME@` of `deploy/systemd/dsv4-cluster.service` is filled here and nowhere else; one left unfilled is an
error, so template and code cannot drift.
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dsv4_cluster.deploy import path as deploy_path
from dsv4_cluster.orchestrator.cluster.options import DownOptions, UpOptions
from dsv4_cluster.orchestrator.cluster.record import HOME_ENV
from dsv4_cluster.orchestrator.topology.load import TopologyError, load_topology

TEMPLATE = ("systemd", "dsv4-cluster.service")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DOWN_ROUNDS = 3  # router, then workers, then the Ray head: each may take the full down deadline
DOWN_RAY_MARGIN_S = 60  # Ray calls of `down` around those rounds
_PLACEHOLDER = re.compile(r"@([A-Z_]+)@")


class ServiceError(RuntimeError):
    """The unit cannot be rendered or written; the message says why and what to do."""


@dataclass(frozen=True)
class ServiceOptions:
    unit_dir: str = "/etc/systemd/system"
    name: str = "dsv4-cluster"
    user: str = field(default_factory=lambda: pwd.getpwuid(os.getuid()).pw_name)
    dry_run: bool = False
    up_timeout_s: float = UpOptions().timeout_s
    down_timeout_s: float = DownOptions().timeout_s
    restart_sec: int = 10
    start_limit_burst: int = 5
    start_limit_interval_s: int = 900


def _exec_arg(arg: str) -> str:
    """One ExecStart= word: `%` and `$` escaped; quoted when it holds a space or a quote."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\]", arg):
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def _setting(value: str) -> str:
    """A value on the right of `Key=`: specifiers escaped, one line."""
    if "\n" in value:
        raise ServiceError(f"{value!r} holds a newline; it cannot go into a unit file")
    return value.replace("%", "%%")


def _cluster_home(user: str) -> str:
    override = os.environ.get(HOME_ENV)
    if override:
        return str(Path(override).absolute())
    return str(Path(pwd.getpwnam(user).pw_dir) / ".dsv4-cluster")


def stop_timeout_s(down_timeout_s: float) -> int:
    """TimeoutStopSec: every round of `down` at its deadline, plus its Ray calls."""
    return int(DOWN_ROUNDS * down_timeout_s + DOWN_RAY_MARGIN_S)


def render_unit(topology_file: str, options: ServiceOptions) -> str:
    """The unit text for `topology_file`; raises TopologyError or ServiceError."""
    topology_path = Path(topology_file).absolute()
    topology = load_topology(topology_path)
    try:
        pwd.getpwnam(options.user)
    except KeyError:
        raise ServiceError(f"user {options.user!r} does not exist on this machine; pass "
                           "--user with an existing account") from None
    python = Path(sys.executable).absolute()
    values = {
        "UNIT": _setting(options.name),
        "MODEL": _setting(topology.model.name),
        "TOPOLOGY": _exec_arg(str(topology_path)),
        "USER": _setting(options.user),
        "WORKDIR": _setting(str(topology_path.parent)),
        "PATH": _setting(f"{python.parent}:{SYSTEM_PATH}"),
        "CLUSTER_HOME": _setting(_cluster_home(options.user)),
        "PYTHON": _exec_arg(str(python)),
        "UP_TIMEOUT_S": f"{options.up_timeout_s:g}",
        "DOWN_TIMEOUT_S": f"{options.down_timeout_s:g}",
        "STOP_TIMEOUT_S": str(stop_timeout_s(options.down_timeout_s)),
        "RESTART_SEC": str(options.restart_sec),
        "START_LIMIT_BURST": str(options.start_limit_burst),
        "START_LIMIT_INTERVAL_S": str(options.start_limit_interval_s),
    }
    template = deploy_path(*TEMPLATE).read_text()
    missing = sorted(set(_PLACEHOLDER.findall(template)) - set(values))
    if missing:
        raise ServiceError(f"the unit template has placeholders nothing fills: {', '.join(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def operator_lines(unit_path: Path, name: str) -> list[str]:
    """What to run next, one command per line."""
    return ["systemctl daemon-reload", f"systemctl enable --now {name}",
            f"systemctl status {name}", f"journalctl -u {name} -f",
            f"(unit file: {unit_path})"]


def install(topology_file: str, options: ServiceOptions) -> tuple[str, Path | None]:
    """Render the unit and write it (unless dry_run); returns (text, written path or None)."""
    text = render_unit(topology_file, options)
    if options.dry_run:
        return text, None
    unit_dir = Path(options.unit_dir)
    if not unit_dir.is_dir():
        raise ServiceError(f"{unit_dir} is not a directory; pass --unit-dir with systemd's unit "
                           "folder (/etc/systemd/system)")
    target = unit_dir / f"{options.name}.service"
    try:
        target.write_text(text)
    except PermissionError:
        raise ServiceError(f"cannot write {target}: permission denied; run install-service as "
                           "root (sudo), or use --dry-run and copy the unit yourself") from None
    return text, target


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    d = ServiceOptions()
    p = sub.add_parser("install-service", help="write the systemd unit that runs `up --foreground FILE`")
    p.add_argument("file", help="topology YAML the service brings up")
    p.add_argument("--dry-run", action="store_true", help="print the unit instead of writing it")
    p.add_argument("--unit-dir", default=d.unit_dir, help=f"where to write it (default {d.unit_dir})")
    p.add_argument("--name", default=d.name, help=f"unit name (default {d.name})")
    p.add_argument("--user", default=d.user, help=f"account the cluster runs as (default {d.user})")
    p.add_argument("--timeout", type=float, default=d.up_timeout_s,
                   help=f"`up --timeout`: seconds each process may take to start (default {d.up_timeout_s:g})")


def main(args: argparse.Namespace) -> int:
    """The `install-service` command; exit 0 written (or printed), 2 when it cannot be."""
    if not re.fullmatch(r"[A-Za-z0-9:_.\\-]+", args.name):
        print(f"--name {args.name!r}: a unit name takes letters, digits and :_.-\\ only",
              file=sys.stderr)
        return 2
    options = ServiceOptions(unit_dir=args.unit_dir, name=args.name, user=args.user,
                             dry_run=args.dry_run, up_timeout_s=args.timeout)
    try:
        text, written = install(args.file, options)
    except TopologyError as e:
        print(f"{args.file}: {len(e.problems)} problem(s); no unit was written:\n{e}", file=sys.stderr)
        return 2
    except ServiceError as e:
        print(str(e), file=sys.stderr)
        return 2
    if written is None:
        print(text, end="")
        print(f"# dry run: nothing written; install it as {Path(options.unit_dir) / (options.name + '.service')}",
              file=sys.stderr)
        return 0
    print(f"wrote {written}; next:")
    for line in operator_lines(written, options.name):
        print(f"  {line}")
    return 0
