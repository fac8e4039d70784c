"""Will the carry folder import on the H200? Checked here, on the CPU, before a device run is spent on it.

    python -m bench.sglang_backend_import_check CARRY_DIR

CARRY_DIR is what bench/sglang_backend_carry.py wrote (site/ + wheels/). Per mode, a fresh interpreter that
looks like the H200's as far as an import can tell:
- CUDA as SGLang detects it (`torch.cuda.is_available()`, `torch.version.cuda`, capability 9.0, one device), so
  SGLang's CUDA-only module-level branches run;
- `python -S` with sys.path = the standard library, the carry folder, and a folder of links to the installed
  packages that the H200 image's package list also has (DEVICE_PACKAGES, from the device docs; their
  dist-info too, so `importlib.metadata` sees what it would there), our package mapped with its entry point
  as the device script maps it: anything else is missing as it is there (the rig's import-only stand-ins then
  stand in, as there; torchvision, which the H200 has but no CPU build loads here, is stood in);
- SGLang and the carried pure packages only from the carry folder.
It then does what the bench's mode process does up to building the backend (import the backend, the stand-ins,
`load_plugins()`, SGLang's server args, ModelConfig, pool and backend on CPU tensors). Non-import failures after
the imports are reported, not fatal: the stock FlashMLA call, which cannot run here, ends stock's pass (after
SGLang's indexer fallbacks ran); plugin mode runs the whole decode path (our adapters' CPU references). Also the
capture path's metadata calls. Then a static listing for review: every import, at any depth, in SGLang's
DeepSeek-V4 decode files, of an `sglang` module the carry lacks or a package the H200 lacks (those inside a
try are listed apart); the ones seen are HIP / sm_120 / prefill / JIT paths the rig does not take. Exit status 1
when an import fails or an SGLang / carried module comes from outside the carry folder.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

# The H200 image's Python packages (device docs, "Python packages already there"), as distribution names.
DEVICE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp""".split()
# Import names that are not the distribution name with '-' -> '_' (and modules packages bring beside theirs).
IMPORT_NAMES = {"absl-py": "absl", "attrs": "attr attrs", "cuda-bindings": "cuda", "cuda-core": "cuda",
                "cuda-pathfinder": "cuda", "cupy-cuda13x": "cupy cupy_backends cupyx", "jax-cuda13-pjrt": "jax_plugins",
                "jax-cuda13-plugin": "jax_plugins", "markdown-it-py": "markdown_it", "nvidia-ml-py": "pynvml",
                "opencv-python-headless": "cv2", "pillow": "PIL", "protobuf": "google", "py-cpuinfo": "cpuinfo",
                "python-dateutil": "dateutil", "pyyaml": "yaml _yaml", "scikit-image": "skimage",
                "scikit-learn": "sklearn", "setuptools": "setuptools pkg_resources _distutils_hack",
                "torch": "torch functorch torchgen", "pytest": "pytest _pytest py", "typing-extensions": "typing_extensions",
                "jax": "jax", "jaxlib": "jaxlib", "nvidia-cublas": "nvidia", "cuda-toolkit": "nvidia",
                "charset-normalizer": "charset_normalizer", "sentence-transformers": "sentence_transformers",
                "pytorch-lightning": "pytorch_lightning", "triton": "triton"}
REMOVED_IN_312 = {"distutils", "imp", "asynchat", "asyncore", "smtpd"}
DECODE_FILES = ("sglang/srt/layers/attention/deepseek_v4_backend.py", "sglang/srt/layers/attention/dsv4/",
                "sglang/kernels/ops/attention/dsv4/", "sglang/srt/mem_cache/deepseek_v4_memory_pool.py",
                "sglang/kernels/ops/attention/flash_mla_interface.py", "sglang/srt/plugins/")


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def allowed(carry: Path) -> tuple[set[str], set[str]]:
    """(top-level module names, normalised distribution names) the H200 run can import / read metadata of."""
    mods = {m for n in DEVICE_PACKAGES for m in IMPORT_NAMES.get(n, n.replace("-", "_")).split()}
    mods |= set(sys.stdlib_module_names) - REMOVED_IN_312
    mods |= {p.name.removesuffix(".py") for p in (carry / "site").iterdir() if "dist-info" not in p.name}
    dists = {_norm(n) for n in DEVICE_PACKAGES} | {"dsv4_cluster"}
    dists |= {_norm(p.name.split("-")[0]) for p in (carry / "site").glob("*.dist-info")}
    for whl in (carry / "wheels").glob("*.whl"):
        dists.add(_norm(whl.name.split("-")[0]))
        with zipfile.ZipFile(whl) as z:
            mods |= {n.split("/")[0].split(".")[0] for n in z.namelist() if ".dist-info" not in n.split("/")[0]}
    from .sglang_backend_stand_ins import IMPORT_ONLY

    return mods | {"dsv4_cluster", "deep_gemm", *IMPORT_ONLY}, dists


