"""The router tests' shared fixture: the router in front of fake prefill/decode servers on real loopback ports
(`tests/router_fakes.py`), one per test module."""

from __future__ import annotations

import pytest

from dsv4_cluster.router.app import build_app
from tests.router_fakes import Cluster, FakeWorker, Rendezvous, router_settings
from tests.servers import UvicornThread


@pytest.fixture(scope="module")
def cluster():
    meet = Rendezvous()
    prefill, decode = FakeWorker("prefill", meet), FakeWorker("decode", meet)
    with UvicornThread(prefill.app()) as p, UvicornThread(decode.app()) as d:
        settings = router_settings(p.url, d.url)
        with UvicornThread(build_app(settings)) as router:
            yield Cluster(prefill, decode, router, settings)
