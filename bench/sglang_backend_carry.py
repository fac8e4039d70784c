"""What travels to the GPU for bench/sglang_backend.py: SGLang's files from its released wheel, unmodified.

    python -m bench.sglang_backend_carry WHEEL_DIR OUT_DIR

Runs the rig's decode path on the CPU in both modes (a child each, TRITON_INTERPRET=1), records every `sglang` module
it imported, and writes OUT_DIR/site: those files from the cp312 wheel (each checked against its RECORD sha256), the
module-level imports of those, every .py of the DeepSeek-V4 folders (device-only branches import siblings), the
wheel's METADATA, and the imported files of the pure-Python packages the H200 image lacks (PURE); the native ones
travel as wheels (NATIVE, from WHEEL_DIR). The carried SGLang files with their hashes: bench/results/sglang_backend_files.txt.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
WHOLE_DIRS = ("sglang/srt/layers/attention/dsv4/", "sglang/kernels/ops/attention/dsv4/",
              "sglang/srt/layers/attention/dsa/")
# read as source by the forced-sm_120 tests and bench (bench/sm120_decode.py), never imported on sm_90
SM120_FILES = ("sglang/kernels/ops/attention/flash_mla_sm120.py", "sglang/kernels/ops/attention/flash_mla_sm120_triton.py")
JIT_SOURCES = ("sglang/kernels/jit/include/", "sglang/kernels/jit/csrc/")
PURE = ("pydantic", "annotated_types", "typing_inspection", "dill", "openai", "httpx2", "sniffio")
NATIVE = ("msgspec-0.23.0", "pydantic_core-2.46.4", "apache_tvm_ffi-0.1.11", "sgl_flash_mla-1.0.0")

CHILD = """
import json, sys
from bench import sglang_backend_rig as rig
rig.prepare(sys.argv[1], "cpu")
r, fb, inputs = rig.cpu_case(sys.argv[1], 2, 1024)
if sys.argv[1] == "plugin":  # our kernel on every decode call (the route table may send a CPU-sized call to stock,
    from dsv4_cluster.kernels import decode_routes  # whose FlashMLA cannot run here)
    decode_routes.route = lambda *args: "ours"
    rig.run_layers(r, fb, inputs)
else:
    x = inputs[0]["q"][:, :1, :1]
    r.backend.forward_c4_indexer(x=x, q_lora=x, c4_indexer=inputs[1]["indexer"], forward_batch=fb, skip_compressor=True)
print("MODULES " + json.dumps({n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}))
"""


def imported_modules() -> dict[str, str]:
    """Module name -> file, for everything the rig's decode path imported on the CPU, both modes."""
    found: dict[str, str] = {}
    for mode in ("stock", "plugin"):
        proc = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "TRITON_INTERPRET": "1"})
        lines = [x for x in proc.stdout.splitlines() if x.startswith("MODULES ")]
        if proc.returncode or not lines:
            raise RuntimeError(f"the {mode} CPU run failed:\n{proc.stderr[-3000:]}")
        found.update({k: v for k, v in json.loads(lines[-1][8:]).items() if v})
    return found


def module_level_closure(wheel: zipfile.ZipFile, names: set[str], files: set[str]) -> set[str]:
    """`files` plus every sglang module imported at module level (also under a top-level if/try: the CUDA-only
    branches a CPU run does not take) by any of them, transitively."""
    import ast

    def file_of(module: str):
        path = module.replace(".", "/")
        return next((c for c in (path + ".py", path + "/__init__.py") if c in names), None)

    seen, todo = set(), list(files)
    while todo:
        f = todo.pop()
        if f in seen or not f.endswith(".py"):
            seen.add(f)
            continue
        seen.add(f)
        tree = ast.parse(wheel.read(f))
        pkg = (f[:-12] if f.endswith("/__init__.py") else f.rsplit("/", 1)[0]).replace("/", ".")
        nodes = list(tree.body) + [x for n in tree.body if isinstance(n, (ast.If, ast.Try)) for x in ast.walk(n)]
        for n in nodes:
            mods = []
            if isinstance(n, ast.Import):
                mods = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    parts = pkg.split(".")
                    base = ".".join(parts[:len(parts) - (n.level - 1)] + ([n.module] if n.module else []))
                mods = [base] + [f"{base}.{a.name}" for a in n.names]
            for m in mods:
                parts = m.split(".")
                if parts[0] != "sglang":
                    continue
                for i in range(1, len(parts) + 1):
                    found = file_of(".".join(parts[:i]))
                    if found and found not in seen:
                        todo.append(found)
    return seen


