"""Output-token logprobs: the sampler's math against torch.log_softmax, the request limits, and a real prefill +
decode pair (processes, KV over NIXL) behind the router, asked through the official `openai` client and SGLang's
`/generate`: the first token's logprob (sampled on the prefill) reaches the client and is the true one (equal to a
single-process run), logprobs are <= 0, top alternatives sorted with exactly N entries, the chosen token's logprob is
its entry among them, greedy picks the top-1, stream and non-stream agree, and too many alternatives get a 400."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch
from pydantic import ValidationError

from dsv4_cluster.request_schema import MAX_TOP_LOGPROBS
from dsv4_cluster.router.app import build_app
from dsv4_cluster.router.settings import RouterSettings
from tests.servers import UvicornThread
from tests.worker_procs import start_pair, stop_pair
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.http.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from dsv4_cluster.workers.engine.runner import ModelRunner, RunnerConfig
from dsv4_cluster.workers.engine.sampling import Sampler, SamplingParams, TokenLogprob
from dsv4_cluster.workers.engine.tokenizer import EOS, PRINTABLE_IDS, VOCAB_SIZE, ByteTokenizer

TOK = ByteTokenizer()
MESSAGES = [{"role": "user", "content": "Say something about pages"}]


# -- the sampler's math ------------------------------------------------------------------------------------------

def _reference(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """torch.log_softmax over the printable ids and EOS (the sampler's vocabulary), the rest -inf."""
    allowed = torch.tensor(PRINTABLE_IDS)
    out = torch.full((VOCAB_SIZE,), float("-inf"), dtype=torch.float64)
    scaled = logits.double()[allowed] / (temperature if temperature > 0 else 1.0)
    out[allowed] = torch.log_softmax(scaled, dim=-1)
    return out


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampler_logprobs_are_log_softmax_of_what_it_sampled_from(temperature, top_p):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(VOCAB_SIZE, generator=gen) * 4
    logits[77] = logits[78] = logits.max() + 1.0          # a tie at the top: the lower id comes first
    sampler = Sampler(VOCAB_SIZE)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=11, logprobs=True, top_logprobs=7)
    token = sampler.sample(logits, params, 0)
    got = sampler.logprobs(logits, params, token)
    want = _reference(logits, temperature)
    assert got.logprob == pytest.approx(want[token].item(), abs=1e-12) and got.logprob <= 0
    assert [i for i, _ in got.top] == torch.sort(want, descending=True, stable=True).indices[:7].tolist()
    assert [lp for _, lp in got.top] == pytest.approx(sorted(want.tolist(), reverse=True)[:7], abs=1e-12)
    assert got.top[0][0] == 77 and got.top[1][0] == 78
    if temperature == 0:
        assert token == got.top[0][0] == 77                 # greedy: the chosen token is the top-1 alternative
    if token in dict(got.top):
        assert dict(got.top)[token] == got.logprob
    batch = sampler.logprobs_batch(torch.stack([logits, logits]), [params, SamplingParams()], [token, token])
    assert batch == [got, None]                              # only the rows that asked


def test_logprobs_travel_prefill_to_decode_unchanged():
    lp = TokenLogprob(-0.123456789012345, ((5, -0.1), (6, -2.5000000001)))
    assert TokenLogprob.from_wire(json.loads(json.dumps(lp.to_wire()))) == lp


def test_too_many_alternatives_are_refused_naming_the_field_and_the_limit():
    over = MAX_TOP_LOGPROBS + 1
    with pytest.raises(ValueError, match=f"top_logprobs: .*{MAX_TOP_LOGPROBS}"):
        SamplingParams(logprobs=True, top_logprobs=over)
    cases = [(ChatCompletionRequest, {"messages": MESSAGES, "logprobs": True, "top_logprobs": over}, "top_logprobs"),
             (CompletionRequest, {"prompt": "x", "logprobs": over}, "logprobs"),
             (GenerateRequest, {"text": "x", "return_logprob": True, "top_logprobs_num": over}, "top_logprobs_num")]
    for model, body, field in cases:
        with pytest.raises(ValidationError) as err:
            model.model_validate(body)
        assert field in str(err.value) and str(MAX_TOP_LOGPROBS) in str(err.value)
    with pytest.raises(ValidationError, match="needs logprobs: true"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "top_logprobs": 2})


