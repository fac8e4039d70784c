"""Compile the Gluon sparse-decode kernel for sm_90a on a machine without a GPU; print its resources.

Device minutes are scarce; most "will this config spill / fit / assemble?" questions are answered here:
shared memory, ptxas registers and spills, and the `setmaxnreg` budget of each partition. Needs the
Triton release the kernel is written for (the H200's; see launch.GLUON_TRITON_RELEASES), e.g.

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    /tmp/t36/bin/python bench/compile_gluon_sm90.py bf16:64:2 fp8:64:2 bf16:32:4:regs40 [--sass DIR]

A config is dtype:block_n:stages[:regsN][:pvN][:fuseN] (regsN: loader registers, default as the launcher;
pvN: registers of the P V warpgroup, default launch.PV_REGS; fuseN: split output for N splits merged inside
the kernel, the tile as gluon_epilogue.fused_merge_tile; early: EARLY_TABLE, the index table staged before the
lengths; trace: TRACE, the phase timestamps of bench/trace_sparse_decode.py; win256: SGLang's window cache
geometry, 256-token pages of 149,760 B, instead of 64-token pages for both caches).
The script loads kernels/sparse_mla_decode/gluon_*.py by path (only Triton is imported, not the package).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
import subprocess
import sys
import tempfile
import traceback
import types

KERNELS = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "sparse_mla_decode"
POINTERS = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "ekv_ptr": "*bf16", "widx_ptr": "*i32", "eidx_ptr": "*i32",
            "wlen_ptr": "*i32", "elen_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16", "lse_ptr": "*fp32",
            "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "counter_ptr": "*i32",
            "trace_ptr": "*i64"}


def parse(spec: str) -> dict:
    dtype, bn, stages, *flags = spec.split(":")
    if dtype not in ("bf16", "fp8"):
        raise SystemExit(f"config {spec!r}: dtype must be bf16 or fp8")
    cfg = dict(fp8=dtype == "fp8", bn=int(bn), stages=int(stages), regs=0, pv=160, fuse=0, early=0, trace=0,
               wshift=6, wpage=37440)
    for f in flags:
        if m := re.fullmatch(r"(regs|pv|fuse)(\d+)", f):
            cfg[m[1]] = int(m[2])
        elif f in ("early", "trace"):
            cfg[f] = 1
        elif f == "win256":
            cfg.update(wshift=8, wpage=149760)
        else:
            raise SystemExit(f"config {spec!r}: unknown flag {f!r} (regsN, pvN, fuseN, early, trace, win256)")
    cfg["regs"] = cfg["regs"] or (128 if cfg["fp8"] else 80 if cfg["bn"] == 64 else 40)
    return cfg


def compile_one(module, cfg: dict):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = module._sparse_decode_ws_kernel
    blocks = -(-128 // cfg["bn"]) + -(-512 // cfg["bn"])
    const = dict(BN=cfg["bn"], NS=cfg["stages"], SPLIT_OUT=False, IS_FP8=cfg["fp8"], HAS_EXTRA=True, HAS_WLEN=True,
                 HAS_ELEN=True, HAS_SINK=True, W_SHIFT=cfg["wshift"], W_PAGE=cfg["wpage"], E_SHIFT=6, E_PAGE=37440,
                 LOADER_WARPS=4,
                 LOADER_REGS=cfg["regs"], PV_REGS=cfg["pv"], MAXB=1 << (blocks - 1).bit_length(), PROBE=0,
                 FUSE_MERGE=False, SP=1, MHT=1, MDC=64, EARLY_TABLE=bool(cfg["early"]),
                 TRACE=bool(cfg["trace"]))
    if cfg["fuse"]:
        sp, mht, mdc = importlib.import_module(f"{module.__package__}.gluon_epilogue").fused_merge_tile(cfg["fuse"])
        const.update(SPLIT_OUT=True, FUSE_MERGE=True, SP=sp, MHT=mht, MDC=mdc)
    pointers = dict(POINTERS, **({"kv_ptr": "*u8", "ekv_ptr": "*u8"} if cfg["fp8"] else {}))
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in const:
            sig[name] = "constexpr"
        elif name in pointers or name.startswith("stride"):
            sig[name] = pointers.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32" if name == "qk_scale_log2" else "i32"
    return triton.compile(GluonASTSource(fn, sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--sass", type=pathlib.Path, help="also write each config's SASS into this folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="print the traceback of a config that does not compile")
    args = parser.parse_args(argv)
    import triton

    # A stand-in package over the kernel folder, so gluon_kernel's relative import works without
    # running the real package's __init__ (which needs torch).
    package = types.ModuleType("sparse_mla_decode_gluon")
    package.__path__ = [str(KERNELS)]
    sys.modules[package.__name__] = package
    module = importlib.import_module(f"{package.__name__}.gluon_kernel")
    bindir = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    print(f"triton {triton.__version__}")
    for text in args.configs:
        cfg = parse(text)
        try:
            compiled = compile_one(module, cfg)
        except Exception as exc:  # a config that does not build is a result
            print(f"{text:24s} does not compile: {type(exc).__name__}: {str(exc).splitlines()[-1][:200]}")
            if args.verbose:
                traceback.print_exc()
            continue
        with tempfile.TemporaryDirectory() as tmp:
            ptx = pathlib.Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            report = subprocess.run([bindir / "ptxas", "-arch=sm_90a", "-v", ptx, "-o", pathlib.Path(tmp) / "k.cubin"],
                                    capture_output=True, text=True).stderr
            if args.sass:
                args.sass.mkdir(parents=True, exist_ok=True)
                sass = subprocess.run([bindir / "nvdisasm", "-c", pathlib.Path(tmp) / "k.cubin"],
                                      capture_output=True, text=True).stdout
                (args.sass / f"{text.replace(':', '_')}.sass").write_text(sass)
        spill = re.search(r"(\d+) bytes spill stores", report)
        used = re.search(r"Used (\d+) registers", report)
        regs = sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", compiled.asm["ptx"])), key=int)
        print(f"{text:24s} smem {compiled.metadata.shared:7d} B  spill stores {spill[1] if spill else '?':>4s} B  "
              f"setmaxnreg {'/'.join(regs)}  ptxas regs {used[1] if used else '?'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
