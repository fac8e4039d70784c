"""Unit tests of the embedded engine's parts: tokenizer, KV pool, model, sampling, request bodies."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.workers.args import parse_args
from dsv4_cluster.workers.kv.pool import KVPool, PoolExhausted, PoolLayout
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.http.protocol import ChatCompletionRequest, GenerateRequest
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig, generate_single_process
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import ASSISTANT, BOS, EOS, USER, ByteTokenizer, ChatTemplateError

TOK = ByteTokenizer()


def runner(max_total_tokens: int = 2048, page_size: int = 16) -> ModelRunner:
    return ModelRunner(RunnerConfig(model=ModelConfig(), page_size=page_size,
                                    max_total_tokens=max_total_tokens, context_length=1024))


def test_chat_template_and_round_trip():
    ids = TOK.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert ids[:2] == [BOS, USER] and ids[-1] == ASSISTANT
    assert TOK.decode(ids) == "héllo"
    with pytest.raises(ChatTemplateError, match="role"):
        TOK.apply_chat_template([{"role": "tool", "content": "x"}])


def test_pool_allocates_whole_pages_and_refuses_past_capacity():
    pool = KVPool(PoolLayout(page_size=16, num_pages=4, n_layers=1, head_dim=8, index_dim=4, ratio=4,
                             dtype="float32"))
    pages = pool.alloc(17)
    assert len(pages) == 2 and pool.used_tokens == 32 and pool.capacity_tokens == 64
    with pytest.raises(PoolExhausted):
        pool.alloc(33)
    pool.release(pages)
    assert pool.used_tokens == 0


def test_logits_do_not_depend_on_which_pages_hold_the_kv():
    """The property a KV transfer relies on: the same prompt in other physical pages decodes the same."""
    r = runner()
    prompt = TOK.encode("page placement must not matter " * 3)
    a = r.pool.alloc(len(prompt) + 1)
    first = r.prefill(prompt, a)
    filler = r.pool.alloc(64)          # shift the next allocation to other pages
    b = r.pool.alloc(len(prompt) + 1)
    assert set(a).isdisjoint(b)
    second = r.prefill(prompt, b)
    assert torch.equal(first, second)
    r.pool.release(a + b + filler)


def test_greedy_generation_is_deterministic_and_stops():
    r = runner()
    params = SamplingParams(max_new_tokens=24, temperature=0)
    prompt = TOK.encode("determinism")
    out1 = generate_single_process(r, prompt, params, EOS)
    out2 = generate_single_process(r, prompt, params, EOS)
    assert out1 == out2 and 1 <= len(out1) <= 24
    assert all(32 <= t < 127 or t == EOS for t in out1)
    assert r.pool.used_tokens == 0


def test_seeded_sampling_is_reproducible():
    r = runner()
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7)
    prompt = TOK.encode("seeded")
    assert generate_single_process(r, prompt, params, EOS) == \
        generate_single_process(r, prompt, params, EOS)


def test_request_bodies_reject_what_the_engine_cannot_do():
    with pytest.raises(ValueError, match="n: 2 is not supported"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "n": 2})
    with pytest.raises(ValueError, match="unexpected_field"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "unexpected_field": 1})
    with pytest.raises(ValueError, match="exactly one of text or input_ids"):
        GenerateRequest.model_validate({"sampling_params": {}})



def test_a_pool_whose_whole_pages_hold_less_than_the_context_is_refused_at_start(capsys):
    """The pool is max_total_tokens // page_size whole pages: 1030 tokens in 16-token pages hold 1024, so a request
    of the full 1030-token context could never be reserved and its decode leg waited forever."""
    with pytest.raises(SystemExit):
        parse_args("decode", ["--max-total-tokens", "1030", "--context-length", "1030"])
    assert "whole pages of 16 tokens hold 1024" in capsys.readouterr().err
    assert parse_args("decode", ["--max-total-tokens", "1040", "--context-length", "1030"]).max_total_tokens == 1040

def test_worker_args_refuse_silent_fallbacks(capsys):
    with pytest.raises(SystemExit):
        parse_args("decode", ["--transfer-backend", "tcp"])
    assert "no silent fallback" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            parse_args("decode", ["--device", "cuda"])
        assert "no CUDA device torch can use; use --device cpu" in capsys.readouterr().err
    for bad in ("cuda:x", "cpu:0", "gpu"):
        with pytest.raises(SystemExit):
            parse_args("decode", ["--device", bad])
        assert f"--device {bad!r}: the embedded engine runs on cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--device", f"cuda:{torch.cuda.device_count()}"])   # one past the last GPU
    err = capsys.readouterr().err
    assert ("sees" if torch.cuda.is_available() else "no CUDA device") in err, err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--device", "cuda", "--kernels", "sparse_mla_decode"])
    assert "the 'tiny' preset's shapes (8 heads x 64 dims) are not what the kernels take" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--model-preset", "huge"])
    assert "--model-preset 'huge': choose from tiny, flash" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--kv-cache-dtype", "bfloat16"])
    assert "on the CPU the engine keeps float32 rows (or fp8_e4m3); use auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--kv-cache-dtype", "fp8_e4m3"])
    assert "(the tiny preset): use --model-preset flash" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args("decode", ["--model-preset", "flash", "--page-size", "64"])
    assert "multiple of the compression ratio 128 of layer 1; SGLang runs DeepSeek-V4 with 256" in capsys.readouterr().err
    assert parse_args("decode", ["--model-preset", "flash", "--page-size", "256", "--kv-cache-dtype",
                                 "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(SystemExit):
        parse_args("prefill", [])
    assert "--disaggregation-bootstrap-port is required" in capsys.readouterr().err


def test_after_a_non_ascii_prompt_the_model_writes_whole_multi_byte_characters():
    """One byte a token: a greedy run of this prompt writes characters of 2-4 bytes split across tokens, and every
    one whole (only the bytes that complete a character may follow its first); an ASCII prompt keeps ASCII."""
    r = runner()
    params = SamplingParams(max_new_tokens=120, temperature=0)
    out = generate_single_process(r, TOK.encode("1 résumé"), params, EOS)
    text = bytes(t for t in out if t < 256).decode("utf-8")   # strict: raises on a broken character
    assert any(len(c.encode()) > 1 for c in text), text
    assert all(t < 127 or t == EOS for t in generate_single_process(r, TOK.encode("1 resume"), params, EOS))


@pytest.mark.parametrize("gpu, heads, want, below", [
    ("sm_90", 64, ("gluon", "gluon"), None),              # the wgmma kernel takes both
    ("sm_90", 16, ("gluon_h16", "gluon_h16"),             # from B = 32 the 16-head wgmma kernel takes both;
     ("triton", "gluon_mma_v2")),                         # below, the mma.sync row (fp8 pages alone)
    ("sm_120", 64, ("triton", "gluon_mma_v2"), ("triton", "triton")),  # the mma.sync row from B = 8
    ("sm_100", 16, ("triton", "triton"), None),
    ("sm_90", 8, ("triton", "triton"), None),             # the engine's default model: no table row
])
def test_the_engine_labels_its_decode_calls_with_what_the_launch_picks(monkeypatch, gpu, heads, want, below):
    """`/server_info.kernel_calls` names the kernel that ran: fp8-page calls are counted under the backend the
    launch picks for fp8 (the mma.sync kernel where the class's row is it), not the float rows' fallback, and a
    batch under the row's min_batch under its fallback's. Checked without a GPU: the class is stood in for a CUDA
    device, the choice is the dispatch table's own."""
    from dsv4_cluster.kernels import dispatch
    from dsv4_cluster.kernels.sparse_mla_decode import config
    from dsv4_cluster.kernels.sparse_mla_decode.plan import _min_batch
    from dsv4_cluster.workers.engine.kernel_ops import IMPLS, decode_impls

    monkeypatch.setattr(dispatch, "gpu_class", lambda index: gpu)
    monkeypatch.setattr(config, "gluon_api_unavailable", lambda: None)  # the release the Gluon kernels were built for
    config._choose.cache_clear()
    try:
        cuda = torch.device("cuda", 0)
        assert decode_impls(cuda, heads, torch.bfloat16) == want
        assert (_min_batch(cuda, heads) > 1) == (below is not None)
        if below is not None:
            assert decode_impls(cuda, heads, torch.bfloat16, below_min_batch=True) == below
    finally:
        config._choose.cache_clear()
    assert set(want) <= set(IMPLS)
