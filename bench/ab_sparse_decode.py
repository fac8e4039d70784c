"""A/B of kernel versions on the H200: other versions of kernels/sparse_mla_decode vs this tree, interleaved
on the same inputs (cold-L2 CUDA-graph replays), so that sub-microsecond differences are seen in one run.

    mkdir -p .ab/smd_old && git archive <commit> kernels/sparse_mla_decode | tar -x -C .ab/smd_old --strip-components=2
    python3 -m dsv4_cluster.bench.ab_sparse_decode "$repo/.ab" 1,8,32,64,128 2 old[,other]  # H200, carry .ab
    (after `source bench/h200_package.sh`, as bench/run_on_h200.sh does)

argv: the folder holding smd_<name>/ copies, batches, passes, variant names ("-": none), and optionally more
configs of this tree: "B:dtype:field=value,...;..." (LaunchConfig fields, e.g. 64:bf16:num_splits=2,fused_merge=1).
Rows: Gluon bf16 with the default table staging and fp8 with the table staged after the lengths, per variant
and "new" (this tree), the extra configs, FlashMLA. Every row's output is checked against the reference first.
Results: bench/results/sparse_decode_ab_session6.log, sparse_decode_ab_session7.log.
"""
from __future__ import annotations

import importlib
import sys

from dsv4_cluster.bench.kernels import bench_us, copy_bandwidth_gbs
from dsv4_cluster.bench.sparse_decode import (
    MAX_REL_ERR, flashmla_call, graphed, inputs_and_references, rel_err, required_bytes,
)
from dsv4_cluster.kernels.sparse_mla_decode import fp8_layout, launch as new

FP8_ROW = fp8_layout.BYTES_PER_TOKEN


def main(argv: list[str]) -> int:
    sys.path.insert(0, argv[0])  # the folder holding the smd_* variants
    variants = [(v, importlib.import_module(f"smd_{v}.launch")) for v in argv[3].split(",") if v != "-"]
    extra_cfgs = [spec.split(":") for spec in argv[4].split(";")] if len(argv) > 4 else []
    batches = [int(x) for x in (argv[1] if len(argv) > 1 else "1,8,32,64,128").split(",")]
    passes = int(argv[2]) if len(argv) > 2 else 2
    copy = copy_bandwidth_gbs()
    print(f"copy {copy:.0f} GB/s", flush=True)
    for b in batches:
        case, cache, extra, fp8c, ref, ref8 = inputs_and_references(b)
        runs = {}
        for tag, mod in variants + [("new", new)]:
            for early, fp8 in ((None, False), (False, True)):
                cfg = mod.LaunchConfig(backend="gluon", early_table=early)
                if fp8:
                    runs[f"{tag:7s} fp8  early={early}"] = (
                        lambda m=mod, c=cfg: m.sparse_mla_decode_fp8_triton(**fp8c, kv_cache=cache, extra_cache=extra, config=c),
                        ref8, FP8_ROW)
                else:
                    runs[f"{tag:7s} bf16 early={early}"] = (lambda m=mod, c=cfg: m.sparse_mla_decode_triton(**case, config=c), ref, 1024)
        for spec_b, dtype, fields in extra_cfgs:
            if int(spec_b) != b:
                continue
            kw = {k: int(v) for k, v in (f.split("=") for f in fields.split(","))}
            kw = {k: bool(v) if k in ("fused_merge", "early_table") else v for k, v in kw.items()}
            cfg = new.LaunchConfig(backend="gluon", **kw)
            name = f"new {dtype} {fields}"
            if dtype == "fp8":
                runs[name] = (lambda c=cfg: new.sparse_mla_decode_fp8_triton(**fp8c, kv_cache=cache, extra_cache=extra,
                                                                             config=c), ref8, FP8_ROW)
            else:
                runs[name] = (lambda c=cfg: new.sparse_mla_decode_triton(**case, config=c), ref, 1024)
        fm, err = flashmla_call(fp8c, cache, extra)
        if fm:
            runs["flashmla fp8"] = (fm, ref8, FP8_ROW)
        else:
            print("flashmla:", err)
        res = {k: [] for k in runs}
        for k, (fn, r, _) in runs.items():
            e = rel_err(fn()[0], r)
            if not e < MAX_REL_ERR:
                raise SystemExit(f"B={b} {k.strip()}: output disagrees with the reference (relative error {e:.3g})")
        graphs = {k: graphed(fn) for k, (fn, _, _) in runs.items()}
        for p in range(passes):
            for k, g in graphs.items():
                res[k].append(bench_us(g, rep_ms=150))
        for k, v in res.items():
            gbs = required_bytes(b, runs[k][2]) / (min(v) * 1e-6) / 1e9
            print(f"B={b:4d} {k:40s} " + " ".join(f"{x:6.2f}" for x in v) + f"   {gbs / copy:5.1%} of copy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
