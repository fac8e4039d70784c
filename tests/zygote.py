"""Zygotes: an interpreter that imports the heavy modules a kind of child needs once, then forks a child per command,
each run as `python -m MODULE ARGS` or `python -c CODE ARGS` would run it, its output into files.

Why: the SGLang children each paid SGLang's import (~6 CPU-s of the CI machine's two cores) and the compile
children torch's and Triton's (~3 CPU-s), a few dozen of them a run. `start` (in the test process) starts one zygote
per preload and environment on first use and forks the child there; `Started.result` waits for it.

What a child finds that a fresh interpreter would not: the preloaded modules imported, with the zygote's
environment. So a zygote serves only children of its environment, apart from the variables `start` is told are read
when called, never at import. Nothing else is imported and nothing is installed: what a child installs (a plugin, a
patch) it installs in itself. Its `random` is seeded afresh, as an interpreter's would be; its string hashes are the
zygote's (every child of one zygote iterates a set of strings in the same order).

The zygote's side (`python -m tests.zygote PRELOAD...`, a `module` or `module:function` to call): one JSON line a
command on stdin, {"argv", "env", "out", "err"}; it answers "PID <pid>" and, once that child ended, writes its exit
status to `<out>.rc`. It exits when stdin closes (its test process ended), and its children die with it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

PR_SET_PDEATHSIG = 1


# -- the test process's side ---------------------------------------------------------------------------------------

class Started:
    """A child of a zygote: its pid, and its output and exit status as files (removed once read)."""

    def __init__(self, pid: int, folder: Path, zygote: subprocess.Popen) -> None:
        self.pid, self.folder, self._zygote = pid, folder, zygote

    def returncode(self) -> int | None:
        rc = self.folder / "out.rc"
        return int(rc.read_text()) if rc.exists() else None

    def _ended(self, timeout_s: float) -> bool:
        """Whether it ended within `timeout_s` (a zygote that died reaps nothing: its children died with it)."""
        from tests.helpers import TimedOut, wait_for  # the test process's side: the zygote imports nothing more

        try:
            wait_for(lambda: self.returncode() is not None or self._zygote.poll() is not None, timeout_s,
                     f"child {self.pid} to end")
        except TimedOut:
            return False
        return self.returncode() is not None

    def kill(self) -> None:
        """SIGKILL it unless it ended (or was read) already, and wait until the zygote reaped it."""
        if self.folder.exists() and self.returncode() is None and self._zygote.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self._ended(30)

    def result(self, timeout_s: float) -> tuple[int | None, str, str]:
        """(exit status, stdout, stderr) once it ended; killed after `timeout_s` (then the status is -9). The status
        is None when the zygote died under it."""
        if not self._ended(timeout_s):
            self.kill()
        out = (self.returncode(), *((self.folder / name).read_text(errors="replace") for name in ("out", "err")))
        shutil.rmtree(self.folder, ignore_errors=True)
        return out


_ZYGOTES: dict[tuple, subprocess.Popen] = {}
# what may differ between the children of one zygote besides what `start` is told: pytest's name of the running
# test (a zygote keyed on it served one test each, and they piled up)
_PER_TEST_ENV = frozenset({"PYTEST_CURRENT_TEST"})


def start(argv: list[str], preload: tuple[str, ...], env: dict[str, str],
          call_time_env: frozenset[str] = frozenset()) -> Started:
    """Fork `python ARGV` (argv starts with "-m" or "-c") with environment `env` from this process's zygote for
    `preload` and `env` (whose `call_time_env` variables may differ between its children)."""
    full_env = dict(env)
    ignored = call_time_env | _PER_TEST_ENV
    key = (preload, frozenset((k, v) for k, v in full_env.items() if k not in ignored))
    zygote = _ZYGOTES.get(key)
    if zygote is None or zygote.poll() is not None:
        zygote = subprocess.Popen([sys.executable, "-m", "tests.zygote", *preload], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, env=full_env)
        ready = zygote.stdout.readline()
        assert ready == "READY\n", f"the zygote for {preload} did not start ({zygote.wait()}): {ready!r}"
        _ZYGOTES[key] = zygote
    folder = Path(tempfile.mkdtemp(prefix="zygote-child-"))
    command = {"argv": argv, "env": full_env, "out": str(folder / "out"), "err": str(folder / "err")}
    zygote.stdin.write(json.dumps(command) + "\n")
    zygote.stdin.flush()
    answer = zygote.stdout.readline()
    assert answer.startswith("PID "), f"the zygote for {preload} did not fork: {answer!r}"
    return Started(int(answer.split()[1]), folder, zygote)


# what the compile tests' children import first (the seconds are torch's and Triton's; the kernel modules each child
# imports itself). Without TRITON_INTERPRET: once a process imported a kernel module under TRITON_INTERPRET=1 (as
# every CPU test process does) its kernels are interpreter functions, which `triton.compile` cannot take
COMPILE_PRELOAD = ("pytest", "torch", "triton", "dsv4_cluster.kernels.sparse_mla_decode.plan")


def compile_child(code: str, *args: str, timeout_s: float = 300) -> tuple[int, str, str]:
    """`python -c CODE ARGS` without TRITON_INTERPRET, forked from a zygote that imported COMPILE_PRELOAD once:
    (exit status, stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return start(["-c", code, *args], COMPILE_PRELOAD, env).result(timeout_s)


# -- the zygote's side ---------------------------------------------------------------------------------------------

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
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, command["out"], os.O_WRONLY | os.O_CREAT),
                                (2, command["err"], os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        random.seed()
        code = _run(command["argv"])
        threading._shutdown()  # as an interpreter's exit: wait for the child's non-daemon threads, then atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(pid: int, out: str) -> None:
    _, status = os.waitpid(pid, 0)
    with open(out + ".rc.tmp", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
    os.replace(out + ".rc.tmp", out + ".rc")


def main(preload: list[str]) -> None:
    for name in preload:
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    print("READY", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(command)
        threading.Thread(target=_reap, args=(pid, command["out"]), daemon=True).start()
        print(f"PID {pid}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
