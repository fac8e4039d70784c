"""The decode route table (never slower): what it says matches the committed benchmark, a call takes the route its
shapes give, and the plugin's routed call sends it there with the real head count of the layer being run."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dsv4_cluster.kernels import decode_routes
from dsv4_cluster.kernels.decode_routes import route
from dsv4_cluster.kernels.sglang_plugin.install import Counters
from dsv4_cluster.kernels.sglang_plugin.routing import hook_backend_class, real_heads, routed_decode

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "sglang_decode.json"


def test_the_table_is_what_the_committed_benchmark_measured_on_triton_38():
    data = json.loads(RESULTS.read_text())
    assert data["versions"]["triton"].startswith("3.8"), data["versions"]
    assert decode_routes.routes_from_results(data["rows"]) == {
        k: v for k, v in decode_routes.ROUTES.items() if k[0] == "sm_90"}


def test_every_ours_row_measured_at_least_flashmla_and_every_stock_row_below():
    rows = [r for r in json.loads(RESULTS.read_text())["rows"] if r.get("bench") == "decode"]
    speed = {(r["layer"], r["real_heads"], r["B"], r["impl"]): r["speedup_vs_flashmla"] for r in rows}
    for (_, kind, heads), points in decode_routes.ROUTES.items():
        for b, r in points:
            told = (kind, heads, b, "adapter_h16" if heads == 16 else "adapter")
            all_heads = (kind, 64, b, "adapter")  # the call computing all 64 heads (the same at 16 real)
            if r == "stock":
                assert speed[told] < 1.0 and speed[all_heads] < 1.0
            else:
                assert speed[all_heads if r == "ours_all_heads" else told] >= 1.0


# 16-head rows with all three routes (the committed table has them ours at every measured B): the routing mechanics
MIXED_16 = {("sm_90", "window", 16): ((1, "ours"), (8, "ours"), (32, "stock"), (64, "ours_all_heads"), (128, "ours"),
                                      (256, "ours")),
            ("sm_90", "c4", 16): ((1, "ours"), (8, "ours"), (32, "ours"), (64, "ours"), (128, "stock"), (256, "stock"))}


@pytest.fixture
def mixed_16(monkeypatch):
    for key, points in MIXED_16.items():
        monkeypatch.setitem(decode_routes.ROUTES, key, points)


@pytest.mark.parametrize("kind, heads, batch, want", [
    ("c4", 64, 64, "ours"), ("c4", 64, 1, "stock"), ("c4", 64, 48, "stock"),  # between stock and ours: stock
    ("window", 64, 100, "ours"), ("window", 64, 512, "ours"), ("c4", 64, 512, "stock"),  # past the largest
    ("c4", 16, 1, "ours"), ("c128", 16, 48, "ours"), ("c4", 16, 128, "ours"), ("c128", 16, 512, "ours"),
])
def test_routes_between_and_past_measured_batches(kind, heads, batch, want):
    assert route("sm_90", kind, heads, batch) == want


@pytest.mark.parametrize("kind, batch, want", [
    ("window", 64, "ours_all_heads"), ("c4", 48, "ours"),  # a measured all-heads point; between two ours
    ("window", 200, "ours"), ("window", 48, "stock"), ("window", 100, "stock"),  # ours / ours_all_heads: stock
    ("c4", 128, "stock"),
])
def test_routes_of_a_table_with_every_route(mixed_16, kind, batch, want):
    assert route("sm_90", kind, 16, batch) == want


def test_classes_without_measurements_stay_stock_and_sm120_runs_ours():
    assert route("sm_100", "c4", 64, 64) == "stock"
    assert route("sm_120", "window", 16, 1) == "ours"
    assert "stock elsewhere" in decode_routes.describe("sm_90")["window / 64 heads"]


def test_layer_kind_from_the_extra_cache_page():
    assert decode_routes.layer_kind(None) == "window"
    assert decode_routes.layer_kind(torch.empty(3, 64, 1, 584, dtype=torch.uint8)) == "c4"
    assert decode_routes.layer_kind(torch.empty(3, 2, 1, 584, dtype=torch.uint8)) == "c128"


class _Backend:
    """The shape of SGLang's DeepseekV4AttnBackend the hooks rely on: the partial bound in __init__, and
    `_forward_attention(q, k, v, layer, ...)` calling it."""

    def __init__(self, stock):
        self._flash_mla_with_kvcache = functools.partial(stock, use_legacy=True)

    def _forward_attention(self, q, k, v, layer, forward_batch=None, **_):
        return self._flash_mla_with_kvcache(q=q, k_cache=k, extra_k_cache=v)


def test_routed_call_runs_stock_or_ours_with_the_layers_real_heads(mixed_16):
    calls = []

    def stock(**kw):
        calls.append(("stock", kw["use_legacy"], real_heads()))
        return "stock"

    def ours(*args, real_heads=None, **kw):
        calls.append(("ours", kw["use_legacy"], real_heads))
        return "ours"

    counters = Counters("cpu")

    class Backend(_Backend):
        pass

    assert hook_backend_class(Backend, lambda b: setattr(b, "_flash_mla_with_kvcache", routed_decode(
        b._flash_mla_with_kvcache, ours, "sm_90", counters)))
    assert not hook_backend_class(Backend, lambda b: None)  # once per class
    b = Backend(stock)  # hooked __init__: routed like a draft step backend SGLang builds directly
    c4 = torch.empty(2, 64, 1, 584, dtype=torch.uint8)
    layer16 = SimpleNamespace(tp_q_head_num=16)
    q = lambda batch: torch.empty(batch, 1, 64, 512)  # noqa: E731
    assert b._forward_attention(q(1), None, c4, layer16) == "ours"  # c4, 16 real heads, B = 1: ours at 16
    assert b._forward_attention(q(128), None, c4, layer16) == "stock"
    assert b._forward_attention(q(64), None, None, layer16) == "ours"  # window at 16, B = 64: all 64 heads
    assert b._forward_attention(q(64), None, c4, SimpleNamespace(tp_q_head_num=64)) == "ours"
    assert calls == [("ours", True, 16), ("stock", True, 16), ("ours", True, None), ("ours", True, None)]
    assert real_heads() is None  # only while a layer runs
    counts = dict(zip(Counters.NAMES, counters.values.tolist()))
    assert (counts["sparse_mla_decode"], counts["sparse_mla_decode_stock"]) == (3, 1)


def test_only_the_first_layer_of_each_kind_counts_its_calls(mixed_16):
    """A count is one more node in a captured graph (~1 us a call): per step, one count per layer kind, by the
    lowest layer id of the kind; both routes (ours, stock) count that way, and a call without a layer always counts."""
    counters = Counters("cpu")

    class Backend(_Backend):
        pass

    hook_backend_class(Backend, lambda b: setattr(b, "_flash_mla_with_kvcache", routed_decode(
        b._flash_mla_with_kvcache, lambda *a, **kw: "ours", "sm_90", counters)))
    b = Backend(lambda **kw: "stock")
    c4 = torch.empty(2, 64, 1, 584, dtype=torch.uint8)
    q = torch.empty(1, 1, 64, 512)
    layer = lambda i: SimpleNamespace(tp_q_head_num=16, layer_id=i)  # noqa: E731
    for _step in range(3):  # window layers 0, 1; ratio-4 layers 2, 4 (B = 1, 16 heads: ours); B = 128 ratio 4: stock
        assert [b._forward_attention(q, None, v, layer(i)) for i, v in ((0, None), (1, None), (2, c4), (4, c4))] \
            == ["ours"] * 4
        assert b._forward_attention(torch.empty(128, 1, 64, 512), None, c4, layer(2)) == "stock"
        assert b._forward_attention(torch.empty(128, 1, 64, 512), None, c4, layer(4)) == "stock"
    counts = dict(zip(Counters.NAMES, counters.values.tolist()))
    assert (counts["sparse_mla_decode"], counts["sparse_mla_decode_stock"]) == (6, 3)
    b._forward_attention(q, None, c4, SimpleNamespace(tp_q_head_num=16))  # no layer id: counted
    assert counters.values.tolist()[Counters.NAMES.index("sparse_mla_decode")] == 7


def test_a_build_without_the_measured_gluon_kernels_runs_every_measured_call_stock(monkeypatch):
    """ROUTES' "ours" is the Gluon kernels'; on a Triton release they were not written for, the Triton kernels would
    run in their place (measured slower than FlashMLA at most of those calls): every sm_90 call stays stock, and the
    attestation's description says why. sm_120 (measured against SGLang's Triton kernel) is unaffected."""
    assert decode_routes.unmeasured_build() is None  # CI's pinned Triton: the measured kernels
    assert route("sm_90", "c4", 16, 1) == "ours"
    monkeypatch.setattr(decode_routes, "unmeasured_build", lambda: "this is Triton 3.9.0")
    assert {route("sm_90", k, h, b) for k in decode_routes.KINDS for h in (16, 64) for b in (1, 64, 256)} == {"stock"}
    assert route("sm_120", "c4", 16, 1) == "ours"
    assert "Triton 3.9.0" in decode_routes.describe("sm_90")["all calls"]
