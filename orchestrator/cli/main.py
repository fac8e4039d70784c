"""The `dsv4-cluster` entry point. `status` asks the controller's loopback status endpoint first (no Ray driver,
none of the other commands' imports: well under a second); otherwise, and for every other command, `commands.py`.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["status"] and set(args[1:]) <= {"--json"}:
        from dsv4_cluster.orchestrator.cli.table import endpoint_status, print_status

        status, _ = endpoint_status()
        if status is not None:
            print_status(status, "--json" in args)
            return 0
    from dsv4_cluster.orchestrator.cli.commands import main as run_command

    return run_command(argv)


if __name__ == "__main__":
    sys.exit(main())
