"""Router parts on their own: the pairing policies, migration's reading of a stream's progress, and a worker's
own record (router/worker.py): whether it answers, and the requests it is part of, ended once when it is lost."""

from __future__ import annotations

from collections import Counter

from dsv4_cluster.core import Role, WorkerState
from dsv4_cluster.router.policies import Chooser
from dsv4_cluster.router.worker import Pair, Worker


def workers(*loads: float) -> list[Worker]:
    out = []
    for i, load in enumerate(loads):
        w = Worker(Role.DECODE, f"decode-{i}", f"http://127.0.0.1:{20000 + i}")
        w.in_flight, w.token_usage = int(load), load - int(load)
        out.append(w)
    return out


def test_round_robin_takes_each_in_turn() -> None:
    pool, chooser = workers(0, 0, 0), Chooser("round_robin")
    assert [chooser.choose(pool).name for _ in range(6)] == ["decode-0", "decode-1", "decode-2"] * 2


def test_least_load_adds_in_flight_and_token_usage_and_rotates_ties() -> None:
    pool, chooser = workers(2, 1.5, 1.2), Chooser("least_load")
    assert {chooser.choose(pool).name for _ in range(5)} == {"decode-2"}
    tied, chooser = workers(1, 1, 3), Chooser("least_load")
    assert Counter(chooser.choose(tied).name for _ in range(4)) == {"decode-0": 2, "decode-1": 2}


def test_power_of_two_never_takes_the_most_loaded_of_three() -> None:
    pool, chooser = workers(0, 1, 5), Chooser("power_of_two", seed=1)
    picks = Counter(chooser.choose(pool).name for _ in range(300))
    assert "decode-2" not in picks and picks["decode-0"] > picks["decode-1"] > 0


def test_random_spreads_over_all() -> None:
    pool, chooser = workers(0, 0, 9), Chooser("random", seed=2)
    picks = Counter(chooser.choose(pool).name for _ in range(300))
    assert set(picks) == {"decode-0", "decode-1", "decode-2"}


def test_migration_progress_folds_long_streams_the_same_as_whole() -> None:
    from dsv4_cluster.router.resume import Progress, progress

    events = [b'data: {"choices": [{"delta": {"content": "t%d "}, "token_ids": [%d]}]}\n\n' % (i, i)
              for i in range(600)]
    whole = progress("/v1/chat/completions", events)
    folded = Progress()
    for at in range(0, 600, 256):
        folded = progress("/v1/chat/completions", events[at:at + 256], folded)
    assert folded == whole and whole.tokens == 600 and whole.text.startswith("t0 t1 ")
    assert whole.ids == list(range(600))


def test_migration_counts_the_tokens_each_event_carries_not_the_events_with_text() -> None:
    """Held-back text (a stop string's start) comes out with a later token: the empty events are tokens too; with
    logprobs an event's tokens are its entries (SGLang's stream_interval > 1); continuous usage is the worker's own
    count. Counting content-bearing events undercounted all three, and a resumed stream then overran max_tokens."""
    import json

    from dsv4_cluster.router.resume import progress

    def chunk(content: str, entries: int | None = None, usage: int | None = None) -> bytes:
        choice = {"delta": {"content": content},
                  "logprobs": None if entries is None else {"content": [{"token": "t"}] * entries}}
        return b"data: " + json.dumps({"choices": [choice], "usage": usage and {"completion_tokens": usage}}).encode()

    held = [chunk("a"), chunk(""), chunk(""), chunk("xyz")]           # "xy" held back, released with "z"
    done = progress("/v1/chat/completions", held)
    assert (done.text, done.tokens) == ("axyz", 4)
    assert progress("/v1/chat/completions", [chunk("abcd", entries=4), chunk("ef", entries=2)]).tokens == 6
    assert progress("/v1/chat/completions", [chunk("ab", usage=2), chunk("", usage=3)]).tokens == 3


