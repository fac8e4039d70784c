"""The flash preset's ratio-128 layers and SGLang's fp8 584-B KV layout, on the CPU reference ops.

Flash-shaped models (512-dim heads of 448 + 64 RoPE dims, window 128, top-512, indexer 64 x 128) made narrow for
a 2-core CPU: 2 layers (ratio 4 then ratio 128, V4-Flash's alternation), 16 heads, d_model 256, 128-token pages.
"""

from __future__ import annotations


import pytest
import torch

from dsv4_cluster.kernels.indexer.fp8_keys import dequantize_keys, quantize_keys
from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import dequantize_kv_v4, quantize_kv_v4
from dsv4_cluster.workers.kv import fp8 as kv_fp8
from dsv4_cluster.workers.kv.layout import rows_page_bytes
from dsv4_cluster.workers.kv.pool import KVPool, PoolLayout, PoolLayoutError
from dsv4_cluster.workers.engine.model import Batch
from dsv4_cluster.workers.engine.presets import KVDtypeError, kv_layout_dtype, model_config
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS
from tests.helpers import wait_for

PAGE = 128
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _cfg():
    return model_config("flash", seed=5, n_layers=2, d_model=256, ffn_dim=256, n_heads=16)


def _runner(kv_dtype: str = "fp8_e4m3", pages: int = 16) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=_cfg(), page_size=PAGE, max_total_tokens=pages * PAGE,
                                    context_length=pages * PAGE, kv_dtype=kv_dtype))


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + salt) % 250 + 3 for i in range(n)]


def test_fp8_pool_holds_sglangs_bytes_and_reads_them_back_exactly():
    layout = PoolLayout(page_size=PAGE, num_pages=3, n_layers=2, head_dim=512, index_dim=128, ratio=4,
                        dtype="fp8_e4m3", layer_ratios=(4, 128))
    pool = KVPool(layout)
    assert pool.index_keys[1] is None and len(pool.buffers()) == 5            # no indexer on the ratio-128 layer
    # per page: 128 token records (74,880 B padded), 32 ratio-4 entries (19,008), their 32 keys of 132 B; the
    # ratio-128 layer's 128 token records and 1 entry (584 B padded to 1,152)
    assert pool.page_bytes == layout.page_bytes == 74880 + 19008 + 32 * 132 + 74880 + 1152
    g = torch.Generator().manual_seed(0)
    values = torch.randn(PAGE, 512, generator=g) * 3
    rows = torch.arange(PAGE, 2 * PAGE)                                       # every token of page 1
    pool.write_main(0, rows, values)
    assert torch.equal(pool.main[0][1], quantize_kv_v4(values, PAGE)[0])      # SGLang's page, byte for byte
    assert not pool.main[0][0].any() and not pool.main[0][2].any()
    exact_rows = dequantize_kv_v4(quantize_kv_v4(values, PAGE), PAGE)[[5, 0, 127]].float()
    assert torch.equal(pool.read_main(0, rows[[5, 0, 127]]), exact_rows)
    # a decode write without a host sync: only the rows whose group completed change
    entries = torch.tensor([0, 1, 2])                                         # ratio 128: one entry per page
    pool.write_comp(1, entries, values[:3], keep=torch.tensor([True, False, True]))
    got = kv_fp8.read_rows(pool.comp[1], 1, entries).float()
    exact = dequantize_kv_v4(quantize_kv_v4(values[:3], 1), 1).float()
    assert torch.equal(got[[0, 2]], exact[[0, 2]]) and not got[1].any()
    keys = torch.randn(32, 128, generator=g)
    pool.write_keys(0, torch.arange(64, 96), keys)                            # the 32 entries of page 2
    assert torch.equal(pool.index_keys[0][2], quantize_keys(keys[None])[0])
    assert torch.equal(kv_fp8.read_key_pages(pool.index_keys[0], 128, torch.tensor([2]))[0],
                       dequantize_keys(quantize_keys(keys[None]), 128)[0])


def test_fp8_and_page_size_refusals_name_the_fix():
    with pytest.raises(KVDtypeError, match="tiny preset"):
        kv_layout_dtype("fp8_e4m3", model_config("tiny"), "cpu")
    assert kv_layout_dtype("auto", _cfg(), "cpu") == "float32" and kv_layout_dtype("auto", _cfg(), "cuda") == "fp8_e4m3"
    assert kv_layout_dtype("auto", model_config("tiny"), "cuda") == "bfloat16"
    with pytest.raises(PoolLayoutError, match="multiple of the compression ratio 128 of layer 1; SGLang runs"):
        KVPool(RunnerConfig(model=_cfg(), page_size=64, max_total_tokens=256, context_length=256).layout())
    a, b = _runner().cfg.layout(), _runner("float32").cfg.layout()
    assert a.compatible(b) == ["dtype"]
    assert a.compatible(PoolLayout(**{**a.__dict__, "layer_ratios": [4, 4]})) == ["ratios"]
    assert a.compatible(PoolLayout(**{**a.__dict__, "layer_ratios": [4, 128]})) == []   # JSON gives lists


