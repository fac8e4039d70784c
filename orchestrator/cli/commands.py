"""`dsv4-cluster`: bring a PD cluster up, report on it, take it down (`dsv4-cluster --help` lists the commands).

Exit codes: 0 success; 1 the cluster failed (to start, to answer, to stop cleanly); 2 nothing was started because
the topology or this machine is not fit. `up --foreground` runs `down` on SIGTERM/SIGINT: what systemd runs.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from dsv4_cluster.core import ClusterStatus, WorkerState
from dsv4_cluster.orchestrator.cli.ops import (
    WATCH_INTERVAL_S, add_operation_commands, err as _err, logs_without_ray, run_operation, watch_status)
from dsv4_cluster.orchestrator.errors import (
    AlreadyUpError, ClusterStartError, NotUpError, PreflightError, RayClusterError)
from dsv4_cluster.orchestrator.load import sweep
from dsv4_cluster.orchestrator.cli import service
from dsv4_cluster.orchestrator.monitor import stack as monitor
from dsv4_cluster.orchestrator.cluster.options import DownOptions, UpOptions
from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env
from dsv4_cluster.orchestrator.launch.sglang_capacity import GpuInputs
from dsv4_cluster.orchestrator.cli.table import endpoint_status, print_status, render_table
from dsv4_cluster.kernels.dispatch import GPU_CLASSES, DispatchError
from dsv4_cluster.orchestrator.cluster.record import RecordError, no_record, read_record, record_path
from dsv4_cluster.orchestrator.processes import signals_held, stop_on_signals
from dsv4_cluster.orchestrator.topology.load import TopologyError, load_topology

EXIT_OK, EXIT_FAILED, EXIT_UNFIT = 0, 1, 2
EXIT_INTERRUPTED = 128 + 15
ON_A_CLUSTER = frozenset({"status", "verify", "down", "drain", "restart", "logs"})   # they need a recorded cluster
FOREGROUND_CHECK_S = 5.0


def _parser() -> argparse.ArgumentParser:
    up_d, down_d = UpOptions(), DownOptions()
    p = argparse.ArgumentParser(prog="dsv4-cluster", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="validate FILE, start the cluster, print endpoint and status")
    up.add_argument("file", help="topology YAML (see examples/local.yaml)")
    up.add_argument("--address", default=up_d.address,
                    help="join this Ray cluster (host:port) instead of starting a head")
    up.add_argument("--foreground", action="store_true", default=up_d.foreground,
                    help="stay attached; SIGTERM/SIGINT takes the cluster down")
    up.add_argument("--timeout", type=float, default=up_d.timeout_s,
                    help=f"seconds each process may take to become ready (default {up_d.timeout_s:g})")
    st = sub.add_parser("status", help="the cluster's processes, state and KV usage")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", action="store_true", help="refresh the table until Ctrl-C")
    st.add_argument("--interval", type=float, default=WATCH_INTERVAL_S,
                    help=f"seconds between refreshes with --watch (default {WATCH_INTERVAL_S:g})")
    dn = sub.add_parser("down", help="stop the router, the workers and the Ray head up started")
    dn.add_argument("--timeout", type=float, default=down_d.timeout_s,
                    help=f"seconds between SIGTERM and SIGKILL (default {down_d.timeout_s:g})")
    _add_verify_parser(sub)
    _add_plan_parser(sub)
    add_operation_commands(sub)
    service.add_parser(sub)
    monitor.add_parser(sub)
    sweep.add_parser(sub)
    return p


def _add_plan_parser(sub: Any) -> None:
    pl = sub.add_parser("plan", help="dry run: the env and command line of every server, and their KV capacity")
    pl.add_argument("file", help="topology YAML")
    gpu = GpuInputs()
    pl.add_argument("--gpu-mib", type=float, default=gpu.total_mib,
                    help=f"SGLang: GPU memory as nvidia-smi reports memory.total (default {gpu.total_mib:g}, an H200)")
    pl.add_argument("--free-before-load-gib", type=float, default=None,
                    help="SGLang: free GPU memory once CUDA and NCCL are up, as its log's 'Memory baseline' shows "
                         "(default: GPU memory minus the 1.21 GiB CUDA context measured on an H200)")
    pl.add_argument("--gpu-class", choices=GPU_CLASSES, default=None,
                    help="the GPUs' class for the kernels table (default: read from this machine's GPUs; "
                         "sm_90 when it has none)")
    pl.add_argument("--checkpoint-gib", type=float, default=gpu.checkpoint_gib,
                    help=f"SGLang: checkpoint size, split evenly over TP (default {gpu.checkpoint_gib:g}, "
                         "DeepSeek-V4-Flash)")


def _cmd_plan(args: argparse.Namespace) -> int:
    """Starts nothing and needs no Ray: what `up FILE` would run, and the KV pools it would get."""
    from dsv4_cluster.orchestrator.launch.capacity import capacity_rows, capacity_table, inputs_note
    from dsv4_cluster.orchestrator.launch.plan import cluster_plans
    from dsv4_cluster.router.settings_fields import summary

    try:
        topology = load_topology(args.file)
        workers, router = cluster_plans(topology)
    except TopologyError as e:
        _err(f"{args.file}: {len(e.problems)} problem(s):\n{e}")
        return EXIT_UNFIT
    for plan in [*workers, router]:
        print(f"# {plan.name} ({plan.role.value}) on node {plan.node}, log {plan.log_path}")
        print(shlex.join(["env", *(f"{k}={v}" for k, v in plan.env), *plan.argv]))
    if router.router_settings is not None:
        print("\n".join(f"#   {line}" for line in summary(router.router_settings)))
    print()
    table = _kernels_table(topology, args.gpu_class)
    if table:
        print(table + "\n")
    gpu = GpuInputs(args.gpu_mib, args.free_before_load_gib, args.checkpoint_gib)
    print(capacity_table(capacity_rows(topology, gpu)))
    print(inputs_note(topology, gpu), flush=True)
    return EXIT_OK


def _kernels_table(topology: Any, forced: str | None) -> str:
    """What runs per GPU worker and requested kernel, by the class `forced`, or read from this machine's GPUs."""
    from dsv4_cluster.orchestrator.launch import gpu_classes as gc

    found = None if forced else gc.detect_classes()
    if forced:
        source, of = f"--gpu-class {forced}", (lambda w: forced)
    elif found:
        source = "read from this machine's GPUs"
        of = (lambda w: gc.worker_class(w, found) or "unknown")
    else:
        source, of = "no GPU here: sm_90 assumed, pass --gpu-class", (lambda w: "sm_90")
    try:
        return gc.rows_text(gc.kernel_rows(topology, of), source)
    except (gc.GpuClassError, DispatchError) as e:
        return f"Kernels by GPU class: {e}"


