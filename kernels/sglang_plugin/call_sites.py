"""The SGLang 0.5.23 call sites our kernels replace, per GPU class, and what must still hold there.

One table serves the plugin (it refuses to install over a call site that moved or changed shape: fail
closed), the contract tests in CI (signature and dispatch condition of every entry, read in SGLang's own
source with `ast`, so a new release fails a test, not a deployment) and the docs (docs/sglang.md, "By GPU class",
says per class what SGLang calls and why each site is replaced where it is). Sources are parsed, not imported, so
the checks run where FlashMLA / DeepGEMM / FlashInfer cannot be imported. What stays stock, and why, is `STOCK`.
"""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ..dispatch import GPU_CLASSES

FLASH_MLA_PARAMS = (
    "q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata", "num_splits",
    "softmax_scale", "causal", "descale_q", "descale_k", "is_fp8_kvcache", "indices", "attn_sink",
    "extra_k_cache", "extra_indices_in_kvcache", "topk_length", "extra_topk_length", "kv_format", "*use_legacy",
)
TOPK_V2_PARAMS = ("scores", "seq_lens", "page_tables", "out_page_indices", "page_size", "metadata",
                  "out_raw_indices")
# deep_gemm.fp8_paged_mqa_logits is a compiled function; SGLang's call in dsv4/indexer.py is the contract.
INDEXER_CALL_MODULE = "sglang.srt.layers.attention.dsv4.indexer"


BACKEND_MODULE = "sglang.srt.layers.attention.deepseek_v4_backend"
SM120_MODULE = "sglang.kernels.ops.attention.flash_mla_sm120"
SM120_PARAMS = ("**kwargs",)
TORCH_SM120_PARAMS = ("q_fp8", "kvcache_fp8", "weight", "seq_lens", "page_table", "deep_gemm_metadata", "max_seq_len",
                      "clean_logits")
TORCH_INDEXER_ENV = "SGLANG_FP8_PAGED_MQA_LOGITS_TORCH"
# the decode's metadata builders (one per step): module globals their callers look up at call time
META_MODULE = "sglang.kernels.ops.attention.dsv4.metadata_kernel"
PAGES_MODULE = "sglang.kernels.ops.attention.dsv4.attn_metadata_kernels"
COMPRESSED_META_PARAMS = ("seq_lens", "positions", "raw_out_loc", "page_table", "page_size", "compute_page_indices")
PAGE_TABLE_PARAMS = ("*req_to_token", "*req_pool_indices_repeated", "*seq_lens_casual", "*max_seq_len", "*page_size",
                     "*swa_window")


@dataclass(frozen=True)
class Branch:
    """A dispatch condition in SGLang's source: in `function` of `module`, an `if` whose test reads `test` (or
    starts with it, `prefix`) reaches `name` (called, assigned or imported) in its body (`orelse`: its else)."""

    module: str
    function: str
    test: str
    name: str
    orelse: bool = False
    prefix: bool = False

    def holds(self) -> bool:
        _, tree = module_source(self.module)
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name == self.function):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and _matches(ast.unparse(node.test), self.test, self.prefix):
                    if _reaches(node.orelse if self.orelse else node.body, self.name):
                        return True
        return False

    def describe(self) -> str:
        return (f"{self.module}.{self.function}: {'else of ' if self.orelse else ''}`if {self.test}"
                f"{' ...' if self.prefix else ''}` reaches {self.name}")


def _matches(found: str, test: str, prefix: bool) -> bool:
    return found.startswith(test) if prefix else found == test


def _reaches(body: list, name: str) -> bool:
    for stmt in body:
        for n in ast.walk(stmt):
            if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name):
                return True
            if isinstance(n, ast.ImportFrom) and any(a.name == name for a in n.names):
                return True
            if isinstance(n, ast.Assign) and ast.unparse(n.value) in (name, f"self.{name}"):
                return True
    return False


@dataclass(frozen=True)
class CallSite:
    kernel: str
    module: str  # where the name SGLang calls lives
    attr: str
    params: tuple[str, ...] | None  # expected parameter names ("*x": keyword-only; "**x": var-keyword); None: compiled
    classes: tuple[str, ...] = GPU_CLASSES  # GPU classes whose decode calls it
    branch: Branch | None = None  # SGLang's dispatch condition that routes the call here
    env: str | None = None  # an SGLang env switch that routes the call here (absent: the default route)
    on_backend: bool = False  # replaced per backend instance (the FlashMLA partial), not on the module
    metadata: bool = False  # a metadata builder of the kernel's call (counted apart: attestation.METADATA)


