"""The workers' request schema against the installed SGLang's, and the neutral-value rule of `fields.py`.

SGLang's classes are read from its source with `ast` (never imported: `pip install --no-deps sglang`
leaves modules that its package `__init__` imports missing). Without SGLang the comparison skips, except
in CI (CI=true), where `.ci/run` installs it and a missing SGLang is a failure.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from dsv4_cluster.workers.http import fields
from dsv4_cluster.workers.http.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                                GenerateRequest, GenerateSampling)

SGLANG_VERSION = "0.5.23"
OURS = {
    ("srt/managers/io_struct.py", "GenerateReqInput"): GenerateRequest,
    ("srt/entrypoints/openai/protocol.py", "ChatCompletionRequest"): ChatCompletionRequest,
    ("srt/entrypoints/openai/protocol.py", "CompletionRequest"): CompletionRequest,
    ("srt/sampling/sampling_params.py", "SamplingParams"): GenerateSampling,
    ("srt/entrypoints/openai/protocol.py", "ChatCompletionMessageGenericParam"): ChatMessage,
}
# SamplingParams' own comment splits its fields: "API parameters (set by callers)" above
# "Internal fields (populated by __post_init__ or normalize(), not API-facing)".
INTERNAL_MARK = "# --- Internal fields"
# Fields the SGLang class lacks that a router sends: SGLang's own router (GENERATE's "model"), ours (chat's
# `stream_token_ids`, protocol.py: what a broken stream is continued from; SGLang's server ignores it).
ROUTER_EXTRAS = {"GenerateReqInput": frozenset({"model"}), "ChatCompletionRequest": frozenset({"stream_token_ids"})}
# Fields of a body that its SGLang class lacks, by class: the routers' and the OpenAI API's (fields.py)
NOT_SGLANG = {"GenerateReqInput": ROUTER_EXTRAS["GenerateReqInput"],
              "ChatCompletionRequest": ROUTER_EXTRAS["ChatCompletionRequest"] | set(fields.OPENAI_CHAT),
              "ChatCompletionMessageGenericParam": frozenset(fields.OPENAI_MESSAGE)}


def _sglang_root() -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        if os.environ.get("CI") == "true":
            pytest.fail(f"sglang=={SGLANG_VERSION} is not installed; CI installs it (.ci/run) for this test")
        pytest.skip(f"sglang=={SGLANG_VERSION} is not installed (pip install --no-deps sglang=={SGLANG_VERSION})")
    return Path(spec.submodule_search_locations[0])


def sglang_fields(path: str, name: str) -> set[str]:
    """Public fields of class `name` in SGLang's `path`, with those of its bases defined in the same file."""
    source = (_sglang_root() / path).read_text()
    classes = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}
    cutoff = next((i + 1 for i, line in enumerate(source.splitlines()) if INTERNAL_MARK in line), None)

    def collect(cls: ast.ClassDef) -> set[str]:
        out = set()
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id in classes:
                out |= collect(classes[base.id])
        for stmt in cls.body:
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and not stmt.target.id.startswith("_") and not (cutoff and stmt.lineno > cutoff)):
                out.add(stmt.target.id)
        return out

    return collect(classes[name])


@pytest.mark.parametrize("where", list(OURS), ids=[name for _, name in OURS])
def test_field_sets_equal_the_installed_sglang(where):
    ours = OURS[where]
    declared = set(ours.model_fields) | set(ours.RULES)
    assert ours.SGLANG == where[1]
    theirs = sglang_fields(*where) | NOT_SGLANG.get(where[1], frozenset())
    assert declared == theirs, (f"{where[1]}: only SGLang has {sorted(theirs - declared)}; "
                                f"only we have {sorted(declared - theirs)}")
    assert not set(ours.model_fields) & set(ours.RULES), "a field is both honoured and ruled"


def test_sglang_version_is_the_pinned_one():
    _sglang_root()
    assert importlib.metadata.version("sglang") == SGLANG_VERSION


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
BASES = {ChatCompletionRequest: CHAT, CompletionRequest: {"prompt": "hi"}, GenerateRequest: {"text": "hi"}}