def _add_verify_parser(sub: Any) -> None:
    sub.add_parser("verify", help="check the running cluster: kernels attested and called on every rank, "
                   "answers, throughput vs the last good run")


def _cmd_verify(deployment: Any) -> int:
    try:
        report = deployment.verify()
    except (NotUpError, RayClusterError) as e:
        _err(str(e))
        return EXIT_FAILED
    print(report.summary(), flush=True)
    return EXIT_OK if report.ok else EXIT_FAILED


def _cmd_up(deployment: Any, args: argparse.Namespace) -> int:
    options = UpOptions(address=args.address, timeout_s=args.timeout, foreground=args.foreground)
    started = time.monotonic()
    try:
        result = deployment.up(args.file, options)
    except TopologyError as e:
        _err(f"{args.file}: {len(e.problems)} problem(s); nothing was started:\n{e}")
        return EXIT_UNFIT
    except PreflightError as e:
        _err(f"{args.file} cannot start on this machine; nothing was started:\n{e}")
        return EXIT_UNFIT
    except AlreadyUpError as e:
        _err(f"{e}; nothing was started")
        return EXIT_FAILED
    except (ClusterStartError, RayClusterError) as e:
        _err(f"up failed; everything it started was stopped:\n{e}")
        return EXIT_FAILED
    except KeyboardInterrupt as e:
        _err(f"up interrupted ({str(e) or 'SIGINT'}); everything it started was stopped")
        return EXIT_INTERRUPTED
    # from here to `down` a SIGTERM/SIGINT means "stop the cluster", also while the table prints
    stop = stop_on_signals() if options.foreground else None
    failed = [w.name for w in result.status.workers if w.state is WorkerState.FAILED]
    if result.already_up:
        print(f"already up from {args.file}; nothing was started")
    else:
        print(f"cluster up in {time.monotonic() - started:.1f}s")
    print(f"endpoint: {result.status.endpoint}")
    if result.verification:
        print(result.verification)
    print(render_table(result.status), flush=True)
    if result.already_up and failed:   # up again starts nothing: say how to bring these back
        _err(f"FAILED: {', '.join(failed)}; `dsv4-cluster restart NAME` starts one again (`down` then `up`: all)")
        return EXIT_FAILED
    if stop is None:
        return EXIT_OK
    lost = deployment.watch(FOREGROUND_CHECK_S, stop)
    if lost is not None:
        _err(f"the cluster went away: {lost}")
    code = _cmd_down(deployment, DownOptions())
    return EXIT_FAILED if lost is not None else code


