"""The router tests' shared fixture: the router in front of fake prefill/decode servers on real loopback ports
(`tests/router_fakes.py`), one per test module."""

from __future__ import annotations

import pytest

from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.server_protocol import protocol_class
from tests.router_fakes import Cluster, FakeWorker, Rendezvous, router_settings
from tests.servers import UvicornThread


def _cluster(own_protocol: bool):
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet)
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url)
        http = protocol_class(settings.request_head_timeout_s, settings.request_body_timeout_s) if own_protocol \
            else "auto"
        with UvicornThread(build_app(settings), http=http) as router:
            yield Cluster(prefill, decode, router, settings)


@pytest.fixture(scope="module")
def cluster():
    """The router served as `python -m dsv4_cluster.router` serves it: its own HTTP protocol (server_protocol.py)."""
    yield from _cluster(own_protocol=True)


@pytest.fixture(scope="module")
def plain_cluster():
    """The router's app under uvicorn's own protocol, as any other ASGI server would run it."""
    yield from _cluster(own_protocol=False)