BACKEND_FN = "_forward_attention"
INDEXER_FN = "forward_c4_indexer"
CALL_SITES = (
    CallSite("sparse_mla_decode", "sglang.kernels.ops.attention.flash_mla_interface", "flash_mla_with_kvcache",
             FLASH_MLA_PARAMS, ("sm_90", "sm_100"),
             Branch(BACKEND_MODULE, BACKEND_FN, "get_platform().is_sm120", "_flash_mla_with_kvcache", orelse=True),
             on_backend=True),
    CallSite("sparse_mla_decode", SM120_MODULE, "flash_mla_with_kvcache_sm120", SM120_PARAMS, ("sm_120",),
             Branch(BACKEND_MODULE, BACKEND_FN, "get_platform().is_sm120", "flash_mla_with_kvcache_sm120")),
    CallSite("indexer", "deep_gemm", "fp8_paged_mqa_logits", None, GPU_CLASSES,
             Branch(INDEXER_CALL_MODULE, INDEXER_FN, "is_xpu()", "fp8_paged_mqa_logits", orelse=True)),
    CallSite("indexer", INDEXER_CALL_MODULE, "fp8_paged_mqa_logits_torch_sm120", TORCH_SM120_PARAMS, ("sm_120",),
             Branch(INDEXER_CALL_MODULE, INDEXER_FN, "get_platform().is_sm120", "fp8_paged_mqa_logits_torch_sm120"),
             env=TORCH_INDEXER_ENV),
    # top-k: `dsa_topk_backend.py` imports it from `dsv4/topk.py`, and `dsv4/indexer.py` bound its own name at load
    CallSite("topk", "sglang.kernels.ops.attention.dsv4.topk", "topk_transform_paged_v2", TOPK_V2_PARAMS, GPU_CLASSES,
             Branch(INDEXER_CALL_MODULE, INDEXER_FN, "self.dsa_topk_backend.should_use_topk_v2()",
                    "topk_transform_paged_v2")),
    CallSite("topk", INDEXER_CALL_MODULE, "topk_transform_paged_v2", TOPK_V2_PARAMS, GPU_CLASSES,
             Branch(INDEXER_CALL_MODULE, INDEXER_FN, "self.dsa_topk_backend.should_use_topk_v2()",
                    "topk_transform_paged_v2")),
    # the decode's per-step metadata, where measured (sm_90): SGLang's builders walk the configured width in one
    # program a request; ours spread it (sglang_adapters/metadata.py), same bytes out
    CallSite("sparse_mla_decode", META_MODULE, "_init_compressed_attn_metadata_triton", COMPRESSED_META_PARAMS,
             ("sm_90",), Branch(BACKEND_MODULE, "init_compression_metadata", "self.has_c4 or self.has_c128",
                                "_init_compression_metadata_triton"), metadata=True),
    CallSite("sparse_mla_decode", PAGES_MODULE, "build_page_table_positions_triton", PAGE_TABLE_PARAMS, ("sm_90",),
             Branch(PAGES_MODULE, "execute", "_inputs_on_cuda(*args, **kwargs)", "triton"), metadata=True),
)


@dataclass(frozen=True)
class StockSite:
    """A call SGLang makes on a class that the plugin leaves stock, why, and what the plugin does about it."""

    kernel: str
    classes: tuple[str, ...]
    what: str
    why: str
    branch: Branch


STOCK = (
    StockSite("sparse_mla_decode", ("sm_100",), "decode_attention_sm100.swapab_attention",
              "taken only by DeepSeek-V4.1 checkpoints (`self.is_dsv41`); DeepSeek-V4-Flash never reaches it",
              Branch(BACKEND_MODULE, BACKEND_FN, "self.is_dsv41 and get_platform().is_sm100", "swapab_attention",
                     prefix=True)),
    StockSite("sparse_mla_decode", ("sm_100",), "DeepseekV4TrtllmAttnBackend._forward_trtllm",
              "opt-in `--dsv4-attn-backend trtllm` reads a uniform-FP8 pool our kernel does not: the plugin refuses "
              "to install (model init fails, naming it)",
              Branch(BACKEND_MODULE, BACKEND_FN, "self.trtllm_attn", "_forward_trtllm")),
    StockSite("indexer", GPU_CLASSES, "deep_gemm.fp8_fp4_paged_mqa_logits",
              "opt-in `--enable-deepseek-v4-fp4-indexer` scores FP4 keys: the plugin refuses the indexer there",
              Branch(INDEXER_CALL_MODULE, INDEXER_FN, "use_fp4_indexer and (not use_aiter_fp4)",
                     "fp8_fp4_paged_mqa_logits")),
)
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
    kwargs = (f"**{a.kwarg.arg}",) if a.kwarg is not None else ()
    return tuple(p.arg for p in [*a.posonlyargs, *a.args]) + tuple(f"*{p.arg}" for p in a.kwonlyargs) + kwargs


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
    """Raise CallSiteError unless `site` still has the signature the adapter was written for and SGLang's
    dispatch condition still routes the call there."""
    if site.branch is not None and not site.branch.holds():
        raise CallSiteError(f"SGLang's dispatch changed: {site.branch.describe()} no longer holds; the "
                            f"{site.kernel} adapter at {site.module}.{site.attr} would never be called")
    _check_signature(site)


def sites_for(gpu: str, kernel: str | None = None, env: dict | None = None) -> tuple[CallSite, ...]:
    """The call sites SGLang calls on class `gpu` under `env` (an env-routed site replaces the default one of
    its kernel on that class when its switch is on)."""
    env = env or {}
    on = {s.kernel for s in CALL_SITES if gpu in s.classes and s.env and truthy(env.get(s.env))}
    return tuple(s for s in CALL_SITES if gpu in s.classes and (kernel is None or s.kernel == kernel)
                 and ((s.env is not None and truthy(env.get(s.env))) or (s.env is None and s.kernel not in on)))


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _check_signature(site: CallSite) -> None:
    if site.params is None:
        if not imports_name(INDEXER_CALL_MODULE, site.attr, site.module):
            raise CallSiteError(f"{INDEXER_CALL_MODULE} no longer imports {site.attr} from {site.module}; "
                                f"the {site.kernel} adapter would never be called")
        return
    if site.module == INDEXER_CALL_MODULE and site.kernel == "topk":
        if not imports_name(site.module, site.attr, "sglang.kernels.ops.attention.dsv4"):
            raise CallSiteError(f"{site.module} no longer imports {site.attr}; the {site.kernel} adapter "
                                "would never be called")
        return
    found = source_params(site.module, site.attr)
    if found != site.params:
        raise CallSiteError(f"{site.module}.{site.attr} changed its signature: expected ({', '.join(site.params)}), "
                            f"found ({', '.join(found)}); the {site.kernel} adapter was written for the former")
