"""The CLI's operations on a running cluster: `drain`, `restart`, `logs`, `status --watch` (Ray imported in the
handlers, after `prepare_ray_env`).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any, Callable

from dsv4_cluster.core import ClusterStatus, Role, WorkerState
from dsv4_cluster.orchestrator.errors import ClusterStartError, NotUpError, RayClusterError, UnknownWorkerError
from dsv4_cluster.orchestrator.cluster.log_files import last_run_log, log_of, read_log
from dsv4_cluster.orchestrator.cluster.options import DownOptions, UpOptions
from dsv4_cluster.orchestrator.cluster.record import RecordError
from dsv4_cluster.orchestrator.cli.table import endpoint_status, render_table
from dsv4_cluster.orchestrator.processes import stop_on_signals

EXIT_OK, EXIT_FAILED = 0, 1
WATCH_INTERVAL_S = 2.0
DRAIN_DEADLINE_S = 60.0
LOG_LINES = 50
CLEAR = "\x1b[H\x1b[2J"


def add_operation_commands(sub: Any) -> None:
    up_d, down_d = UpOptions(), DownOptions()
    dr = sub.add_parser("drain", help="stop pairing WORKER, let its requests finish, then stop it")
    dr.add_argument("worker")
    dr.add_argument("--deadline", type=float, default=DRAIN_DEADLINE_S,
                    help=f"seconds to wait for in-flight requests before stopping anyway "
                         f"(default {DRAIN_DEADLINE_S:g})")
    dr.add_argument("--timeout", type=float, default=down_d.timeout_s,
                    help=f"seconds between SIGTERM and SIGKILL (default {down_d.timeout_s:g})")
    rs = sub.add_parser("restart", help="stop WORKER (or the router), start it again, pair it again once READY")
    rs.add_argument("worker")
    rs.add_argument("--timeout", type=float, default=up_d.timeout_s,
                    help=f"seconds it may take to become ready (default {up_d.timeout_s:g})")
    lg = sub.add_parser("logs", help="print the log of a worker or of the router")
    lg.add_argument("name")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    lg.add_argument("-n", "--lines", type=_line_count, default=LOG_LINES,
                    help=f"last lines to print (default {LOG_LINES})")


def _line_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of lines, 0 or more")
    return value


def err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_operation(args: argparse.Namespace) -> int:
    from dsv4_cluster.orchestrator.cluster import operations
    from dsv4_cluster.orchestrator.supervise.router_admin import RouterAdminError

    try:
        if args.command == "drain":
            _warn_if_last(args.worker)
            out = operations.drain(args.worker, args.deadline, args.timeout)
            how = (f"forced after {args.deadline:g}s with {out.in_flight_at_stop} request(s) in flight" if out.forced
                   else f"its {out.in_flight_at_start} request(s) in flight finished in {out.waited_s:.1f}s"
                   if out.in_flight_at_start else "no request in flight")
            print(f"{args.worker} drained and stopped ({how}); `dsv4-cluster restart {args.worker}` "
                  "brings it back", flush=True)
            return EXIT_FAILED if out.forced else EXIT_OK
        if args.command == "restart":
            row = operations.restart(args.worker, args.timeout, DownOptions().timeout_s)
            print(f"{args.worker} restarted: {row.state.value}, pid {row.pid}", flush=True)
            return EXIT_OK
        return print_log(args, *operations.log_path(args.name))
    except (UnknownWorkerError, NotUpError, RayClusterError, RouterAdminError, ClusterStartError) as e:
        err(str(e))
        return EXIT_FAILED


def logs_without_ray(args: argparse.Namespace, none_recorded: RecordError | None) -> int | None:
    """`logs NAME` from the status endpoint's rows, or with no cluster recorded from the last cluster's logs; None
    when the endpoint does not answer (the caller asks through Ray)."""
    try:
        if none_recorded is not None:
            return print_log(args, *last_run_log(args.name, none_recorded))
        status, _ = endpoint_status()
        if status is None:
            return None
        return print_log(args, log_of(args.name, {w.name: w for w in status.workers}), None)
    except (UnknownWorkerError, NotUpError) as e:
        err(str(e))
        return EXIT_FAILED


def print_log(args: argparse.Namespace, path: str, note: str | None) -> int:
    """`logs`' output: the file's last lines, then (with -f) what is appended until SIGINT/SIGTERM."""
    if note:   # the last cluster's log: nothing writes it any more, so nothing to follow
        err(f"{note}{' (not followed: nothing writes it any more)' if args.follow else ''}:")
    stop = stop_on_signals()
    for line in read_log(path, args.lines, args.follow and not note, stop.is_set):
        sys.stdout.write(line)
        sys.stdout.flush()
    return EXIT_OK


def _warn_if_last(name: str) -> None:
    """Before a drain: say so when `name` is its role's only READY worker (nothing is refused: the operator may mean
    it, and scripts must not hang on a question)."""
    status, _ = endpoint_status()
    rows = {w.name: w for w in status.workers} if status is not None else {}
    if name in rows and rows[name].role in (Role.PREFILL, Role.DECODE):
        ready = [w.name for w in rows.values() if w.role == rows[name].role and w.state is WorkerState.READY]
        if ready == [name]:
            err(f"warning: {name} is the only READY {rows[name].role.value} worker: the router pairs no request "
                f"until `dsv4-cluster restart {name}` (new requests get 503 meanwhile)")


def watch_status(read_status: Callable[[], ClusterStatus], interval_s: float) -> int:
    """`status --watch`: the table of `read_status()`, refreshed every interval until SIGINT/SIGTERM.

    A signal that arrives while a read is under way ends the read too: one read may wait up to the
    endpoint's 30 s (and then on Ray), and Ctrl-C must not wait for it.
    """
    stop = threading.Event()
    reading = False

    def on_signal(*_: Any) -> None:
        stop.set()
        if reading:
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stop.is_set():
        try:
            reading = True
            status = read_status()
        except KeyboardInterrupt:
            return EXIT_OK
        except (NotUpError, RayClusterError) as e:
            err(str(e))
            return EXIT_FAILED
        finally:
            reading = False
        top = CLEAR if sys.stdout.isatty() else "\n"   # piped or logged: no escape codes, a blank line between tables
        sys.stdout.write(f"{top}{render_table(status)}\n(every {interval_s:g}s; Ctrl-C to stop)\n")
        sys.stdout.flush()
        stop.wait(interval_s)
    return EXIT_OK