def test_migration_splices_logprobs_onto_what_was_sent() -> None:
    import json

    from dsv4_cluster.router.migration import splice
    from dsv4_cluster.router.resume import Progress, progress

    def event(data: dict) -> bytes:
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    sent = [event({"text": "ab", "output_ids": [97, 98], "meta_info": {
        "completion_tokens": 2, "prompt_tokens": 5, "output_token_logprobs": [[-0.1, 97, None], [-0.2, 98, None]],
        "output_top_logprobs": [[[-0.1, 97, None]], [[-0.2, 98, None]]], "output_token_logprobs_length": 2}})]
    rest = json.loads(splice("/generate", progress("/generate", sent))(event({"text": "c", "output_ids": [99],
        "meta_info": {"completion_tokens": 1, "prompt_tokens": 7, "output_token_logprobs": [[-0.3, 99, None]],
                      "output_top_logprobs": [[[-0.3, 99, None]]], "output_token_logprobs_length": 1}}))[6:])
    meta = rest["meta_info"]
    assert [t[1] for t in meta["output_token_logprobs"]] == rest["output_ids"] == [97, 98, 99]
    assert len(meta["output_top_logprobs"]) == meta["output_token_logprobs_length"] == 3
    chunk = event({"choices": [{"index": 0, "text": "xy", "logprobs": {"tokens": ["x", "y"], "text_offset": [0, 1]}}]})
    shifted = json.loads(splice("/v1/completions", Progress(text="hello", tokens=5))(chunk)[6:])
    assert shifted["choices"][0]["logprobs"]["text_offset"] == [5, 6]   # offsets in the whole output text


def test_a_continuation_goes_on_from_the_prompt_ids_and_the_output_ids_relayed() -> None:
    """On every route the new prompt is the ids the workers reported (the chat template's rendered prompt included),
    not the text the client has: a token without text (an EOS under ignore_eos, 257) stays in it."""
    import json

    from dataclasses import replace

    from dsv4_cluster.router.resume import continuation, prefill_asks, progress, prompt_ids_in, with_ids

    def event(data: dict) -> bytes:
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    chat = {"messages": [{"role": "user", "content": "é"}], "max_tokens": 9, "stream": True}
    body, asked = with_ids("/v1/chat/completions", chat)
    assert asked and body["stream_token_ids"] is True and "stream_token_ids" not in chat
    sent = [event({"choices": [{"delta": {"role": "assistant", "content": "a"}, "token_ids": [97],
                                "prompt_token_ids": [256, 259, 195, 169, 261, 260]}]}),
            event({"choices": [{"delta": {"content": ""}, "token_ids": [257]}]})]
    new = continuation("/v1/chat/completions", body, progress("/v1/chat/completions", sent))
    assert new["input_ids"] == [256, 259, 195, 169, 261, 260, 97, 257] and new["max_tokens"] == 7
    assert new["messages"] == chat["messages"] and "continue_final_message" not in new

    completion, _ = with_ids("/v1/completions", {"prompt": "é", "max_tokens": 9, "stream": True})
    sent = [event({"choices": [{"text": "", "token_ids": [257], "prompt_token_ids": [256, 195, 169]}]})]
    new = continuation("/v1/completions", completion, progress("/v1/completions", sent))
    assert new["prompt"] == [256, 195, 169, 257]

    # /generate: output_ids are in every event; a text prompt's ids are asked of the prefill only (a decode would
    # repeat them in every event)
    generate = {"text": "é", "sampling_params": {"max_new_tokens": 9}}
    assert with_ids("/generate", generate) == (generate, False)
    assert prefill_asks("/generate", generate) == {"return_prompt_token_ids": True}
    answer = event({"text": "", "output_ids": [97], "prompt_token_ids": [256, 195, 169]}) + b"data: [DONE]\n\n"
    prompt = prompt_ids_in(answer)   # the prefill's
    sent = [event({"text": "", "output_ids": [257], "meta_info": {"completion_tokens": 1}})]
    new = continuation("/generate", generate, replace(progress("/generate", sent), prompt_ids=prompt))
    assert new["input_ids"] == [256, 195, 169, 257] and "text" not in new
    assert new["sampling_params"]["max_new_tokens"] == 8
    assert prefill_asks("/generate", {"input_ids": [1], "sampling_params": {}}) == {}   # its ids are known