def _record(wheel: zipfile.ZipFile) -> dict[str, str]:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
    rows = csv.reader(io.StringIO(wheel.read(name).decode()))
    return {row[0]: row[1] for row in rows if len(row) > 1 and row[1]}


def build(wheel_dir: Path, out: Path) -> list[str]:
    mods = imported_modules()
    wheel_path = next(wheel_dir.glob("sglang-0.5.23-cp312-*.whl"))
    site = out / "site"
    shutil.rmtree(out, ignore_errors=True)
    site.mkdir(parents=True)
    carried = []
    with zipfile.ZipFile(wheel_path) as wheel:
        record, names = _record(wheel), set(wheel.namelist())
        wanted = set()
        for name, file in mods.items():
            if name == "sglang" or name.startswith("sglang."):
                rel = "sglang/" + file.split("/sglang/", 1)[1]
                if rel in names:
                    wanted.add(rel)
        wanted |= {n for n in names if n.endswith(".py") and n.startswith(WHOLE_DIRS)}
        wanted |= set(SM120_FILES) & names
        wanted = module_level_closure(wheel, names, wanted)
        wanted |= {n for n in names if n.endswith("dist-info/METADATA") or n.endswith("dist-info/RECORD")}
        wanted |= {n for n in names if n.startswith(JIT_SOURCES) and not n.endswith("/")}  # its loader asserts they exist at import
        for rel in sorted(wanted):
            data = wheel.read(rel)
            digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            if rel in record and record[rel] != digest:
                raise RuntimeError(f"{rel} does not match the wheel's RECORD")
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            (site / rel).write_bytes(data)
            if rel.endswith(".py") or rel.startswith(JIT_SOURCES):
                carried.append(f"{digest[7:]}  {rel}")
    for name, file in mods.items():
        top = name.split(".")[0]
        if top in PURE:
            rel = Path(file.split("/site-packages/", 1)[1])
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, site / rel)
    for dist in {Path(f.split("/site-packages/", 1)[0] + "/site-packages") for n, f in mods.items()
                 if n.split(".")[0] in PURE}:  # their dist-info: httpx2 reads its own version at import
        for info in dist.glob("*.dist-info"):
            if info.name.split("-")[0].lower().replace("_", "") in {p.replace("_", "") for p in PURE}:
                (site / info.name).mkdir(exist_ok=True)
                shutil.copy2(info / "METADATA", site / info.name / "METADATA")
    for package in ("pydantic",):  # lazily imports its submodules by name
        src = Path(__import__(package).__file__).parent
        shutil.copytree(src, site / package, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    (out / "wheels").mkdir()
    for stem in NATIVE:
        for w in list(wheel_dir.glob(f"{stem}-*.whl")):
            shutil.copy2(w, out / "wheels" / w.name)
    (out / "modules.json").write_text(json.dumps(sorted(mods)))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sglang_backend_files.txt").write_text(
        f"# SGLang 0.5.23 files carried to the H200, unmodified, from {wheel_path.name} (sha256, urlsafe base64 as "
        "in the wheel's RECORD)\n" + "\n".join(carried) + "\n")
    return carried


if __name__ == "__main__":
    import argparse

    cli = argparse.ArgumentParser(prog="python -m bench.sglang_backend_carry", description=__doc__.split("\n")[0])
    cli.add_argument("wheel_dir", type=Path, help="SGLang 0.5.23's cp312 wheel and the native wheels (NATIVE)")
    cli.add_argument("out_dir", type=Path, help="where the carry's site/ is written")
    args = cli.parse_args()
    files = build(args.wheel_dir, args.out_dir)
    print(f"{len(files)} SGLang files carried")