def _read_status(deployment: Any) -> ClusterStatus:
    """The controller's status through its endpoint, else through Ray (the reason on stderr)."""
    status, why = endpoint_status()
    if status is not None:
        return status
    if why:
        _err(why)
    return deployment.status()


def _cmd_status(deployment: Any, args: argparse.Namespace) -> int:
    if args.watch:
        return watch_status(lambda: _read_status(deployment), args.interval)
    try:
        status = _read_status(deployment)
    except (NotUpError, RayClusterError) as e:
        _err(str(e))
        return EXIT_FAILED
    print_status(status, args.json)
    return EXIT_OK


def _cmd_down(deployment: Any, options: DownOptions) -> int:
    started = time.monotonic()
    try:
        final = deployment.down(options)
    except NotUpError as e:
        if record_path().exists():   # a record it cannot read: a cluster may be running, unstopped
            _err(str(e))
            return EXIT_FAILED
        _err(f"{e}; nothing to stop")
        return EXIT_OK
    for note in final.notes:
        _err(note)
    if final.survivors:
        _err(f"still running after down: pids {final.survivors}")
        return EXIT_FAILED
    print(f"cluster down in {time.monotonic() - started:.1f}s; no process left", flush=True)
    return EXIT_OK


def _ray_address(args: argparse.Namespace) -> str | None:
    """The Ray cluster this command will talk to (None: a local head `up` starts)."""
    if args.command == "up":
        if args.address:
            return str(args.address)
        try:
            return load_topology(args.file).cluster.address
        except TopologyError:
            return None  # `up` reports the problems before it imports Ray
    try:
        return read_record().address
    except RecordError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "up":
        # A process-directed SIGTERM lands on any thread that does not block it, and inside ray.init (where `up` holds
        # the signals on this thread) Ray's C++ handler, which dumps and exits, takes it: torch's import (the PD check's
        # single-process run needs it) starts the one thread that exists before that, so it starts with the signals
        # blocked and keeps them so (Ray's threads start in the hold): every SIGTERM reaches `up`'s handler, which
        # cleans up.
        with signals_held():
            import torch  # noqa: F401
    if args.command == "plan":
        return _cmd_plan(args)
    if args.command == "install-service":
        return service.main(args)
    if args.command == "monitor":
        return monitor.main(args)
    if args.command == "bench":
        return sweep.main(args)
    none_recorded = no_record() if args.command in ON_A_CLUSTER else None
    if none_recorded is not None and args.command != "logs":   # said as the Ray paths say it, without Ray's import
        if args.command == "down":
            _err(f"{none_recorded}; nothing to stop")
            return EXIT_OK
        _err(str(none_recorded))
        return EXIT_FAILED
    if args.command == "logs":
        code = logs_without_ray(args, none_recorded)
        if code is not None:
            return code
    prepare_ray_env(_ray_address(args))
    from dsv4_cluster.orchestrator.cluster import deployment  # imports Ray: only after prepare_ray_env

    if args.command == "up":
        return _cmd_up(deployment, args)
    if args.command == "status":
        return _cmd_status(deployment, args)
    if args.command == "verify":
        return _cmd_verify(deployment)
    if args.command == "down":
        return _cmd_down(deployment, DownOptions(timeout_s=args.timeout))
    return run_operation(args)


if __name__ == "__main__":
    sys.exit(main())
