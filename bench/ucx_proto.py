"""Which UCX transport carried the bytes, read from UCX's own log (`UCX_PROTO_INFO=y`, `UCX_LOG_LEVEL=info`).

UCX prints, per endpoint configuration of a worker (named by the NIXL agent), a table per operation
(`| kvx-prefill intra-node cfg#1 |`, `| remote memory write by ucp_put* from host memory to host |`, then rows of
range, description and config such as `cma/memory`), and its lanes (`... UCX INFO kvx-prefill intra-node cfg#1
rma_am(tcp/lo) am(tcp/lo cma/memory)`; on GPUs `device(cuda_ipc/cuda)`). A NIXL WRITE is a `ucp_put*`, so the config
cells of an agent's put tables towards a peer (not `self`) name the transports that carried its KV.
"""

from __future__ import annotations

import re
from pathlib import Path

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")           # "[ts] [host:pid:tid]  "
_TITLE = re.compile(r"^\|\s*(\S+) (self|intra-node|inter-node) cfg#(\d+)\s*\|$")
_OP = re.compile(r"^\|\s*(.+?) from (\S+) memory(?: to (\S+))?\s*\|$")
_LANES = re.compile(r"UCX\s+INFO\s+(\S+) (intra-node|inter-node) cfg#\d+ (.+)$")
_TRANSPORT = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_:.\-]+)")
PUT = "remote memory write"


def parse_tables(text: str) -> list[dict]:
    """Every protocol table in a UCX log: agent, scope, cfg, operation, memory types and its rows."""
    tables: list[dict] = []
    current: dict | None = None
    for raw in text.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            continue
        if m := _TITLE.match(line):
            current = {"agent": m[1], "scope": m[2], "cfg": int(m[3]), "op": None, "rows": []}
            tables.append(current)
            continue
        if current is None:
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if current["op"] is None and len(cells) == 1 and (m := _OP.match(line)):
            current.update(op=m[1], from_mem=m[2], to_mem=m[3])
        elif current["op"] is not None and len(cells) == 3 and cells[0] != "Range":
            current["rows"].append({"range": cells[0], "description": cells[1], "config": cells[2],
                                    "transports": sorted({f"{a}/{b}" for a, b in _TRANSPORT.findall(cells[2])})})
    return [t for t in tables if t["op"] is not None]


def put_transports(tables: list[dict], agent: str, mem: str | None = None) -> list[str]:
    """The transports of `agent`'s remote-memory-write tables towards a peer (what a NIXL WRITE used); with `mem`
    ("host" or "cuda"), only the tables from and to that memory type (UCX also prints host -> cuda tables that a
    VRAM -> VRAM WRITE never takes)."""
    return sorted({tr for t in tables if t["agent"] == agent and t["scope"] != "self" and t["op"].startswith(PUT)
                   and (mem is None or (t["from_mem"] == mem and (t["to_mem"] or mem).startswith(mem)))
                   for row in t["rows"] for tr in row["transports"]})


def device_lane_transports(lanes: list[str]) -> list[str]:
    """The transports of the `device(...)` lane in UCX's endpoint lines: GPU memory to GPU memory, where UCX
    prints no cuda -> cuda put table (seen with UCX 1.23 on one H200: `device(cuda_ipc/cuda)`)."""
    return sorted({f"{a}/{b}" for lane in lanes for group in re.findall(r"\bdevice\(([^)]*)\)", lane)
                   for a, b in _TRANSPORT.findall(group)})


def peer_lanes(text: str, agent: str) -> list[str]:
    """The lanes UCX logged for `agent`'s endpoint configurations towards a peer, as printed."""
    return sorted({m[3].strip() for line in text.splitlines() if (m := _LANES.search(line)) and m[1] == agent})


def summarize(logs: list[Path], agents: list[str], mem: str | None = None) -> dict:
    """Per agent: the put transports towards its peer (of `mem` -> `mem` tables when given), those tables as UCX
    printed them (deduplicated), its endpoints' lanes, and the transports of their device lane; `carried_by`
    names what carried the bytes: the put transports, else (GPU memory, no such table) the device lane's."""
    texts = [p.read_text(errors="replace") for p in logs if p.exists()]
    tables = [t for text in texts for t in parse_tables(text)]
    out: dict = {}
    for agent in agents:
        puts = [t for t in tables if t["agent"] == agent and t["scope"] != "self" and t["op"].startswith(PUT)]
        unique = list({repr(t): t for t in puts}.values())
        lanes = sorted({lane for text in texts for lane in peer_lanes(text, agent)})
        puts_mem = put_transports(tables, agent, mem)
        device = device_lane_transports(lanes)
        out[agent] = {"put_transports": puts_mem, "put_tables": unique, "peer_lanes": lanes,
                      "device_lane": device,
                      "carried_by": puts_mem or (device if mem == "cuda" else [])}
    return out