def _direct_dense(runner: ModelRunner, q: torch.Tensor, pos: int, pages: list[int]) -> torch.Tensor:
    """Layer 1's attention written out: the last 128 token rows up to `pos` and every complete ratio-128 entry,
    softmax with the head's sink as one more logit."""
    pool, p = runner.pool, runner.model.layers[1]
    tok = [t for t in range(pos - 127, pos + 1) if t >= 0]
    main = pool.read_main(1, torch.tensor([pages[t // PAGE] * PAGE + t % PAGE for t in tok])).float()
    comp = kv_fp8.read_rows(pool.comp[1], 1, torch.tensor([pages[e] for e in range((pos + 1) // 128)])).float()
    rows = torch.cat([main, comp])                                              # [R, 512], V = K
    s = torch.einsum("hd,rd->hr", q.float(), rows) / 512 ** 0.5
    w = torch.softmax(torch.cat([s, p["sink"][:, None]], dim=1), dim=1)[:, :-1]
    return w @ rows


def test_ratio_128_attention_is_window_plus_every_complete_entry():
    runner = _runner()
    prompt = _prompt(300)
    pages = runner.pool.alloc(400)
    runner.prefill(prompt, pages)                                              # fills rows and entries 0, 1
    table = torch.tensor([pages], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, 16, 512, generator=g)
    positions = torch.tensor([100, 255, 299])                                  # 0, 2 and 2 complete entries
    window = runner.model._window(Batch(tokens=positions, positions=positions, pages=table.expand(3, -1)), runner.pool)
    expected = torch.stack([_direct_dense(runner, q[i], int(t), pages) for i, t in enumerate(positions)])
    decode = Batch(tokens=positions, positions=positions, pages=table.expand(3, -1))
    sink = runner.model.layers[1]["sink"]
    got = runner.model._attend_dense(1, q, window, decode, runner.pool, sink)
    assert (got - expected).abs().max() < 1e-4
    chunk = Batch(tokens=positions, positions=positions, pages=table.expand(3, -1), segments=((0, 3),))
    assert (runner.model._attend_dense(1, q, window, chunk, runner.pool, sink) - expected).abs().max() < 1e-4
    # an entry list wider than the live count (a CUDA graph's): what lies past extra_lens is never read
    wide = torch.full((3, 64), 2 * len(runner.pool.comp[1]), dtype=torch.int32)   # no such row
    wide[:, :3] = torch.tensor(pages[:3], dtype=torch.int32)
    graphed = Batch(tokens=positions, positions=positions, pages=table.expand(3, -1), dense_entries=wide)
    assert (runner.model._attend_dense(1, q, window, graphed, runner.pool, sink) - expected).abs().max() < 1e-4
    runner.pool.release(pages)


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "float32"])
def test_prefill_then_decode_equals_one_forward_over_the_sequence(kv_dtype):
    """Decode crosses a ratio-128 boundary (position 255) and ratio-4 ones; its logits are those of one forward
    over the whole sequence (the same rows, written once, read by both)."""
    seq = _prompt(262, salt=4)
    split = 250
    stepwise = _runner(kv_dtype)
    pages = stepwise.pool.alloc(len(seq))
    logits = [stepwise.prefill(seq[:split], pages)]
    for t in range(split, len(seq) - 1):
        logits.append(stepwise.decode([seq[t]], [t], [pages])[0])
    whole = _runner(kv_dtype)
    wpages = whole.pool.alloc(len(seq))
    table = torch.tensor([wpages], dtype=torch.int32).expand(len(seq) - 1, -1)
    n = len(seq) - 1
    full = whole.model.forward(Batch(tokens=torch.tensor(seq[:n]), positions=torch.arange(n), pages=table,
                                     segments=((0, n),)), whole.pool)[split - 1:]
    got = torch.stack(logits)
    assert got.shape == full.shape
    assert (got - full).abs().max() < 2e-3, (got - full).abs().max()
    assert torch.equal(got.argmax(-1), full.argmax(-1))


def test_pd_over_nixl_with_fp8_mixed_ratio_pages_equals_a_single_process():
    """Real NIXL agents in one process: the prefill's fp8 pages of both layer kinds WRITten into the decode's
    pool (other page numbers), then decoded there, give the single-process greedy tokens."""
    from dsv4_cluster.workers.kv.transfer import NixlTransfer, TransferError

    prompt = _prompt(270, salt=9)
    expected = generate_single_process(_runner(), prompt, GREEDY, EOS)
    prefill, decode = _runner(), _runner()
    p_agent, d_agent = NixlTransfer("p-fp8", prefill.pool), NixlTransfer("d-fp8", decode.pool)
    with pytest.raises(TransferError, match=r"\['dtype'\]"):
        p_agent.add_peer(NixlTransfer("d-float", _runner("float32").pool).local_info())
    p_agent.add_peer(d_agent.local_info())
    budget = len(prompt) + GREEDY.max_new_tokens
    src = prefill.pool.alloc(budget)
    decode.pool.alloc(3 * PAGE)                                                 # other page numbers on D
    dst = decode.pool.alloc(budget)
    first = prefill.sampler.sample(prefill.prefill(prompt, src), GREEDY, 0)
    handle = p_agent.write_pages("d-fp8", src, dst, b"room-fp8")
    notifs: list[bytes] = []

    def written() -> str | None:   # both agents make progress only while polled
        notifs.extend(d_agent.notifications())
        return None if (state := p_agent.poll(handle)) == "PROC" else state
    assert wait_for(written, 30, "the fp8 pages' WRITE", interval_s=0.01) == "DONE"
    for layer in range(2):
        assert torch.equal(decode.pool.main[layer][dst], prefill.pool.main[layer][src])
        assert torch.equal(decode.pool.comp[layer][dst], prefill.pool.comp[layer][src])
    out = [first]
    while len(out) < GREEDY.max_new_tokens:
        logits = decode.decode([out[-1]], [len(prompt) + len(out) - 1], [dst])[0]
        out.append(decode.sampler.sample(logits, GREEDY, len(out)))
    assert out == expected


def test_graph_shaped_decode_equals_eager_decode(monkeypatch):
    """DecodeGraphs' static inputs on the CPU (capture needs CUDA; a replay is stood in for by the forward it
    would have captured): page tables and ratio-128 entry lists as wide as the configured context, holding an
    earlier, longer request's values past each row's own pages, and padding rows, decode as eager steps do."""
    from dsv4_cluster.workers.engine.decode_graphs import DecodeGraphs

    monkeypatch.setattr(DecodeGraphs, "_capture", lambda self: None)
    runner = _runner(pages=24)
    graphs = DecodeGraphs(runner.model, runner.pool, runner.max_pages, 4)
    assert graphs.dense.shape == (4, runner.max_pages)              # 1 ratio-128 entry per 128-token page

    class Replay:
        def __init__(self, bs):
            self.bs = bs

        def replay(self):
            graphs.logits[self.bs] = graphs._forward(self.bs)

    graphs.graphs = {bs: Replay(bs) for bs in graphs.sizes}
    prompts = [_prompt(n, salt=n) for n in (520, 270, 50)]
    pages = [runner.pool.alloc(len(p) + 2) for p in prompts]
    first = [runner.sampler.sample(runner.prefill(p, pg), GREEDY, 0) for p, pg in zip(prompts, pages)]
    graphs.run(first[:1], [len(prompts[0])], pages[:1])              # leaves 5 pages' values in row 0
    eager = runner.decode(first[1:], [len(p) for p in prompts[1:]], pages[1:])
    got = graphs.run(first[1:], [len(p) for p in prompts[1:]], pages[1:])
    assert torch.equal(graphs.dense[0, :3], torch.tensor(pages[1][:3], dtype=torch.int32))
    assert (got - eager).abs().max() < 1e-4
    three = graphs.run(first, [len(p) for p in prompts], pages)     # batch 3 replays size 4: one padding row
    assert three.shape[0] == 3 and (three[1:] - eager).abs().max() < 1e-4


def test_pool_reads_equal_the_layouts_slot_reader():
    from dsv4_cluster.kernels.sparse_mla_decode.fp8_layout import PageGeometry, gather_slots

    # a buffer of the pool's page-major region: its pages lie a region page apart, not a packed page apart
    region, (other, buf) = kv_fp8.page_major(3, [96, rows_page_bytes(4)], "cpu")
    assert buf.stride(0) == region.stride(0) > PageGeometry.packed(4).page_stride
    kv_fp8.write_rows(buf, 4, torch.arange(12), torch.randn(12, 512, generator=torch.Generator().manual_seed(2)))
    assert not other.any()                                           # the neighbouring buffer is untouched
    slots = torch.tensor([[11, 0, -1], [5, 4, 3]])
    assert torch.equal(kv_fp8.read_rows(buf, 4, slots), gather_slots(buf, kv_fp8.geometry(buf, 4), slots))
