"""The `dsv4-cluster` entry point. `status` asks the controller's loopback status endpoint first (no Ray driver,
none of the other commands' imports: well under a second); otherwise, and for every other command, `commands.py`.
"""

from __future__ import annotations

import os
import sys


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command SIGPIPE ended


def main(argv: list[str] | None = None) -> int:
    """Every command; a reader that goes away (`status | head`) ends it quietly, as SIGPIPE would, not with a
    traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit must not fail on the pipe again
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
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
