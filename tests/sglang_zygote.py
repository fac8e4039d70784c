"""One interpreter that imports SGLang once and forks a child per command, each run as `python -m MODULE ARGS` or
`python -c CODE ARGS` would run it, its output into files (`tests/sglang_support.start_child` starts one per test
process and environment).

Why: every SGLang child paid the same import, ~6 CPU-s of the CI machine's two cores, and a run starts ten of them.
What a child finds that a fresh interpreter would not: SGLang's top package and `sglang.srt.server_args` imported,
with the zygote's environment (so a zygote serves only children of its environment, apart from the variables
`sglang_support.CALL_TIME_ENV` names: read when called, never at import). Nothing of ours is imported and no plugin
is loaded: what a child installs, it installs in itself. Its `random` is seeded afresh, as an interpreter's would be.

Protocol: one JSON line a command on stdin, {"argv", "env", "out", "err"}; the zygote answers "PID <pid>" and, once
that child ended, writes its exit status to `<out>.rc`. It exits when stdin closes (its test process ended), and
its children die with it.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import random
import runpy
import signal
import sys
import threading
import traceback

from bench.sglang_stand_ins import install_torchvision_stand_in

PR_SET_PDEATHSIG = 1


def _run(argv: list[str]) -> int:
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _child(command: dict) -> None:
    """In the forked child: its environment, files and argv; never returns."""
    code = 1
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        os.environ.clear()
        os.environ.update(command["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, command["out"]), (2, command["err"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
        random.seed()
        code = _run(command["argv"])
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pid: int, out: str) -> None:
    _, status = os.waitpid(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    with open(out + ".rc.tmp", "w") as f:
        f.write(str(rc))
    os.replace(out + ".rc.tmp", out + ".rc")


def main() -> None:
    install_torchvision_stand_in()
    import sglang  # noqa: F401  the seconds every child used to spend
    import sglang.srt.server_args  # noqa: F401

    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(command)
        threading.Thread(target=_reap, args=(pid, command["out"]), daemon=True).start()
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":
    main()
