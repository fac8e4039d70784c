"""The scale-out benchmark's floor: the least a PD router can do, to calibrate "router-added latency" on this machine.

`python -m bench.scaleout_floor --port P --prefill URL BOOTSTRAP_PORT ... --decode URL ...` serves
`/health` and streamed generation POSTs (HTTP/1.1 keep-alive, raw asyncio, uvloop): it parses the JSON body, adds
`bootstrap_host` / `bootstrap_port` / `bootstrap_room` for a round-robin prefill, sends the body to that prefill and
a round-robin decode at once, drains the prefill's answer in the background and relays the decode's chunked answer
byte for byte. No validation, no retries, no health checks, no metrics: not a router, a yardstick. What it adds
over the stubs' own time is what the client, the stubs and the kernel cost on this shared machine; what a real
router adds beyond that is its own.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import secrets
from urllib.parse import urlsplit

import orjson

from bench.scaleout_load import read_answer

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class Upstream:
    """Idle keep-alive connections to one worker."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.idle = parts.hostname, parts.port, []

    async def connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)


class Floor:
    def __init__(self, prefills: list[tuple[str, int]], decodes: list[str]) -> None:
        self.prefills = [(Upstream(url), boot) for url, boot in prefills]
        self.decodes = [Upstream(url) for url in decodes]
        self._p, self._d = itertools.count(), itertools.count()

    async def leg(self, upstream: Upstream, request: bytes, relay: asyncio.StreamWriter | None) -> None:
        reader, writer = await upstream.connection()
        writer.write(request)
        await read_answer(reader, relay.write if relay is not None else lambda piece: None)
        upstream.idle.append((reader, writer))

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                at = lower.find(b"content-length:")
                body = await reader.readexactly(int(lower[at + 15:lower.find(b"\r\n", at)]) if at >= 0 else 0)
                path = head.split(b" ", 2)[1]
                if not body:
                    writer.write(OK)
                    continue
                data = orjson.loads(body)
                prefill, boot = self.prefills[next(self._p) % len(self.prefills)]
                decode = self.decodes[next(self._d) % len(self.decodes)]
                data.update(bootstrap_host="127.0.0.1", bootstrap_port=boot, bootstrap_room=secrets.randbits(63))
                payload = orjson.dumps(data)
                request = (b"POST %s HTTP/1.1\r\nhost: w\r\ncontent-type: application/json\r\ncontent-length: %d"
                           b"\r\n\r\n%s" % (path, len(payload), payload))
                drain = asyncio.get_running_loop().create_task(self.leg(prefill, request, None))
                await self.leg(decode, request, writer)
                await drain
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def serve(port: int, floor: Floor) -> None:
    server = await asyncio.start_server(floor.handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--prefill", nargs=2, action="append", metavar=("URL", "BOOTSTRAP_PORT"), required=True)
    parser.add_argument("--decode", action="append", required=True)
    args = parser.parse_args()
    import uvloop
    uvloop.run(serve(args.port, Floor([(u, int(b)) for u, b in args.prefill], args.decode)))


if __name__ == "__main__":
    main()
