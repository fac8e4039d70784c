"""SGLang's two DeepSeek-V4 decode-metadata builders against ours, per configured context and batch:
`python -m bench.kernels sglang_metadata [--batches 1,8,32,64,128,256] [--contexts 8192,131072,1048576]`.

Each decode step SGLang builds the page table (`build_page_table_positions_triton`: ceil(context / 256) entries a
request, gathered from req_to_token) and the ratio-4 / ratio-128 metadata with the ratio-128 index list
(`_init_compressed_attn_metadata_triton`: 2 slots a page). Both walk the configured width in one program a request;
ours (`kernels/sglang_adapters/metadata.py`) spread it. Requests hold 2,048 live tokens, as in the SGLang-backend
rig. Per (context, batch): each builder's CUDA-graph replay and eager time (cold L2, median), SGLang's and ours,
the ratio SGLang / ours, and whether every output was byte-equal first.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import ints, md_columns
from bench.kernels import graph_and_eager_us, write_results

PAGE, LIVE = 256, 2048


def _inputs(batch: int, context: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(batch)
    req_to_token = torch.randint(0, 1 << 24, (batch + 1, context), device="cuda", dtype=torch.int32, generator=g)
    lens = torch.full((batch,), LIVE, device="cuda", dtype=torch.int32)
    pages = dict(req_to_token=req_to_token, req_pool_indices_repeated=torch.arange(1, batch + 1, device="cuda"),
                 seq_lens_casual=lens, max_seq_len=context, page_size=PAGE, swa_window=128)
    table = torch.randint(0, 1 << 16, (batch, -(-context // PAGE)), device="cuda", dtype=torch.int32, generator=g)
    meta = (lens, lens - 1, torch.arange(batch, device="cuda", dtype=torch.int64), table, PAGE, True)
    return {"pages": pages, "meta": meta}


def _fields(x) -> list:
    """A builder's outputs as a list: the tuple's items, or the PageTablePositionsResult's fields."""
    if isinstance(x, tuple):
        return list(x)
    return [getattr(x, f) for f in x.__struct_fields__]  # a msgspec Struct


def _equal(a, b) -> bool:
    a, b = _fields(a), _fields(b)
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and x.dtype == y.dtype
                                                                  and torch.equal(x, y)) for x, y in zip(a, b))


def run(argv: list[str]) -> int:
    from bench.sglang_stand_ins import install_import_stand_ins

    install_import_stand_ins()  # the GPU image lacks some of SGLang's import-time packages (none is called here)
    from sglang.kernels.ops.attention.dsv4 import attn_metadata_kernels as sg_pages, metadata_kernel as sg_meta

    from dsv4_cluster.kernels.sglang_adapters import metadata as ours

    ap = argparse.ArgumentParser(prog="sglang_metadata")
    ap.add_argument("--batches", type=ints, default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--contexts", type=ints, default=[8192, 131072, 1048576])
    a = ap.parse_args(argv)
    rows = []
    for context in a.contexts:
        for batch in a.batches:
            x = _inputs(batch, context)
            calls = {
                "pages": (lambda: sg_pages.build_page_table_positions_triton(**x["pages"]),
                          lambda: ours.build_page_table_positions_triton(**x["pages"])),
                "meta": (lambda: sg_meta._init_compressed_attn_metadata_triton(*x["meta"]),
                         lambda: ours._init_compressed_attn_metadata_triton(*x["meta"])),
            }
            row = {"context": context, "batch": batch}
            for name, (stock, mine) in calls.items():
                want, got = stock(), mine()
                row[f"{name}_equal"] = _equal(got, want)
                row[f"{name}_sglang_graph_us"], row[f"{name}_sglang_eager_us"] = graph_and_eager_us(stock)
                row[f"{name}_ours_graph_us"], row[f"{name}_ours_eager_us"] = graph_and_eager_us(mine)
                row[f"{name}_graph_x"] = row[f"{name}_sglang_graph_us"] / row[f"{name}_ours_graph_us"]
                row[f"{name}_eager_x"] = row[f"{name}_sglang_eager_us"] / row[f"{name}_ours_eager_us"]
            rows.append(row)
            print(row, flush=True)
            del x
    columns = [("context", "context", ""), ("B", "batch", ""), ("table equal", "pages_equal", ""),
               ("table SGLang us", "pages_sglang_graph_us", ".1f"), ("table ours us", "pages_ours_graph_us", ".1f"),
               ("table x", "pages_graph_x", ".2f"), ("table eager x", "pages_eager_x", ".2f"),
               ("c4/c128 equal", "meta_equal", ""), ("c4/c128 SGLang us", "meta_sglang_graph_us", ".1f"),
               ("c4/c128 ours us", "meta_ours_graph_us", ".1f"), ("c4/c128 x", "meta_graph_x", ".2f"),
               ("c4/c128 eager x", "meta_eager_x", ".2f")]
    md = ["# SGLang's decode-metadata builders vs ours (graph replay, cold L2, median; x = SGLang / ours)", "",
          *md_columns(rows, columns), ""]
    write_results("sglang_metadata", {"device": torch.cuda.get_device_name(), "live_tokens": LIVE, "page": PAGE,
                                      "rows": rows}, "\n".join(md))
    return 0 if all(r["pages_equal"] and r["meta_equal"] for r in rows) else 1
