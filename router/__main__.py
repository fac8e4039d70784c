"""`python -m dsv4_cluster.router --config PATH.json [--host H] [--port P]`: serve the router.

Exit status 2 when the settings file is bad (the message names the field); defaults come from
`RouterSettings`, never retyped here.
"""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from pydantic import ValidationError

from .app import build_app
from .server_protocol import protocol_class
from .settings import RouterSettings, SettingsError, load_settings

# uvloop and httptools (both dependencies) make the event loop and the HTTP parsing native (the protocol is
# uvicorn's httptools one with request deadlines, server_protocol.py); no access log: a line per request costs
# more than routing it (metrics count requests instead).
LOOP = "uvloop"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    fields = RouterSettings.model_fields
    parser = argparse.ArgumentParser(prog="python -m dsv4_cluster.router", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="router settings JSON (RouterSettings)")
    parser.add_argument("--host", help=f"override the settings' host (default {fields['host'].default})")
    parser.add_argument("--port", type=int, help=f"override the settings' port (default {fields['port'].default})")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = load_settings(args.config)
        overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        settings = RouterSettings.model_validate({**settings.model_dump(), **overrides})
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValidationError as exc:
        print(f"error: bad --host/--port override: {exc}", file=sys.stderr)
        return 2
    http = protocol_class(settings.request_head_timeout_s, settings.request_body_timeout_s)
    uvicorn.run(build_app(settings), host=settings.host, port=settings.port, log_level=args.log_level,
                access_log=False, loop=LOOP, http=http)
    return 0


if __name__ == "__main__":
    sys.exit(main())
