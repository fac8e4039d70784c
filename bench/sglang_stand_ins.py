"""What stands in for packages and calls that cannot load or run here, beside SGLang's own code: each, and why.

Nothing here computes anything the rig of bench/sglang_backend_rig.py measures: each is an import the decode path
never calls, or a call whose result only a kernel the plugin replaced (or the compressor, which is not run) reads.
docs/sglang.md lists them. A real, loadable package always wins over its stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any


class _Unusable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: an import-only stand-in here; nothing may use it")


class ImportOnly(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """The packages `names` (and their submodules) as modules that import, and whose every use raises."""

    def __init__(self, names) -> None:
        self.names = set(names)

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, self, is_package=True) if name.split(".")[0] in self.names else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attr(name: str, _prefix: str = spec.name) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unusable(f"{_prefix}.{name}")

        module.__getattr__ = attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0"  # older than any real release: transformers skips its vision paths


def install_torchvision_stand_in() -> None:
    """SGLang's config package imports `torchvision.transforms` at module level (vision models); no build loads beside
    the CPU torch, and text models never call it (tests/sglang_child.py and the rig on the CPU)."""
    try:
        import torchvision  # noqa: F401  (a real, loadable torchvision wins)
    except (ImportError, RuntimeError):
        sys.modules.pop("torchvision", None)
        sys.meta_path.append(ImportOnly({"torchvision"}))


# Imported at module level by SGLang modules on the decode path's import chain (server utilities, tokenizer
# and OpenAI protocol, quantisation formats, JIT loader, notebook helpers), not on the H200 image, and never
# called by the decode path: import-only stand-ins whose every use raises (install_import_stand_ins).
IMPORT_ONLY = ("sgl_kernel", "orjson", "pybase64", "starlette", "zmq", "IPython", "compressed_tensors", "gguf",
               "partial_json_parser", "loguru")


def install_import_stand_ins(names=IMPORT_ONLY, force: bool = False) -> list[str]:
    """Stand-ins for `names` that are not installed (a real package wins unless `force`, which tests use to
    check the H200's import chain here); returns those stood in."""
    missing = [n for n in names if force or importlib.util.find_spec(n) is None]
    if missing:
        sys.meta_path.insert(0, ImportOnly(missing))
    return missing


def install_cpu_stand_ins() -> None:
    """CPU only, before SGLang imports: a flash_mla module (FlashMLA is CUDA-only) with an empty schedule object."""
    if "flash_mla" in sys.modules:
        return
    module, sub = types.ModuleType("flash_mla"), types.ModuleType("flash_mla.flash_mla_interface")
    sub.FlashMLASchedMeta = type("FlashMLASchedMeta", (), {})
    module.flash_mla_interface = sub
    module.get_mla_metadata = lambda *a, **k: (sub.FlashMLASchedMeta(), None)

    def unusable(*args, **kwargs):
        raise RuntimeError("flash_mla stand-in (CPU): FlashMLA cannot run here")

    module.fused_norm_rope_attn_rope_cast = module.flash_mla_with_kvcache = unusable
    sys.modules["flash_mla"], sys.modules["flash_mla.flash_mla_interface"] = module, sub


def install_stand_ins(mode: str, device: str = "cuda") -> None:
    """After SGLang's modules import, before load_plugins: no compressor decode plan (a JIT C++ planner read only by
    the compressor, which the rig does not run); on the CPU the backend's FlashMLA partial bound to a function that
    raises (the plugin replaces it); in plugin mode SGLang's JIT `plan_topk_v2` (its plan is read only by the top-k
    kernel the plugin replaced) and, when DeepGEMM does not load, a `deep_gemm` module holding the plugin's
    replacement target (raises if called unreplaced), the SM count and an empty schedule (read only by DeepGEMM's
    kernel)."""
    import functools

    import torch

    from sglang.srt.layers.attention import deepseek_v4_backend as backend_module
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    backend_module.create_paged_compressor_data = _no_compressor_plan
    if device == "cpu":
        stock = ATTENTION_BACKENDS["dsv4"]

        def create_dsv4_backend_cpu(runner):
            backend = stock(runner)
            backend._flash_mla_with_kvcache = functools.partial(sys.modules["flash_mla"].flash_mla_with_kvcache,
                                                                use_legacy=True)
            return backend

        ATTENTION_BACKENDS["dsv4"] = create_dsv4_backend_cpu
    if mode != "plugin":
        return
    import sglang.kernels.ops.attention.dsv4 as dsv4_ops
    from sglang.kernels.ops.attention.dsv4 import topk as topk_module

    width = topk_module._PLAN_METADATA_INTS_PER_BATCH

    def plan_topk_v2(seq_lens, static_threshold=-1, *, out=None):
        return seq_lens.new_empty(seq_lens.shape[0] + 1, width) if out is None else out

    dsv4_ops.plan_topk_v2 = plan_topk_v2
    if "deep_gemm" not in sys.modules:
        try:
            import deep_gemm  # noqa: F401  (a real, loadable DeepGEMM wins)
        except Exception:
            sys.modules["deep_gemm"] = _deep_gemm_stand_in(torch)


def _no_compressor_plan(compress_ratio, **_):
    return None


def _deep_gemm_stand_in(torch):
    module = types.ModuleType("deep_gemm")
    module.__file__ = "<dsv4-cluster rig stand-in>"

    def fp8_paged_mqa_logits(*args, **kwargs):
        raise RuntimeError("deep_gemm stand-in: fp8_paged_mqa_logits must have been replaced by the plugin")

    def get_num_sms():
        return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 1

    def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
        return torch.empty(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)

    module.fp8_paged_mqa_logits, module.get_num_sms = fp8_paged_mqa_logits, get_num_sms
    module.get_paged_mqa_logits_metadata = get_paged_mqa_logits_metadata
    return module