# -- through the router, 1 prefill + 1 decode ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_cluster(tmp_path_factory):
    """(pair, router): the router in front of a real prefill + decode pair (worker processes, KV over NIXL), not
    tests/router/conftest.py's `cluster` of fake workers: the logprobs must be the engine's own."""
    pair = start_pair(tmp_path_factory.mktemp("pair"))
    settings = RouterSettings(
        host="127.0.0.1", port=1, model_name="dsv4-tiny", request_timeout_s=120, health_check_interval_s=0.5,
        prefill=[{"name": "prefill-0", "url": pair.prefill_url, "bootstrap_host": "127.0.0.1",
                  "bootstrap_port": pair.bootstrap_port}],
        decode=[{"name": "decode-0", "url": pair.decode_url}])
    try:
        with UvicornThread(build_app(settings)) as router:
            yield pair, router
    finally:
        stop_pair(pair)


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _single_process(prompt_ids: list[int], n: int, top: int) -> list[tuple[int, TokenLogprob]]:
    """Greedy tokens and their logprobs from one process (prefill then decode, no KV transfer)."""
    runner = ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=4096, context_length=1024))
    params = SamplingParams(max_new_tokens=n, temperature=0, logprobs=True, top_logprobs=top)
    pages = runner.pool.alloc(len(prompt_ids) + n)
    logits, out = runner.prefill(prompt_ids, pages), []
    for step in range(n):
        token = runner.sampler.sample(logits, params, step)
        out.append((token, runner.sampler.logprobs(logits, params, token)))
        logits = runner.decode([token], [len(prompt_ids) + step], [pages])[0]
    return out


def _check_chat_entries(content, n_top: int, greedy: bool) -> None:
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(TOK.token_bytes(TOK_IDS[entry.token]))
        assert len(entry.top_logprobs) == n_top
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        mine = [t.logprob for t in entry.top_logprobs if t.token == entry.token]
        assert mine in ([], [entry.logprob])           # the chosen token's entry, when among them, is its logprob
        if greedy:
            assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob


TOK_IDS = {TOK.token_text(i): i for i in PRINTABLE_IDS}


def _streamed_chat(chunks) -> list:
    return [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]


def _same_entries(got: list, want: list) -> None:
    """Same tokens and alternatives, logprobs equal to float32 rounding: the later request reuses the earlier one's
    prompt pages from the prefill's prefix cache, which computes the rest of the prompt in another chunk."""
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in got] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in want]
    flat = [v for e in got for v in (e.logprob, *(t.logprob for t in e.top_logprobs))]
    assert flat == pytest.approx([v for e in want for v in (e.logprob, *(t.logprob for t in e.top_logprobs))],
                                 abs=1e-5)


def _text(tokens) -> str:
    """The output text the tokens make (EOS, which ignore_eos lets through, shows in logprobs, not in the text)."""
    return "".join(t for t in tokens if t != TOK.token_text(EOS))


