"""Stop strings and stop token ids end generation and are trimmed from the text, as SGLang and OpenAI do."""

from __future__ import annotations

import pytest

from dsv4_cluster.workers.engine.request import Finish, Req
from dsv4_cluster.workers.http.responses import GenSpec, ResponseBuilder, held_back
from dsv4_cluster.workers.engine.sampling import SamplingParams
from dsv4_cluster.workers.engine.tokenizer import EOS, ByteTokenizer

TOK = ByteTokenizer()


def _run(text: str, params: SamplingParams, kind: str = "chat") -> tuple[list[str], ResponseBuilder, Finish]:
    """Feed `text` byte by byte (as the engine emits it) until the request finishes; the deltas sent."""
    req = Req(rid="r", prompt_ids=[1], params=params, budget=10_000, emit=lambda e: None)
    out = ResponseBuilder(GenSpec(kind=kind, rid="r", prompt_ids=[1], params=params, stream=True,
                                  include_usage=False, model="m"), TOK)
    deltas = []
    for token in [*text.encode(), EOS]:
        req.out.append(token)
        finish = req.finished(EOS)
        deltas.append(out.push(token, finish))
        if finish:
            return deltas, out, finish
    raise AssertionError("never finished")


def test_a_stop_string_ends_generation_and_is_trimmed():
    deltas, out, finish = _run("oH4IbfA and more", SamplingParams(stop=("IbfA",)))
    assert finish == Finish("stop", "IbfA")
    assert out.text == "oH4" == "".join(deltas)
    assert out.final("stop")["choices"][0]["message"]["content"] == "oH4"


def test_no_stop_trim_keeps_the_stop_string():
    deltas, out, _ = _run("oH4IbfA and more", SamplingParams(stop=("IbfA",), no_stop_trim=True))
    assert out.text == "oH4IbfA" == "".join(deltas)


def test_a_stop_string_split_across_chunks_is_never_streamed():
    deltas, out, _ = _run("abcab-xyz", SamplingParams(stop=("b-x",)))
    assert "".join(deltas) == "abca"
    # held back while it could still be the stop string, released once it is not
    assert deltas[:3] == ["a", "", "bc"]


def test_a_partial_match_is_released_when_the_text_goes_another_way():
    deltas, out, finish = _run("xIbfZ", SamplingParams(stop=("IbfA",)))
    assert finish.reason == "stop" and finish.matched == EOS
    assert "".join(deltas) == "xIbfZ" == out.text


def test_the_first_of_several_stop_strings_to_complete_wins():
    _, out, finish = _run("hello world", SamplingParams(stop=("world", "lo w")))
    assert finish.matched == "lo w" and out.text == "hel"


def test_a_stop_token_id_ends_generation_and_its_text_is_trimmed():
    _, out, finish = _run("abc;def", SamplingParams(stop_token_ids=(ord(";"),)))
    assert finish == Finish("stop", ord(";")) and out.text == "abc"
    _, kept, _ = _run("abc;def", SamplingParams(stop_token_ids=(ord(";"),), no_stop_trim=True))
    assert kept.text == "abc;"


def test_generate_reports_the_matched_stop_like_sglang():
    _, out, _ = _run("abc;def", SamplingParams(stop=("c;",)), kind="generate")
    body = out.final("stop")
    assert body["text"] == "ab"
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "c;"}


@pytest.mark.parametrize("text,stops,held", [("xab", ("abc",), 2), ("xab", ("b",), 0), ("xa", ("zz", "ab"), 1),
                                             ("", ("ab",), 0), ("ab", ("ab",), 0)])
def test_held_back(text, stops, held):
    assert held_back(text, stops) == held


def test_a_stop_string_matches_across_a_token_without_text():
    """An EOS kept by `ignore_eos` has no text: the stop string is matched on the text, as SGLang decodes it (on the
    ids, "ab" after a, EOS, b never matched, and the held text came out in the end)."""
    req = Req(rid="r", prompt_ids=[1], params=SamplingParams(stop=("ab",), ignore_eos=True), budget=100,
              emit=lambda e: None)
    for token in (ord("x"), ord("a"), EOS):
        req.out.append(token)
        assert req.finished(EOS) is None
    req.out.append(ord("b"))
    assert req.finished(EOS) == Finish("stop", "ab")


def test_text_is_held_while_a_stop_string_may_start_or_a_character_is_incomplete():
    """What the worker streams no event for (`WorkerServer._stream`): the held tokens come with the event that releases
    their text, so every event ends where the text of the ids it carries is all out."""
    params = SamplingParams(stop=("zz",))
    out = ResponseBuilder(GenSpec(kind="chat", rid="r", prompt_ids=[1], params=params, stream=True,
                                  include_usage=False, model="m"), TOK)
    held = []
    for token in "aé€z🙂".encode():
        out.push(token)
        held.append(out.holding)
    assert held == [False, True, False, True, True, False, True, True, True, True, False]
    assert out.text == "aé€z🙂"   # once whole, "z🙂" cannot start "zz": released


def test_no_event_while_a_stop_string_may_start_even_when_it_is_not_trimmed():
    """As SGLang's scheduler: a stream resumed after "ab" of a stop "abc" would never see the stop string whole."""
    params = SamplingParams(stop=("abc",), no_stop_trim=True)
    out = ResponseBuilder(GenSpec(kind="chat", rid="r", prompt_ids=[1], params=params, stream=True,
                                  include_usage=False, model="m"), TOK)
    assert [(out.push(t), out.holding)[1] for t in b"xabx"] == [False, True, True, False]
    assert out.text == "xabx"
