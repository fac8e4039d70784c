"""SGLang 0.5.23's own DeepSeek-V4 decode backend on the CPU: its metadata builders feeding our adapters (CI).

An interpreter per mode (`python -c CHILD`, forked from one that imported SGLang: tests/zygote.py;
TRITON_INTERPRET=1 for SGLang's Triton metadata kernels)
stands up SGLang's backend, pool and decode metadata through bench/sglang_backend_rig.py (the stand-ins are
in bench/sglang_stand_ins.py, each installer says why; on the CPU also FlashMLA, which is CUDA-only) and runs one window-only, one
ratio-4 and one ratio-128 layer of DeepSeek-V4-Flash at TP4 for 2 requests of 4,096 live tokens:
- plugin: `load_plugins()` installs our kernels through the entry point; SGLang's forward_c4_indexer and forward
  call our adapters (their CPU references) with SGLang's metadata;
- stock: SGLang's own indexer + top-k fallbacks (`fp8_paged_mqa_logits_torch`, `topk_transform_pytorch_vectorized`).
Checked: SGLang's window / ratio-128 index lists are the slots this batch wrote (the rig's ground truth), the
ratio-4 top-512 sets of both modes are equal, and the plugin's three outputs are finite and non-zero.
Never skipped with CI=true (tests/sglang_support.require_sglang).
"""

from __future__ import annotations

import pytest

from tests.sglang_support import child_result, require_sglang, start_child
from tests.zygote import Started

require_sglang()

LIVE, BATCH = 4096, 2
TOPK_SWAPS = 4  # of 512 (see the top-k test)
CHILD = f"""
import json, sys, torch
from bench import sglang_backend_rig as rig
mode = sys.argv[1]
factory = rig.prepare(mode, "cpu")
r, fb, inputs = rig.cpu_case(mode, {BATCH}, {LIVE})
keep, outs = [], []
same = None
if mode == "plugin":
    from bench.sglang_backend import _beside_flashmla
    outs, same = _beside_flashmla(r, lambda: rig.run_layers(r, fb, inputs, keep))
    same["restored"] = r.backend._flash_mla_with_kvcache.__name__
else:
    x = inputs[0]["q"][:, :1, :1]
    r.backend.forward_c4_indexer(x=x, q_lora=x, c4_indexer=inputs[1]["indexer"], forward_batch=fb, skip_compressor=True)
    keep.append(r.backend.forward_metadata.core_metadata.c4_sparse_page_indices.clone())
m = r.backend.forward_metadata.core_metadata
out = dict(factory=factory, ratios=[ratio for _, ratio in r.layers], topk=keep[0].tolist(),
           window=m.swa_page_indices.tolist(), window_len=m.swa_topk_lengths.tolist(),
           c128=m.sparse_page_indices(128)[:, 0].tolist() if m.sparse_page_indices(128).dim() == 3
           else m.sparse_page_indices(128).tolist(), c128_len=m.sparse_topk_lengths(128).tolist(),
           outs=[dict(shape=list(o.shape), finite=bool(torch.isfinite(o.float()).all()),
                      mean_abs=o.float().abs().mean().item()) for o in outs],
           req_slots=[r.req_to_token_pool.req_to_token[i + 1, :{LIVE}].tolist() for i in range({BATCH})],
           same=same)
import gc, weakref
pool = weakref.ref(r.pool)
del r, fb, inputs, m
gc.collect()
out["rig_freed"] = pool() is None
print("RESULT " + json.dumps(out))
"""


def _start(mode: str, code: str = CHILD) -> Started:
    return start_child(*([mode] if mode != "paired" else []), code=code, env={"TRITON_INTERPRET": "1"})


@pytest.fixture(scope="module")
def runs():
    """Both modes' children run side by side (each a process of its own: the plugin's replacements are
    process-wide)."""
    children = {mode: _start(mode) for mode in ("stock", "plugin")}
    return {mode: child_result(child, timeout_s=600) for mode, child in children.items()}


def test_load_plugins_wraps_the_dsv4_factory_only_in_plugin_mode(runs):
    assert runs["plugin"]["factory"] == ["create_dsv4_backend_with_dsv4_cluster_kernels"]
    assert runs["stock"]["factory"] != runs["plugin"]["factory"]
    assert runs["plugin"]["ratios"] == [0, 4, 128]