@pytest.mark.slow
def test_chat_greedy_logprobs_are_the_true_ones_first_token_included(real_cluster):
    _, router = real_cluster
    client, n, top = _client(router), 8, 5
    args = dict(model="dsv4-tiny", messages=MESSAGES, max_tokens=n, temperature=0, logprobs=True, top_logprobs=top,
                extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    assert len(content) == n and _text(e.token for e in content) == reply.choices[0].message.content
    _check_chat_entries(content, top, greedy=True)
    expected = _single_process(TOK.apply_chat_template(MESSAGES), n, top)
    assert [TOK_IDS[e.token] for e in content] == [t for t, _ in expected]
    for entry, (_, want) in zip(content, expected):   # the first (sampled on the prefill) as much as the rest
        assert entry.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx([lp for _, lp in want.top], abs=1e-4)

    _same_entries(_streamed_chat(client.chat.completions.create(**args, stream=True)), content)

    plain = client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None                # not asked: none


@pytest.mark.slow
def test_chat_seeded_sampling_stream_and_non_stream_agree(real_cluster):
    _, router = real_cluster
    client = _client(router)
    args = dict(model="dsv4-tiny", messages=MESSAGES, max_tokens=10, temperature=1.2, top_p=0.95, seed=7,
                logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**args)
    content = reply.choices[0].logprobs.content
    _check_chat_entries(content, 3, greedy=False)
    _same_entries(_streamed_chat(client.chat.completions.create(**args, stream=True)), content)
    first = client.chat.completions.create(**{**args, "top_logprobs": 0}).choices[0].logprobs.content
    assert [e.token for e in first] == [e.token for e in content] and first[0].top_logprobs == []
    assert [e.logprob for e in first] == pytest.approx([e.logprob for e in content], abs=1e-5)


@pytest.mark.slow
def test_legacy_completions_logprobs(real_cluster):
    _, router = real_cluster
    client = _client(router)
    args = dict(model="dsv4-tiny", prompt="The pages", max_tokens=6, temperature=0, logprobs=3,
                extra_body={"ignore_eos": True})
    reply = client.completions.create(**args)
    lp = reply.choices[0].logprobs
    assert _text(lp.tokens) == reply.choices[0].text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 3
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert next(iter(top)) == token and top[token] == value          # greedy: the top-1 is the chosen token
    streamed = list(client.completions.create(**args, stream=True))
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


@pytest.mark.slow
def test_generate_logprobs_in_sglang_shape(real_cluster):
    _, router = real_cluster
    body = {"text": "The pages", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 4, "return_text_in_logprobs": True}
    answer = httpx.post(router.url + "/generate", json=body, timeout=120).json()
    meta = answer["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == answer["output_ids"] and meta["output_token_logprobs_length"] == 5
    assert _text(t[2] for t in triples) == answer["text"] and all(t[0] <= 0 for t in triples)
    for (value, token, _), top in zip(triples, meta["output_top_logprobs"]):
        assert len(top) == 4 and [t[0] for t in top] == sorted((t[0] for t in top), reverse=True)
        assert top[0][:2] == [value, token]
    without_text = httpx.post(router.url + "/generate", json={**body, "return_text_in_logprobs": False,
                                                               "top_logprobs_num": 0}, timeout=120).json()
    assert [t[:2] for t in without_text["meta_info"]["output_token_logprobs"]] == [t[:2] for t in triples]
    assert all(t[2] is None for t in without_text["meta_info"]["output_token_logprobs"])
    assert "output_top_logprobs" not in without_text["meta_info"]
    with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    last = events[-1]["meta_info"]["output_token_logprobs"]                # cumulative, as SGLang streams it
    assert [t[1:] for t in last] == [t[1:] for t in triples]
    assert [t[0] for t in last] == pytest.approx([t[0] for t in triples], abs=1e-5)


@pytest.mark.slow
def test_over_the_limit_is_a_400_naming_the_field_and_limit(real_cluster):
    pair, router = real_cluster
    client, over = _client(router), MAX_TOP_LOGPROBS + 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="dsv4-tiny", messages=MESSAGES, logprobs=True, top_logprobs=over)
    assert "top_logprobs" in str(err.value) and str(MAX_TOP_LOGPROBS) in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="dsv4-tiny", prompt="x", logprobs=over)
    assert "logprobs" in str(err.value) and str(MAX_TOP_LOGPROBS) in str(err.value)
    r = httpx.post(router.url + "/generate", json={"text": "x", "return_logprob": True, "top_logprobs_num": over})
    assert r.status_code == 400 and "top_logprobs_num" in r.text and str(MAX_TOP_LOGPROBS) in r.text
    # a worker asked directly (as SGLang's own router would) says the same
    r = httpx.post(pair.decode_url + "/v1/chat/completions",
                   json={"messages": MESSAGES, "logprobs": True, "top_logprobs": over, **pair.bootstrap(1, "x")})
    assert r.status_code == 400 and "top_logprobs" in r.text and str(MAX_TOP_LOGPROBS) in r.text