def _validate(model, field: str, value):
    if model is GenerateSampling:
        return GenerateRequest.model_validate({"text": "hi", "sampling_params": {field: value}})
    if model is ChatMessage:
        return ChatCompletionRequest.model_validate({"messages": [{"role": "assistant", "content": "x", field: value}]})
    return model.model_validate({**BASES[model], field: value})


RULED = [(m, f, r) for m in (ChatCompletionRequest, CompletionRequest, GenerateRequest, GenerateSampling, ChatMessage)
         for f, r in m.RULES.items()]


@pytest.mark.parametrize("model,field,rule", RULED, ids=[f"{m.__name__}.{f}" for m, f, _ in RULED])
def test_neutral_values_are_accepted_and_others_refused_naming_the_field(model, field, rule):
    if rule is fields.ANY:
        _validate(model, field, "anything")
        return
    for value in rule.values:
        _validate(model, field, value)
    with pytest.raises(ValidationError) as err:
        _validate(model, field, "a-value-no-rule-accepts")
    assert f"{field}: \"a-value-no-rule-accepts\" is not supported: {rule.why}" in str(err.value)


def test_what_openai_clients_send_by_default_is_accepted():
    body = {**CHAT, "frequency_penalty": 0, "presence_penalty": 0, "response_format": {"type": "text"},
            "tools": [], "tool_choice": "none", "n": 1, "logprobs": False, "top_logprobs": None, "user": "u1",
            "parallel_tool_calls": True, "max_completion_tokens": 5, "stream_options": {"include_usage": True}}
    assert ChatCompletionRequest.model_validate(body).sampling(128).max_new_tokens == 5
    assert CompletionRequest.model_validate({"prompt": "x", "echo": False, "best_of": 1, "suffix": None,
                                             "logprobs": None}).sampling(128).max_new_tokens == 16


def test_a_reply_sent_back_as_history_and_the_openai_fields_sglang_ignores_are_accepted():
    """The openai SDK's reply object dumped into the next turn (refusal, annotations, audio, function_call: null),
    the OpenAI API's request fields SGLang's model ignores, a role in capitals (SGLang lowercases it)."""
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage(role="assistant", content="ok", refusal=None, annotations=[]).model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(reply)
    body = {"messages": [{"role": "User", "content": "hi"}, reply, {"role": "user", "content": "more"}],
            "store": True, "metadata": {"app": "x"}, "service_tier": "auto", "prompt_cache_key": "k",
            "safety_identifier": "s", "modalities": ["text"], "audio": None, "prediction": None, "verbosity": None}
    req = ChatCompletionRequest.model_validate(body)
    assert [m.role for m in req.messages] == ["user", "assistant", "user"]
    assert req.messages[1].model_dump(exclude_none=True) == {"role": "assistant", "content": "ok"}


@pytest.mark.parametrize("body,field", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"stream_options": {"continuous_usage_stats": True}}, "continuous_usage_stats"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"messages": [{"role": "assistant", "content": "x", "prefix": True}]}, "prefix"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"sampling_logprobs_mode": "support"}, "sampling_logprobs_mode"),   # logprobs themselves are served
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_non_neutral_openai_fields_are_refused_naming_the_field(body, field):
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({**CHAT, **body})
    assert f"{field}: " in str(err.value) and "not supported" in str(err.value)


def test_whole_floats_are_taken_as_ints_on_the_openai_routes_as_sglang_takes_them():
    """`max_tokens: 5.0` (SGLang's lax models take it): the router's strict admission and the worker agree; 5.5
    and a boolean stay refused by the router. (Not `n`: the router counts a batch's items by an int n.)"""
    from dsv4_cluster.router.admission import ChatBody

    body = {**CHAT, "max_tokens": 5.0, "max_completion_tokens": 4.0}
    assert ChatCompletionRequest.model_validate(body).sampling(128).max_new_tokens == 4
    assert ChatBody.model_validate(body).max_tokens == 5
    assert ChatBody.model_json_schema()["properties"]["max_tokens"]["anyOf"][0]["minimum"] == 1   # /openapi.json
    for bad in (5.5, True):
        with pytest.raises(ValidationError, match="max_tokens"):
            ChatBody.model_validate({**CHAT, "max_tokens": bad})
    with pytest.raises(ValidationError, match="fractional part"):
        ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 5.5})