CHILD = """
import importlib, json, sys, traceback
site, linked, mode, names = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
sys.path[:0] = [site, linked]
import torch
from types import SimpleNamespace
props = SimpleNamespace(major=9, minor=0, multi_processor_count=132, total_memory=143 << 30, name="NVIDIA H200",
                        L2_cache_size=60 << 20, warp_size=32)
torch.version.cuda = "13.0"
for k, v in dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                 get_device_capability=lambda *a: (9, 0), get_device_name=lambda *a: "NVIDIA H200",
                 get_device_properties=lambda *a: props, is_initialized=lambda: True,
                 mem_get_info=lambda *a: (140 << 30, 143 << 30)).items():
    setattr(torch.cuda, k, v)
from bench.torchvision_stand_in import install_torchvision_stand_in
install_torchvision_stand_in()  # the H200 has torchvision; no build of it loads beside the CPU torch here
from bench import sglang_backend_rig as rig
stood_in = rig.install_import_stand_ins()
rig.set_mode_env(mode)
rig.install_cpu_stand_ins()  # flash_mla: the real wheel needs a GPU to load (the H200 loads it)
errors, stage = [], "import"
try:
    import sglang.srt.layers.attention.deepseek_v4_backend
    rig.install_stand_ins(mode)
    factory = rig.load_plugins_and_check(mode)
    for name in sorted(names):
        importlib.import_module(name)
    stage = "build"
    r = rig.build(8192, 2, 1024, mode, "cpu", layer_ids=[0, 2, 3])
    stage = "graph metadata"
    rig.fill(r)
    fb = rig.decode_batch(r, 2, 1024)
    inputs = rig.layer_inputs(r, 2)
    try:  # the capture path's metadata calls (no graph can be captured here)
        r.backend.init_cuda_graph_state(2, 2)
        r.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        r.backend.init_forward_metadata_in_graph(fb)
        r.backend.on_after_cuda_graph_warmup()
    except BaseException as e:
        errors.append(dict(stage=stage, type=type(e).__name__, error=str(e)[:500], tb=traceback.format_exc()[-2500:]))
    stage = "decode"
    r.backend.init_forward_metadata(fb)
    if mode == "stock":  # SGLang's indexer fallbacks first: its FlashMLA call cannot run here
        x = inputs[0]["q"][:, :1, :1]
        r.backend.forward_c4_indexer(x=x, q_lora=x, c4_indexer=inputs[1]["indexer"], forward_batch=fb,
                                     skip_compressor=True)
        stage = "flash_mla (expected: CPU)"
    rig.run_layers(r, fb, inputs)
    stage = "done"
except BaseException as e:
    errors.append(dict(stage=stage, type=type(e).__name__, error=str(e)[:500], tb=traceback.format_exc()[-2500:]))
files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
print("RESULT " + json.dumps(dict(stage=stage, errors=errors, files=files, stood_in=stood_in)))
"""


def device_path(carry: Path, linked: Path) -> None:
    """`linked`: links to this interpreter's installed packages the H200 also has (and their dist-info), and our
    package mapped with its entry point as bench/run_sglang_backend_on_h200.sh maps it there."""
    import site as site_module

    mods, dists = allowed(carry)
    from .sglang_backend_stand_ins import IMPORT_ONLY

    mods -= {p.name.removesuffix(".py") for p in (carry / "site").iterdir()} | {"dsv4_cluster", "deep_gemm",
                                                                                 *IMPORT_ONLY}
    linked.mkdir(parents=True, exist_ok=True)
    for root in site_module.getsitepackages():
        for entry in Path(root).iterdir():
            name = entry.name
            if name.endswith(".dist-info"):
                ok = _norm(name.split("-")[0]) in dists and not _norm(name).startswith("dsv4_cluster")
            else:
                ok = name.split(".")[0] in mods
            if ok and not (linked / name).exists():
                (linked / name).symlink_to(entry)
    repo = Path(__file__).resolve().parents[1]
    pkg = linked / "dsv4_cluster"
    pkg.mkdir()
    for d in ("kernels", "orchestrator", "router", "workers", "deploy"):
        (pkg / d).symlink_to(repo / d)
    for d in ("tests", "bench"):
        (linked / d).symlink_to(repo / d)
    for f in (repo / "dsv4_cluster").glob("*.py"):
        (pkg / f.name).symlink_to(f)
    info = linked / "dsv4_cluster-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-cluster\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ndsv4_cluster = dsv4_cluster.kernels.sglang_plugin:register\n")


