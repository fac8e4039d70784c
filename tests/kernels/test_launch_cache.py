"""launch_cache: keys, recording a launch plan (on the GPU when there is one, else in the Triton interpreter),
replaying it with new addresses, what is refused, and that the adapters check a call once per shape class and
every new class again (CPU reference path)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from dsv4_cluster.kernels import fast_launch
from dsv4_cluster.kernels.launch_cache import LaunchCache, signature
from dsv4_cluster.kernels.sglang_adapters import (AdapterCallError, flash_mla_with_kvcache, fp8_paged_mqa_logits,
                                                  topk_transform_paged_v2)
from dsv4_cluster.kernels.sglang_adapters import flash_mla as flash_mla_mod
from dsv4_cluster.kernels.sglang_adapters import indexer as indexer_mod
from dsv4_cluster.kernels.sglang_adapters import topk as topk_mod
from dsv4_cluster.kernels.sglang_cases import decode_case, indexer_case
from dsv4_cluster.kernels.workspace import scratch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _axpy_kernel(x_ptr, ws_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m)
    w = tl.load(ws_ptr + i, mask=m)
    tl.store(out_ptr + i, x * 2 + w, mask=m)


def _step(x: torch.Tensor, out: torch.Tensor):
    """What an adapter does: a view of an input at an offset, a zeroed scratch workspace, one launch."""
    ws = scratch("test.ws", 8, torch.float32, x.device)
    ws.zero_()
    fast_launch.launch(_axpy_kernel, (1,), (x[4:], ws, out, 8), dict(BLOCK=8))
    return ws


def _record(cache, x, out, body=_step):
    key, ptrs = signature((x, out), ("axpy",))
    with cache.recording(key, ptrs, (x, out), {}):
        body(x, out)
    return key


def test_signature_keys_shape_stride_dtype_device_and_scalars_not_addresses():
    a = torch.zeros(4, 8)
    key, ptrs = signature((a, None), (1,))
    assert ptrs == [a.data_ptr(), 0]
    assert signature((torch.ones(4, 8), None), (1,))[0] == key  # another address, same class
    for other in (torch.zeros(4, 9), torch.zeros(8, 4).t(), torch.zeros(4, 8, dtype=torch.float64)):
        assert signature((other, None), (1,))[0] != key
    assert signature((a, a), (1,))[0] != key  # a tensor where there was None
    assert signature((a, None), (2,))[0] != key


def test_a_recorded_plan_replays_launch_and_memset_with_new_addresses():
    cache = LaunchCache("test")
    x, out = torch.arange(12, dtype=torch.float32, device=DEV), torch.empty(8, device=DEV)
    key = _record(cache, x, out)
    assert torch.equal(out, x[4:] * 2)
    plan = cache.plans[key]
    assert plan.steps is not None and len(plan.steps) == 2  # the memset, the launch
    scratch("test.ws", 8, torch.float32, x.device).fill_(100.0)  # dirty the workspace: the replay must zero it
    x2, out2 = torch.arange(12, dtype=torch.float32, device=DEV) * 3, torch.full((8,), -1.0, device=DEV)
    key2, ptrs2 = signature((x2, out2), ("axpy",))
    assert key2 == key and cache.hit(key2, ptrs2) is plan
    plan.replay(ptrs2, (x2, out2))
    assert torch.equal(out2, x2[4:] * 2)
    assert torch.equal(x, torch.arange(12, dtype=torch.float32, device=DEV))  # the first call's tensors untouched


def test_a_plan_holds_its_scratch_but_none_of_the_recording_calls_tensors():
    """Eager batch churn: every shape class records a plan; the caller's tensors of that call (here 64 KB inputs
    and outputs each) must be freed when the caller drops them, or plans pin them until the cache resets."""
    import gc
    import weakref

    cache = LaunchCache("test")
    refs = []
    for n in range(16, 32):  # 16 shape classes, as batch sizes churn
        x, out = torch.arange(n * 1024, dtype=torch.float32, device=DEV), torch.empty(8, device=DEV)
        _record(cache, x, out)
        refs += [weakref.ref(x), weakref.ref(out)]
        del x, out
    gc.collect()
    pinned = sum(r() is not None for r in refs)
    assert len(cache.plans) == 16 and pinned == 0, f"{pinned} of the callers' tensors still held by plans"
    for plan in cache.plans.values():  # and every plan still replays into new tensors
        x2, out2 = torch.ones(12, device=DEV), torch.empty(8, device=DEV)
        _, ptrs = signature((x2, out2), ("axpy",))
        plan.replay(ptrs, (x2, out2))
        assert torch.equal(out2, torch.full((8,), 2.0, device=DEV))


def test_work_other_than_launches_and_memsets_is_not_cached():
    cache = LaunchCache("test")

    def body(x, out):
        _step(x, out)
        out.add_(1.0)  # device work the plan would not replay

    key = _record(cache, torch.zeros(12, device=DEV), torch.empty(8, device=DEV), body)
    assert key not in cache.plans
    assert any("aten.add_" in why for why in cache.uncached)


def test_an_argument_in_two_aliased_inputs_is_not_cached():
    cache = LaunchCache("test")
    x = torch.zeros(12, device=DEV)
    out = torch.empty(8, device=DEV)
    key, ptrs = signature((x, x[4:], out), ("alias",))
    with cache.recording(key, ptrs, (x, x[4:], out), {}):
        _step(x, out)  # x[4:] lies in both x and the second input
    assert key not in cache.plans and any("inputs" in why for why in cache.uncached)


def test_misaligned_addresses_are_not_cached():
    cache = LaunchCache("test")
    x = torch.zeros(13, device=DEV)[1:]  # 4 bytes past an aligned allocation
    key = _record(cache, x, torch.empty(8, device=DEV))
    assert key not in cache.plans and "an address not 16-byte aligned" in cache.uncached


def _counting(monkeypatch, module):
    calls = []
    real = module._check

    def check(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(module, "_check", check)
    module._PLANS.plans.clear()
    return calls


def test_flash_mla_adapter_checks_once_per_class_and_each_new_class(monkeypatch):
    calls = _counting(monkeypatch, flash_mla_mod)
    a = decode_case("c4", 2, 16, device="cpu", seed=1, window_tokens=512, extra_tokens=512)
    out1, lse1 = flash_mla_with_kvcache(tile_scheduler_metadata=None, **a)
    b = decode_case("c4", 2, 16, device="cpu", seed=2, window_tokens=512, extra_tokens=512)
    out2, lse2 = flash_mla_with_kvcache(tile_scheduler_metadata=None, **b)
    assert len(calls) == 1  # the same class: checked once
    ref, ref_lse = flash_mla_mod.reference_decode(
        b["q"][:, 0], (b["k_cache"].view(torch.uint8), flash_mla_mod.cache_geometry(b["k_cache"], "k"),
                       b["indices"][:, 0], b["topk_length"]),
        (b["extra_k_cache"].view(torch.uint8), flash_mla_mod.cache_geometry(b["extra_k_cache"], "e"),
         b["extra_indices_in_kvcache"][:, 0], b["extra_topk_length"]), b["attn_sink"], b["softmax_scale"])
    assert torch.equal(out2[:, 0], ref) and torch.equal(lse2[:, :, 0], ref_lse)
    strided = dict(b, q=torch.empty(2, 1, 64, 1024, dtype=torch.bfloat16)[..., :512].copy_(b["q"]))
    flash_mla_with_kvcache(tile_scheduler_metadata=None, **strided)
    assert len(calls) == 2  # a new stride: checked again
    with pytest.raises(AdapterCallError, match="q must be bf16"):
        flash_mla_with_kvcache(tile_scheduler_metadata=None, **dict(b, q=b["q"].float()))
    with pytest.raises(AdapterCallError, match="head_dim_v"):
        flash_mla_with_kvcache(tile_scheduler_metadata=None, **dict(b, head_dim_v=256))
    assert len(calls) == 4


def test_indexer_and_topk_adapters_check_once_per_class(monkeypatch):
    ic = _counting(monkeypatch, indexer_mod)
    tc = _counting(monkeypatch, topk_mod)
    for seed in (1, 2):
        c = indexer_case(2, [100, 300], capacity=512, device="cpu", seed=seed)
        logits = fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"], c["lens2d"], c["table"], None, 400, False)
        assert logits.shape == (2, 400)
        out = torch.empty(2, 512, dtype=torch.int32)
        topk_transform_paged_v2(logits, c["lens"], c["table"], out, 64, None)
        assert (out[0] >= 0).sum() == 100 and (out[1] >= 0).sum() == 300
    assert len(ic) == 1 and len(tc) == 1
    with pytest.raises(AdapterCallError, match="weights must be float32"):
        fp8_paged_mqa_logits(c["q"], c["kv"], c["weights"].double(), c["lens2d"], c["table"], None, 400, False)
    with pytest.raises(AdapterCallError, match="seq_lens must be int32"):
        topk_transform_paged_v2(logits, c["lens"].long(), c["table"], out, 64, None)
    assert len(ic) == 2 and len(tc) == 2
