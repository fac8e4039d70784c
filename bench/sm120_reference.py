"""The sm_120 rows' reference points on the stand-in GPU itself, c4, SGLang's sm_120 calling convention, graph replay:

    python -m bench.kernels sm120_reference sm90 OUT.json     # unforced: our sm_90 path (auto: the wgmma Gluon
                                                              # kernel at 64 heads; the table's 16-head row) and our
                                                              # sm_90 Triton kernel, 64 and 16 heads
    DSV4_CLUSTER_GPU_CLASS=sm_120 DISABLE_MMA_V3=1 python -m bench.kernels sm120_reference h16only OUT.json
                                                              # forced sm_120, 16 heads: the Triton row and the mma.sync
                                                              # Gluon kernel (4 / 8 warps, plain and fp8 words + lazy)
    python -m bench.kernels sm120_reference render A.json [B.json]   # no GPU: bench/results/sm120_reference.{json,md}

"<= 1.5x our own sm_90 kernel" for the sm_120 rows compares `sm120_backends.md` with the first; the second is what
moved the 16-head sm_120 row. Each row: max |diff| from SGLang's sm_120 Triton kernel on the same call, and us. One
JSON line a row on stdout; a mode run's OUT.json holds its rows, device and versions, and `render` merges mode runs
(two processes: forcing the class is per process) into the committed tables."""

from __future__ import annotations

import json
import traceback

from bench.common import RESULTS, md_table, versions, write
from bench.kernels import bench_us, graphed
from bench.sm120_backends import against_sglang
from bench.sm120_decode import load
from dsv4_cluster.kernels.sglang_adapters.flash_mla_sm120 import flash_mla_keywords
from dsv4_cluster.kernels.sglang_cases import decode_case, sglang_sm120_args, sm120_call
from dsv4_cluster.kernels.sparse_mla_decode.config import gluon_api_unavailable

_LW = dict(fp8_words=True, lazy_rescale=True)
H16 = {"h16_triton": dict(backend="triton"),
       **{f"h16_mma2_w{w}{n}": dict(backend="gluon_mma_v2", num_warps=w, fp8_words=bool(kw), lazy_rescale=bool(kw))
          for w in (4, 8) for n, kw in (("", {}), ("_lazy_words", _LW))}}
SM90 = {"sm90_auto": {}, "sm90_triton": dict(backend="triton")}
SM90_H16 = ("h16_triton", "h16_mma2_w4_lazy_words", "h16_mma2_w8_lazy_words")


def rows(mode: str) -> list[dict]:
    base = load()
    sets = ([(64, n, c) for n, c in SM90.items()] + [(16, n, H16[n]) for n in SM90_H16]) if mode == "sm90" else \
        [(16, n, c) for n, c in H16.items()]
    out = [{"gluon_api_unavailable": gluon_api_unavailable(), "mode": mode}]
    print(json.dumps(out[0]), flush=True)
    for b in (1, 8, 32, 64, 128):
        args = decode_case("c4", b, 64, seed=b, full=True)
        calls = {}
        for heads in dict.fromkeys(h for h, _, _ in sets):  # SGLang's output only at the head counts timed
            kw = sm120_call(args, None if heads == 64 else heads)
            pos = sglang_sm120_args(kw)
            calls[heads] = (flash_mla_keywords(kw, kw["q"], kw["attn_sink"]), base.triton_decode(*pos)[0].float(), pos)
        for heads, name, fields in sets:
            call, ref, pos = calls[heads]
            row = dict(layer="c4", B=b, heads=heads, cfg=name)
            if mode != "sm90" and name == "h16_triton":
                row["sglang_triton_us"] = bench_us(graphed(lambda: base.triton_decode(*pos)), 10, 50)
            try:
                row.update(zip(("diff", "ref_max", "us"), against_sglang(call, ref, fields)))
            except Exception as exc:  # recorded, the run goes on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def markdown(runs: dict[str, list[dict]], device: str, versions: str) -> str:
    """One table per mode: us per config and B (c4)."""
    parts = [f"# sm_120 rows' reference points on the stand-in ({device}; {versions}; one run each)", ""]
    for mode, rs in runs.items():
        rs = [r for r in rs if "cfg" in r]
        names = list(dict.fromkeys(r["cfg"] for r in rs))
        sglang = {r["B"]: f"{r['sglang_triton_us']:.1f}" for r in rs if r.get("sglang_triton_us")}
        table = [[b] + ([sglang.get(b, "-")] if sglang else []) +
                 [next((f"{r['us']:.1f}" for r in rs if r["B"] == b and r["cfg"] == n and "us" in r), "-")
                  for n in names] for b in sorted({r["B"] for r in rs})]
        diff = max(r.get("diff", 0.0) for r in rs)
        parts += [f"## {mode} (max diff from SGLang's sm_120 Triton kernel over all rows: {diff:.4f})", "",
                  *md_table(["B"] + (["SGLang Triton (16 heads)"] if sglang else []) + names, table), ""]
    return "\n".join(parts)


TITLES = {"sm90": "sm90 (unforced: our sm_90 path and its Triton kernel)", "h16only": "h16only (forced sm_120, 16 heads)"}


def run(argv: list[str]) -> int:
    if argv[:1] == ["render"]:
        runs = [json.loads(open(path).read()) for path in argv[1:]]
        result = dict(device=runs[0]["device"], versions=runs[0]["versions"],
                      runs={TITLES[r["mode"]]: r["rows"] for r in runs})
        checked = [r["mode"] for r in runs if r["mode"] == "sm90" and r["gluon_api_unavailable"] is None]
        note = ("The sm90 run also checked `gluon_api_unavailable()` is None (the wgmma Gluon kernel ran as "
                f"`sm90_auto` on Triton {result['versions']['triton']}).") if checked else ""
        md = markdown(result["runs"], result["device"],
                      f"torch {result['versions']['torch']}, Triton {result['versions']['triton']}") + "\n" + note
        write(RESULTS / "sm120_reference", result, md + "\n")
        return 0
    mode, path = argv[:2]
    import torch

    out = rows(mode)
    with open(path, "w") as f:
        json.dump(dict(mode=mode, device=torch.cuda.get_device_name(), gluon_api_unavailable=out[0][
            "gluon_api_unavailable"], versions={k: versions()[k] for k in ("torch", "triton")}, rows=out[1:]), f)
    return 0
