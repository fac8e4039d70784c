"""The embedded cluster the benchmarks and the end-to-end tests bring up: one topology file on free
loopback ports (1 prefill, N decode, CPU), so that no two runs on one machine collide."""

from __future__ import annotations

from pathlib import Path

from dsv4_cluster.orchestrator.launch.ports import free_ports


def embedded_topology(folder: Path, namespace: str, decodes: int = 1, context_length: int = 512,
                      kernels: bool = False, extra_prefill: str = "", extra_decode: str = "",
                      extra: str = "") -> tuple[Path, dict[str, int]]:
    """Write `folder/topology.yaml`; returns its path and the ports: router, prefill, bootstrap,
    decode-<i> (and decode, the first decode's). `extra_prefill`/`extra_decode` continue each worker's
    flow mapping (", key: value"); `extra` is appended as top-level YAML (e.g. a `transfer:` section)."""
    router, prefill, boot, *decode_ports = free_ports(3 + decodes)
    k = "true" if kernels else "false"
    decode_lines = "".join(f"  - {{name: decode-{i}, device: cpu, port: {port}{extra_decode}}}\n"
                           for i, port in enumerate(decode_ports))
    path = folder / "topology.yaml"
    path.write_text(f"""
engine: embedded
model: {{name: dsv4-tiny, seed: 0, context_length: {context_length}}}
cluster: {{namespace: {namespace}-{router}, run_dir: run}}
router: {{host: 127.0.0.1, port: {router}}}
kernels: {{sparse_mla_decode: {k}, indexer: {k}, topk: {k}}}
defaults: {{page_size: 16, kv_cache_dtype: auto, max_total_tokens: 4096}}
prefill:
  - {{name: prefill-0, device: cpu, port: {prefill}, bootstrap_port: {boot}{extra_prefill}}}
decode:
{decode_lines}{extra}""")
    ports = {"router": router, "prefill": prefill, "bootstrap": boot, "decode": decode_ports[0],
             **{f"decode-{i}": port for i, port in enumerate(decode_ports)}}
    return path, ports