def test_sglang_window_and_ratio128_lists_are_the_slots_this_batch_wrote(runs):
    p = runs["plugin"]
    for r in range(BATCH):
        slots = p["req_slots"][r]
        assert p["window_len"][r] == 128
        assert sorted(p["window"][r][:128]) == sorted(slots[LIVE - 128:])
        entries = LIVE // 128
        assert p["c128_len"][r] == entries
        pages = {s // 256 for s in slots}
        c128 = p["c128"][r][:entries]
        assert len(set(c128)) == entries and {s // 2 for s in c128} <= pages  # 2 entries per 256-token page


def test_topk_sets_of_plugin_equal_sglang_fallback_up_to_boundary_ties(runs):
    """SGLang's torch fallback scores in bf16 (fp8 keys and q cast to bf16, bf16 bmm), ours in fp32: entries
    within bf16 rounding of the 512th score may swap (seen here: one pair in one row). TOPK_SWAPS bounds it."""
    for r in range(BATCH):
        stock = set(runs["stock"]["topk"][r]) - {-1}
        plugin = set(runs["plugin"]["topk"][r]) - {-1}
        assert len(stock) == len(plugin) == 512 and len(stock - plugin) <= TOPK_SWAPS, (r, len(stock - plugin))


def test_the_flashmla_cross_check_wraps_one_decode_call_per_layer(runs):
    """The device bench runs FlashMLA beside our kernel on SGLang's arguments (bench/sglang_backend.py
    `_beside_flashmla`); here FlashMLA cannot run, so each layer kind records that error, and the backend holds
    the plugin's call again afterwards."""
    same = runs["plugin"]["same"]
    assert set(same) == {"window", "ratio4", "ratio128", "restored"}, same
    for kind in ("window", "ratio4", "ratio128"):
        assert "FlashMLA cannot run here" in same[kind]["error"], same
    assert same["restored"] == "flash_mla_with_kvcache_routed", same  # the plugin's routed call again


def test_a_dropped_rig_frees_its_pool(runs):
    """The device bench builds one rig per configured context in one process: a rig nothing references
    must be freed (SGLang's module-level ImportError once held the first rig's frame and pool)."""
    assert runs["stock"]["rig_freed"] and runs["plugin"]["rig_freed"]


def test_plugin_outputs_are_finite(runs):
    for o in runs["plugin"]["outs"]:
        assert o["shape"] == [BATCH, 16, 512] and o["finite"] and o["mean_abs"] > 0, o


PAIRED_CHILD = f"""
import json
from bench import sglang_backend_rig as rig
from bench.sglang_backend import eager_step
from bench.sglang_backend_growth import output_spread, paired_rigs
rig.prepare("plugin", "cpu")
rigs = paired_rigs([8192, 16384], {BATCH}, {LIVE}, "cpu", [0, 2, 3])
outs, widths = {{}}, {{}}
for context, r in rigs.items():
    fb, inputs = rig.decode_batch(r, {BATCH}, {LIVE}), rig.layer_inputs(r, {BATCH})
    outs[context] = eager_step(r, fb, inputs)
    widths[context] = [r.req_to_token_pool.req_to_token.shape[1],
                       r.backend.forward_metadata.core_metadata.sparse_page_indices(128).shape[-1]]
print("RESULT " + json.dumps(dict(spread=output_spread(outs), shared=rigs[8192].pool is rigs[16384].pool,
                                  widths=widths, layers=len(outs[8192]))))
"""


def test_paired_rigs_share_one_pool_and_agree_whatever_the_configured_context():
    """`bench.sglang_backend paired` times 8K and a wider configured context in the same rounds over one pool: the
    rigs share the pool's rows, differ in the req-to-token width and the ratio-128 list's width, and, holding the
    same requests and queries, return the same outputs (16K: the ratio-128 list is 128 slots, so SGLang's
    metadata builder there is ours, not SGLang's one-chunk walk)."""
    got = child_result(_start("paired", PAIRED_CHILD), timeout_s=600)
    assert got["shared"] and got["layers"] == 3
    (r8, w8), (r16, w16) = got["widths"]["8192"], got["widths"]["16384"]
    assert (r8, r16) == (8192, 16384) and w16 > w8, got["widths"]
    assert got["spread"] < 1e-6, got["spread"]