def test_what_the_router_asked_for_is_taken_out_of_every_event_byte_for_byte() -> None:
    from dsv4_cluster.router.resume import strip_ids

    plain = b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"\\"token_ids\\":[1]"},"logprobs":null}]}\n\n'
    asked = plain.replace(b'"logprobs":null}', b'"logprobs":null,"token_ids":[97,257],"prompt_token_ids":[256,1]}')
    generate = b'data: {"text":"a","output_ids":[97],"meta_info":{"id":"x"}}\n\n'
    assert strip_ids(asked + generate.replace(b"}}", b'},"prompt_token_ids":[256]}')) == plain + generate


def test_a_spliced_event_keeps_the_workers_way_of_writing_non_ascii_text() -> None:
    from dsv4_cluster.router.migration import splice
    from dsv4_cluster.router.resume import Progress

    rewrite = splice("/v1/completions", Progress(text="a", tokens=1))
    raw = 'data: {"choices":[{"index":0,"text":"é"}]}\n\n'
    assert rewrite(raw.encode()) == raw.encode()   # SGLang (pydantic) writes UTF-8
    assert rewrite(raw.replace("é", "\\u00e9").encode()) == raw.replace("é", "\\u00e9").encode()   # json.dumps


def test_ids_a_client_asked_for_read_as_in_the_uninterrupted_stream() -> None:
    """The prompt's ids: the first attempt's, on the first chunk only (a continuation's prompt is longer)."""
    import json

    from dsv4_cluster.router.migration import splice
    from dsv4_cluster.router.resume import Progress

    done = Progress(text="a", prompt_ids=[256, 1], ids=[97], tokens=1)
    chunk = b'data: {"choices":[{"index":0,"text":"b","token_ids":[98],"prompt_token_ids":[256,1,97]}]}\n\n'
    assert json.loads(splice("/v1/completions", done)(chunk)[6:])["choices"][0] == {"index": 0, "text": "b",
                                                                                    "token_ids": [98]}
    event = b'data: {"text":"b","output_ids":[98],"prompt_token_ids":[256,1,97]}\n\n'
    assert json.loads(splice("/generate", done)(event)[6:]) == {"text": "ab", "output_ids": [97, 98],
                                                                 "prompt_token_ids": [256, 1]}


def test_without_ids_a_continuation_goes_on_from_the_text_the_client_has() -> None:
    """SGLang's chat streams no ids: the text as a final assistant message (continue_final_message)."""
    import json

    from dsv4_cluster.router.resume import continuation, progress

    sent = [b"data: " + json.dumps({"choices": [{"delta": {"content": "ab"}}]}).encode() + b"\n\n"]
    body = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5, "stream": True}
    new = continuation("/v1/chat/completions", body, progress("/v1/chat/completions", sent))
    assert new["messages"][-1] == {"role": "assistant", "content": "ab"} and new["continue_final_message"]
    assert new["max_completion_tokens"] == 4 and "input_ids" not in new
    partial = {**body, "messages": [*body["messages"], {"role": "Assistant", "content": "x"}],
               "continue_final_message": True}
    extended = continuation("/v1/chat/completions", partial, progress("/v1/chat/completions", sent))["messages"]
    assert extended[1:] == [{"role": "Assistant", "content": "xab"}]   # the client's partial reply, in any case
    whole = continuation("/v1/chat/completions", {**body, "max_completion_tokens": 5.0},   # admitted as SGLang does
                         progress("/v1/chat/completions", sent))
    assert whole["max_completion_tokens"] == 4


