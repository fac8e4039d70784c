"""Entry point shared by `python -m dsv4_cluster.workers.prefill` and `...workers.decode`."""

from __future__ import annotations

import asyncio
import importlib
import logging

from .args import parse_args
from .serving import serve_all


def main(mode: str, argv: list[str] | None = None) -> None:
    args = parse_args(mode, argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {mode} %(levelname)s %(message)s")
    module = importlib.import_module(f"dsv4_cluster.workers.{mode}.server")
    asyncio.run(serve_all(module.make_apps(args), args.log_level))
