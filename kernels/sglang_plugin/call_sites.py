"""The SGLang 0.5.23 call sites our kernels replace, and the signatures they must still have.

One table serves the plugin (it refuses to install over a call site that moved or changed shape:
fail closed) and the contract test in CI (so a new SGLang release fails a test, not a deployment).
Signatures are compared from source (`ast`), so the check runs where the CUDA-only modules behind
them (FlashMLA, DeepGEMM) cannot be imported.

- sparse_mla_decode: each `DeepseekV4AttnBackend` binds `functools.partial(flash_mla_interface.
  flash_mla_with_kvcache, use_legacy=...)` to `self._flash_mla_with_kvcache` in `__init__`, so it is
  replaced per backend instance, right after the `dsv4` factory built it.
- indexer: `dsv4/indexer.py` does `from deep_gemm import fp8_paged_mqa_logits as fn` at call time,
  so it is replaced on the `deep_gemm` module.
- topk: `dsv4/indexer.py` imported `topk_transform_paged_v2` at module load (replaced there) and
  `dsa_topk_backend.py` imports it from `kernels/ops/attention/dsv4/topk.py` at call time (replaced
  there too).
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

FLASH_MLA_PARAMS = (
    "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata", "num_splits",
    "softmax_scale", "causal", "descale_q", "descale_k", "is_fp8_kvcache", "indices", "attn_sink",
    "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length", "kv_format", "*use_legacy",
)
TOPK_V2_PARAMS = ("scores", "seq_lens", "page_tables", "out_page_indices", "page_size", "metadata",
                  "out_raw_indices")
# deep_gemm.fp8_paged_mqa_logits is a compiled function; SGLang's call in dsv4/indexer.py is the contract.
INDEXER_CALL_MODULE = "sglang.srt.layers.attention.dsv4.indexer"


@dataclass(frozen=True)
class CallSite:
    kernel: str
    module: str  # where the name SGLang calls lives
    attr: str
    params: tuple[str, ...] | None  # expected parameter names ("*x": keyword-only); None: compiled


CALL_SITES = (
    CallSite("sparse_mla_decode", "sglang.kernels.ops.attention.flash_mla_interface", "flash_mla_with_kvcache",
             FLASH_MLA_PARAMS),
    CallSite("indexer", "deep_gemm", "fp8_paged_mqa_logits", None),
    CallSite("topk", "sglang.kernels.ops.attention.dsv4.topk", "topk_transform_paged_v2", TOPK_V2_PARAMS),
    CallSite("topk", "sglang.srt.layers.attention.dsv4.indexer", "topk_transform_paged_v2", TOPK_V2_PARAMS),
)
BACKEND_MODULE = "sglang.srt.layers.attention.deepseek_v4_backend"
BACKEND_CLASS = "DeepseekV4AttnBackend"
BACKEND_ATTR = "_flash_mla_with_kvcache"
REGISTRY_MODULE = "sglang.srt.layers.attention.attention_registry"
REGISTRY_KEY = "dsv4"


class CallSiteError(RuntimeError):
    """An SGLang call site the plugin replaces is missing or changed: the plugin refuses to install."""


def module_source(module: str) -> tuple[Path, ast.Module]:
    """The parsed source of `module`, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise CallSiteError(f"SGLang module {module} is not installed as Python source")
    path = Path(spec.origin)
    return path, ast.parse(path.read_text(), filename=str(path))


def _params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    return tuple(p.arg for p in [*a.posonlyargs, *a.args]) + tuple(f"*{p.arg}" for p in a.kwonlyargs)


def source_params(module: str, attr: str) -> tuple[str, ...]:
    """Parameter names of the top-level function `attr` in `module`'s source."""
    path, tree = module_source(module)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return _params(node)
    raise CallSiteError(f"{module} ({path}) defines no function {attr}")


def imports_name(module: str, name: str, from_module: str) -> bool:
    """Whether `module` imports `name` from `from_module` (anywhere in its source)."""
    _, tree = module_source(module)
    return any(isinstance(n, ast.ImportFrom) and n.module == from_module and any(a.name == name for a in n.names)
               for n in ast.walk(tree))


def check_call_site(site: CallSite) -> None:
    """Raise CallSiteError unless `site` still has the signature the adapter was written for."""
    if site.params is None:
        if not imports_name(INDEXER_CALL_MODULE, site.attr, site.module):
            raise CallSiteError(f"{INDEXER_CALL_MODULE} no longer imports {site.attr} from {site.module}; "
                                f"the {site.kernel} adapter would never be called")
        return
    if site.module == INDEXER_CALL_MODULE:
        if not imports_name(site.module, site.attr, "sglang.kernels.ops.attention.dsv4"):
            raise CallSiteError(f"{site.module} no longer imports {site.attr}; the {site.kernel} adapter "
                                "would never be called")
        return
    found = source_params(site.module, site.attr)
    if found != site.params:
        raise CallSiteError(f"{site.module}.{site.attr} changed its signature: expected ({', '.join(site.params)}), "
                            f"found ({', '.join(found)}); the {site.kernel} adapter was written for the former")
