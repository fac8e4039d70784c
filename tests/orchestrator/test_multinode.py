"""Multi-node on Ray: two Ray nodes on this machine (`ray.cluster_utils.Cluster`), each labelled with
a `dsv4-node:<name>` resource; the topology puts the prefill on node `a` and the decode on node `b`.
`up --address` joins that cluster: every supervisor lands on its named node, a topology naming an
absent node fails before anything starts, `down` leaves no process behind."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from dsv4_cluster.orchestrator.cluster.ray_env import prepare_ray_env

from tests.helpers import gone
from bench.local_cluster import write_topology

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_nodes():
    prepare_ray_env("127.0.0.1:1")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 1, "resources": {"dsv4-node:a": 1}, "include_dashboard": False})
    node_b = cluster.add_node(num_cpus=1, resources={"dsv4-node:b": 1})
    try:
        yield cluster.address, {"a": cluster.head_node.node_id, "b": node_b.node_id}
    finally:
        cluster.shutdown()


def _two_node_topology(tmp_path, extra_nodes: str = "", decode_node: str = "b"):
    c = write_topology(tmp_path)
    text = c.topology.read_text().replace("  - {name: prefill-0,", "  - {node: a, name: prefill-0,")
    text = text.replace("  - {name: decode-0,", f"  - {{node: {decode_node}, name: decode-0,")
    c.topology.write_text(text + "nodes:\n  - {name: a, address: 127.0.0.1}\n  - {name: b, address: 127.0.0.1}\n"
                          + extra_nodes)
    return c



def test_workers_land_on_their_named_ray_nodes_and_down_stops_them(ray_nodes, tmp_path):
    address, node_ids = ray_nodes
    c = _two_node_topology(tmp_path)
    up = c.cli("up", str(c.topology), "--address", address, "--timeout", "180")
    pids = []
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        rows = {w["name"]: w for w in json.loads(c.cli("status", "--json").stdout)["workers"]}
        pids = [w["pid"] for w in rows.values()]
        assert rows["prefill-0"]["ray_node_id"] == node_ids["a"]
        assert rows["decode-0"]["ray_node_id"] == node_ids["b"]
        assert rows["router"]["ray_node_id"] == node_ids["a"]   # the first node
        r = httpx.post(c.router_url + "/v1/chat/completions", timeout=120, json={
            "model": "dsv4-tiny", "max_tokens": 4, "ignore_eos": True,
            "messages": [{"role": "user", "content": "across nodes"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        down = c.cli("down", "--timeout", "10")
    assert down.returncode == 0, down.stderr + down.stdout
    assert pids and gone(pids) == []


def test_a_topology_naming_an_absent_node_fails_before_anything_starts(ray_nodes, tmp_path):
    address, _ = ray_nodes
    c = _two_node_topology(tmp_path, extra_nodes="  - {name: c, address: 127.0.0.1}\n", decode_node="c")
    r = c.cli("up", str(c.topology), "--address", address, "--timeout", "60")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "decode-0: node 'c' is not in the Ray cluster (no Ray node has the resource 'dsv4-node:c')" in r.stderr
    assert not (tmp_path / "run" / "logs" / "prefill-0.log").exists()
    assert not os.path.exists(c.home / "current.json")