def run_child(carry: Path, mode: str, names: list[str]) -> dict:
    """The mode's import chain in `python -S` (no site-packages): only the carry folder and `device_path`."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["DSV4_CLUSTER_ATTEST_DIR"] = env.get("DSV4_CLUSTER_ATTEST_DIR", "") or tempfile.mkdtemp()
    with tempfile.TemporaryDirectory() as tmp:
        device_path(carry, Path(tmp) / "p")
        proc = subprocess.run([sys.executable, "-S", "-c", CHILD, str(carry / "site"), str(Path(tmp) / "p"), mode,
                               json.dumps(names)], capture_output=True, text=True, timeout=900, cwd=tmp,
                              env={**env, "TRITON_INTERPRET": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the {mode} check child died ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][7:])


def outside(carry: Path, files: dict) -> list[str]:
    """Modules of SGLang or a carried package that did not come from the carry folder."""
    site = str((carry / "site").resolve())
    tops = {p.name for p in (carry / "site").iterdir() if "dist-info" not in p.name}
    return sorted(f"{n}: {f}" for n, f in files.items()
                  if f and n.split(".")[0] in tops and not str(Path(f).resolve()).startswith(site))


def static_imports(carry: Path, mods: set[str]) -> dict[str, list[str]]:
    """Imports at any depth in the decode files that the H200 cannot resolve: 'unguarded' and 'guarded'
    (inside a try whose handlers catch ImportError / Exception)."""
    site = carry / "site"
    out: dict[str, list[str]] = {"unguarded": [], "guarded": []}

    def resolves(module: str) -> bool:
        parts = module.split(".")
        if parts[0] != "sglang":
            return parts[0] in mods
        path = site.joinpath(*parts)
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    files = [p for p in site.rglob("*.py") if str(p.relative_to(site)).startswith(DECODE_FILES)]
    for f in sorted(files):
        rel = f.relative_to(site)
        pkg = ".".join(rel.parts[:-1])
        tree = ast.parse(f.read_text())
        guarded = set()
        for n in ast.walk(tree):
            if isinstance(n, ast.Try) and any(h.type is None or "Error" in ast.unparse(h.type) or
                                              "Exception" in ast.unparse(h.type) for h in n.handlers):
                guarded |= {id(x) for b in n.body for x in ast.walk(b)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([n.module] if n.module else []))
                subs = [f"{base}.{a.name}" for a in n.names]
                targets = [base] + [s for s in subs if resolves(s)] if base.startswith("sglang") else [base]
            else:
                continue
            for t in targets:
                if not resolves(t):
                    out["guarded" if id(n) in guarded else "unguarded"].append(f"{rel}:{n.lineno} {t}")
    return out


def check(carry: Path, names: list[str] | None = None) -> dict:
    names = names or [n for n in json.loads((carry / "modules.json").read_text()) if n.startswith("sglang")]
    report = {"modes": {}, "static": static_imports(carry, allowed(carry)[0])}
    for mode in ("stock", "plugin"):
        r = run_child(carry, mode, names)
        report["modes"][mode] = {"stage": r["stage"], "errors": r["errors"],
                                 "outside_carry": outside(carry, r["files"]), "stood_in": r["stood_in"]}
    return report


def failed(report: dict) -> list[str]:
    bad = []
    for mode, r in report["modes"].items():
        bad += [f"{mode}: {e['stage']} {e['type']}: {e['error']}" for e in r["errors"]
                if e["stage"] == "import" or "Import" in e["type"] or "NotFound" in e["type"]]
        bad += [f"{mode}: from outside the carry: {x}" for x in r["outside_carry"]]
    return bad


if __name__ == "__main__":
    result = check(Path(sys.argv[1]).resolve())  # the children run elsewhere
    print(json.dumps(result, indent=1))
    problems = failed(result)
    print("\n".join(problems) or "import chain: OK")
    sys.exit(1 if problems else 0)
