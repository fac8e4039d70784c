"""The routed decode call the plugin binds on every DeepSeek-V4 backend instance, and the real head count.

SGLang binds `self._flash_mla_with_kvcache = functools.partial(flash_mla_with_kvcache, use_legacy=...)` in
`DeepseekV4AttnBackend.__init__`. The plugin replaces it with `routed_decode(stock, ...)`: per call, from shapes
only, `decode_routes.route` says ours or stock, and the call goes there (both counted on the device, so `verify` sees
which ran under graph replays too). The stock partial is kept and called unchanged: where ours is not measured
faster, SGLang's own kernel runs. A count is a device add, one more node in a captured graph (with every call on
FlashMLA, a 43-layer step through the routed call was 48 us, 4.5%, slower than through the bare partial at B = 8,
H200: ~1.1 us a node, if the counts are all of it), so only the first layer of each layer kind
counts its calls (the layer kind and its route are the same for every layer of the kind, in a step): counters
then rise once per step and kind, which is what `verify` reads. A call outside a hooked `_forward_attention` (no
layer id) is always counted.

Two class-level hooks (installed once per process, `hook_backend_class`):
- `_forward_attention` receives `layer`; SGLang itself reads the real head count there (`layer.tp_q_head_num`, 16
  at TP4 while q is padded to 64). The hook keeps it and `layer.layer_id` in a context variable for the duration of
  the call, and the routed decode passes the first on as `real_heads`.
- `__init__`: every instance gets the routed decode, also those SGLang builds without the backend registry
  (`DeepseekV4MultiStepBackend`'s per-step backends: the speculative draft's decode under MTP / EAGLE).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

from .. import decode_routes
from .attestation import STOCK_DECODE

# (real head count, layer id) of the layer whose `_forward_attention` is running
_LAYER: contextvars.ContextVar[tuple[int | None, int | None]] = contextvars.ContextVar("dsv4_layer",
                                                                                      default=(None, None))
HOOKED = "dsv4_cluster_hooked"


def real_heads() -> int | None:
    """The real head count of the layer whose `_forward_attention` is running (None outside one)."""
    return _LAYER.get()[0]


def routed_decode(stock: functools.partial, adapter: Callable[..., Any], gpu: str, counters: Any) -> Callable[..., Any]:
    """SGLang's decode partial with ours where the route table says so, `stock` everywhere else."""

    first_layer: dict[str, int] = {}  # layer kind -> the lowest layer id seen: the layer that counts its calls

    def flash_mla_with_kvcache_routed(*args: Any, **kwargs: Any) -> Any:
        q = kwargs["q"] if "q" in kwargs else args[0]
        heads = q.shape[-2]
        layer_heads, layer_id = _LAYER.get()
        real = min(layer_heads or heads, heads)
        kind = decode_routes.layer_kind(kwargs.get("extra_k_cache"))
        choice = decode_routes.route(gpu, kind, real, q.shape[0])
        if layer_id is not None:
            first_layer[kind] = min(first_layer.get(kind, layer_id), layer_id)
        if layer_id is None or layer_id == first_layer[kind]:
            counters.bump(STOCK_DECODE if choice == "stock" else "sparse_mla_decode")
        if choice == "stock":
            return stock(*args, **kwargs)
        told = real if choice == "ours" and real < heads else None
        return adapter(*args, real_heads=told, **dict(stock.keywords, **kwargs))

    flash_mla_with_kvcache_routed.dsv4_adapter = adapter  # type: ignore[attr-defined]
    flash_mla_with_kvcache_routed.dsv4_stock = stock  # type: ignore[attr-defined]
    return flash_mla_with_kvcache_routed


def hook_backend_class(cls: type, on_init: Callable[[Any], None]) -> bool:
    """Hook `cls` (SGLang's DeepseekV4AttnBackend) once: real heads per `_forward_attention`, `on_init(instance)`
    after every `__init__`. False when it was hooked already."""
    if getattr(cls, HOOKED, False):
        return False
    forward, init = cls._forward_attention, cls.__init__

    @functools.wraps(forward)
    def _forward_attention(self, q, k, v, layer, *args, **kwargs):
        token = _LAYER.set((getattr(layer, "tp_q_head_num", None), getattr(layer, "layer_id", None)))
        try:
            return forward(self, q, k, v, layer, *args, **kwargs)
        finally:
            _LAYER.reset(token)

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        on_init(self)

    cls._forward_attention, cls.__init__ = _forward_attention, __init__
    setattr(cls, HOOKED, True)
    return True
