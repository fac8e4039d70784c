"""Entry point of `python -m dsv4_cluster.workers.<role>`. The process leaves with `os._exit` once its servers have
stopped: the interpreter's teardown spends seconds collecting the model's heap, delaying every restart and `down`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import sys
import time

from ..core import Role
from .args import parse_args
from .http.serving import serve_all


def main(role: Role, argv: list[str] | None = None) -> None:
    args = parse_args(role, argv)
    time.sleep(args.test_start_delay_s)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role} %(levelname)s %(message)s")
    module = importlib.import_module(f"dsv4_cluster.workers.{role}.server")
    code = 0
    try:
        asyncio.run(serve_all(module.make_apps(args), args.log_level))
    except SystemExit as exc:   # serve_all: a server failed, or the engine died
        code = exc.code if isinstance(exc.code, int) else 1
        if not isinstance(exc.code, int) and exc.code is not None:
            print(exc.code, file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
