"""Child process for the SGLang contract tests: SGLang's own code, run where it cannot pollute pytest.

    python -m dsv4_cluster.tests.sglang_child resolve '<argvs as JSON>'  -> resolved fields per argv, JSON
    python -m dsv4_cluster.tests.sglang_child plugin                     -> what load_plugins() did, as JSON
    python -m dsv4_cluster.tests.sglang_child install DIR                -> our factory on SGLang's classes

torchvision: SGLang's config package imports `torchvision.transforms` at module level (for vision
models' preprocessing), and no torchvision build loads beside the CPU torch 2.13 (every registry build
links torch's CUDA libraries). Argument resolution of a text model never calls it, so this child puts
an import-only stand-in on the import path; any *use* of it raises. The stand-in is the only thing here
that is not SGLang's own code, and it is not what is under test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import sys
import types
from pathlib import Path
from typing import Any

RESOLVED_FIELDS = ("page_size", "kv_cache_dtype", "attention_backend", "context_length", "tp_size",
                   "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port",
                   "base_gpu_id", "gpu_id_step", "numa_node", "port", "nccl_port", "served_model_name",
                   "reasoning_parser", "tool_call_parser", "enable_metrics", "random_seed")


class _Unusable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stand-in in this test child; nothing may use it")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

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


def _install_torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401  (a real, loadable torchvision wins)
    except (ImportError, RuntimeError):
        sys.modules.pop("torchvision", None)
        sys.meta_path.append(_TorchvisionStandIn())


def resolve(argv: list[str]) -> dict[str, Any]:
    """SGLang's parser, then its model-aware resolution; the fields the plan relies on."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(argv)
    parsed = {k: getattr(args, k) for k in ("page_size", "kv_cache_dtype", "tp_size", "numa_node")}
    args.resolve_once()
    resolved = args.resolved_dict()
    return {"parsed": parsed, "resolved": {k: resolved.get(k) for k in RESOLVED_FIELDS}}


def plugin() -> dict[str, Any]:
    """Run SGLang's real `load_plugins()` and report what became of the `dsv4` factory."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.plugins import load_plugins

    before = ATTENTION_BACKENDS.get("dsv4")
    load_plugins()
    after = ATTENTION_BACKENDS.get("dsv4")
    return {"stock_name": getattr(before, "__name__", None), "name": getattr(after, "__name__", None),
            "wraps_stock": getattr(after, "dsv4_stock", None) is before and before is not None,
            "replaced": after is not before}


def install(attest_dir: str) -> dict[str, Any]:
    """Our factory around SGLang's real DeepseekV4AttnBackend class, as far as a CPU allows.

    A real backend needs a GPU model runner, so the instance is made with `__new__` and given the
    `functools.partial(..., use_legacy=...)` SGLang 0.5.23's `__init__` binds; everything else (the
    class, the call-site modules, the plugin's checks, the attestation, the counters) is real."""
    import functools
    from types import SimpleNamespace

    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    from dsv4_cluster.kernels.sglang_plugin import installing_factory
    from dsv4_cluster.kernels.sglang_plugin.attestation import read_json
    from dsv4_cluster.kernels.sglang_plugin.install import PluginInstallError
    from dsv4_cluster.kernels.sglang_plugin.settings import PluginSettings

    def stock_flash_mla(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the stock FlashMLA call must have been replaced")

    def backend() -> Any:
        b = DeepseekV4AttnBackend.__new__(DeepseekV4AttnBackend)
        b._flash_mla_with_kvcache = functools.partial(stock_flash_mla, use_legacy=True)
        return b

    out: dict[str, Any] = {}
    for case, kernels, make in (("ok", ("sparse_mla_decode", "topk"), backend),
                                ("indexer", ("sparse_mla_decode", "indexer", "topk"), backend),
                                ("not_dsv4", ("sparse_mla_decode",), lambda: SimpleNamespace())):
        settings = PluginSettings(kernels=kernels, attest_dir=f"{attest_dir}/{case}", worker="decode-0")
        factory = installing_factory(lambda runner, make=make: make(), settings)
        try:
            b = factory(SimpleNamespace(device="cpu", tp_rank=1, gpu_id=5))
        except PluginInstallError as e:
            out[case] = {"error": str(e)}
            continue
        partial = b._flash_mla_with_kvcache
        from sglang.kernels.ops.attention.dsv4 import topk as topk_module
        from sglang.srt.layers.attention.dsv4 import indexer as indexer_module

        out[case] = {"flash_mla_keywords": partial.keywords,
                     "flash_mla_adapter": partial.func.dsv4_adapter.__module__,
                     "topk_adapters": [topk_module.topk_transform_paged_v2.dsv4_adapter.__module__,
                                       indexer_module.topk_transform_paged_v2.dsv4_adapter.__module__],
                     "attestation": read_json(Path(settings.attest_dir) / "rank1.json"),
                     "counters": read_json(Path(settings.attest_dir) / "counters-rank1.json")}
    return out


def main(argv: list[str]) -> int:
    _install_torchvision_stand_in()
    if argv[0] == "resolve":
        out = [resolve(one) for one in json.loads(argv[1])]  # one interpreter: SGLang imports take ~20 s
    elif argv[0] == "plugin":
        out = plugin()
    elif argv[0] == "install":
        out = install(argv[1])
    else:
        raise SystemExit(f"unknown command {argv[0]!r}; use resolve or plugin")
    print("RESULT " + json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
