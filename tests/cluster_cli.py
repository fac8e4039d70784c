"""Test helper: a whole embedded cluster brought up by the real CLI (`bench/local_cluster.py`), and the
check that it serves again after a fault."""

from __future__ import annotations

import openai

from bench.local_cluster import LocalCluster


def next_20_succeed(c: LocalCluster) -> None:
    """The fault is over only when requests succeed: 20 greedy chats through the router, official client."""
    client = openai.OpenAI(base_url=c.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(20):
        reply = client.chat.completions.create(model="dsv4-tiny", max_tokens=4, temperature=0,
                                               messages=[{"role": "user", "content": f"after {i}"}],
                                               extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 4, reply