def test_unknown_fields_are_refused():
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({**CHAT, "frequncy_penalty": 0})
    assert "frequncy_penalty" in str(err.value)


def test_false_is_not_zero_and_zero_is_not_false():
    assert fields.Neutral((None, 1), "").accepts(1) and not fields.Neutral((None, 1), "").accepts(True)
    assert fields.Neutral((None, 0), "").accepts(0.0) and not fields.Neutral((None, 0), "").accepts(False)


@pytest.mark.parametrize("model, body, field", [
    (GenerateRequest, {"text": ["a", "b"]}, "text"),
    (GenerateRequest, {"input_ids": [[1], [2]]}, "input_ids"),
    (CompletionRequest, {"prompt": ["a", "b"]}, "prompt"),
    (CompletionRequest, {"prompt": [[1], [2]]}, "prompt"),
])
def test_a_batch_is_refused_in_one_sentence_naming_the_prompt_field(model, body, field):
    """The router pairs a batched /generate with a list of rooms, hosts and rids: the 400 once listed a type error
    for each of those fields (bootstrap_host, rid, ...), fields the client never sent, and not the batch."""
    batch = len(next(iter(body.values())))
    router_fields = {"bootstrap_host": ["h"] * batch, "bootstrap_port": [1] * batch,
                     "bootstrap_room": list(range(batch)), "rid": [f"r-{i}" for i in range(batch)]}
    with pytest.raises(ValidationError) as err:
        model.model_validate({**body, **router_fields})
    (error,) = err.value.errors()
    assert error["msg"].startswith(f"Value error, {field}: a batch (a list of prompts) is not supported")
    model.model_validate({"text": "a"} if model is GenerateRequest else {"prompt": [1, 2]})


def test_null_sampling_params_are_the_defaults_as_in_sglang():
    """SGLang's `GenerateReqInput.sampling_params` is Optional (None normalizes to {}); the worker once refused
    `"sampling_params": null` with a 400 naming its own model class."""
    req = GenerateRequest.model_validate({"text": "hi", "sampling_params": None})
    assert req.sampling(128).max_new_tokens == 128 and req.max_asked() is None


@pytest.mark.parametrize("part", [{"type": "text"}, {"type": "text", "text": None}, {"type": "text", "text": 5}],
                         ids=["missing", "null", "number"])
def test_a_text_part_without_a_string_text_is_refused_as_sglang_refuses_it(part):
    """SGLang's text part is `{"type": "text", "text": str}`; the chat template once rendered these as "", "None"
    and "5" in the prompt and answered 200."""
    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [part]}]})
    assert "messages.0.content" in str(err.value) and "'text'" in str(err.value)
    ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]})


def test_a_user_message_without_content_is_refused_as_sglang_refuses_it():
    """SGLang's user message requires `content`; the generic one (system, assistant: a reply with tool calls) may
    leave it null. The worker once took a user message's null content as an empty prompt."""
    for user in ({"role": "user", "content": None}, {"role": "user"}):
        with pytest.raises(ValidationError, match="a user message needs 'content'"):
            ChatCompletionRequest.model_validate({"messages": [user]})
    ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": None},
                                                       {"role": "user", "content": "hi"},
                                                       {"role": "assistant", "content": None}]})


@pytest.mark.parametrize("kind, body, field", [
    ("generate", {"text": "hi", "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params"),
    ("chat", {"messages": ["hi"]}, "messages.0"),
    ("chat", {**CHAT, "stream_options": 5}, "stream_options"),
])
def test_a_worker_400_names_the_field_and_no_python_class(kind, body, field):
    """pydantic's "Input should be a valid dictionary or instance of GenerateSampling" named the worker's own
    model class to the client."""
    from dsv4_cluster.workers.args import Role, WorkerArgs
    from dsv4_cluster.workers.http.server import BadRequest, WorkerServer

    with pytest.raises(BadRequest) as err:
        WorkerServer(WorkerArgs(role=Role.DECODE)).parse(kind, body)
    assert str(err.value) == f"{field}: Input should be a JSON object"