def test_a_continuation_without_a_budget_spends_what_is_left_of_the_default() -> None:
    """A /v1/completions request without max_tokens gets 16 tokens (SGLang's and OpenAI's default), a /generate one
    without max_new_tokens 128 (SGLang's SamplingParams); a continuation asked for the default again, so a completions
    stream moved after 10 tokens could end with 26."""
    import json

    from dsv4_cluster.router.resume import continuation, progress

    sent = [b"data: " + json.dumps({"choices": [{"text": "t"}]}).encode() + b"\n\n" for _ in range(10)]
    body = {"prompt": "x", "stream": True}
    new = continuation("/v1/completions", body, progress("/v1/completions", sent))
    assert new["max_tokens"] == 6 and "max_tokens" not in body and new["prompt"] == "x" + "t" * 10
    assert continuation("/v1/completions", body, progress("/v1/completions", sent + sent)) is None
    chat = {"messages": [{"role": "user", "content": "x"}], "stream": True}   # chat's default: up to the context
    assert "max_tokens" not in continuation("/v1/chat/completions", chat, progress("/v1/chat/completions", sent))
    generate = {"text": "x", "stream": True}   # SGLang's SamplingParams default: 128 new tokens
    done = [b"data: " + json.dumps({"text": "t" * 10, "output_ids": list(range(10)),
                                    "meta_info": {"completion_tokens": 10}}).encode() + b"\n\n"]
    assert continuation("/generate", generate, progress("/generate", done))["sampling_params"]["max_new_tokens"] == 118
    unlimited = {"text": "x", "sampling_params": {"max_new_tokens": None}}   # it crashed (None - 10)
    again = continuation("/generate", unlimited, progress("/generate", done))
    assert again["sampling_params"]["max_new_tokens"] is None


def test_an_answer_read_after_a_recorded_death_does_not_make_the_worker_answering_again() -> None:
    """A health check whose /health answered before the process died, read by the loop only after a request recorded
    the death (a loaded router), leaves the worker not answering: a held request keeps waiting for the restart
    instead of being retried at once on the dead worker until max_retries ran out (a 502 under load)."""
    import asyncio

    from dsv4_cluster.router.health import HealthChecker
    from dsv4_cluster.router.pool import WorkerPool
    from tests.router_fakes import router_settings

    settings = router_settings("http://127.0.0.1:1", "http://127.0.0.1:2", max_queued_per_worker=0)
    pool = WorkerPool(settings)
    prefill = pool.prefill[0]

    class SlowRead:  # /health answered 200 (before the death); the loop reads it after the failure below
        def __init__(self) -> None:
            self.asked, self.release = asyncio.Event(), asyncio.Event()

        async def probe(self, worker, path, timeout_s):
            self.asked.set()
            await self.release.wait()
            return 200, b""

    async def main() -> bool:
        upstream = SlowRead()
        checker = HealthChecker(pool, upstream, settings)
        check = asyncio.ensure_future(checker.check(prefill))
        await upstream.asked.wait()
        prefill.record(ok=False)           # a request to it failed to connect: the process is gone
        upstream.release.set()
        await check
        return prefill.answering

    assert asyncio.run(main()) is False
    prefill.alive_at(prefill.last_failure + 1.0)   # an answer asked for after the failure: answering again
    assert prefill.answering


def test_a_lost_worker_ends_each_request_it_is_part_of_once():
    p, d = Worker(Role.PREFILL, "p", "http://p:1"), Worker(Role.DECODE, "d", "http://d:1")
    other = Worker(Role.DECODE, "e", "x")
    ended: list[tuple[str, str]] = []
    pairs = [Pair(p, d), Pair(p, other)]
    for pair in pairs:
        pair.on_lost = lambda worker, why, pair=pair: ended.append((pair.decode.name, why))
    assert (p.in_flight, d.in_flight, other.in_flight) == (2, 1, 1)
    d.lost("failed 2 health checks in a row")
    assert ended == [("d", "failed 2 health checks in a row")]
    pairs[0].release()
    pairs[0].release()
    assert (p.in_flight, d.in_flight, d.pairs) == (1, 0, set())
    d.lost("again")                                  # released: nothing left to end
    p.lost("prefill hung")
    assert ended[1:] == [("e", "prefill hung")]
    assert p.state is WorkerState.READY              # losing requests is not a state change (the admin API's)
