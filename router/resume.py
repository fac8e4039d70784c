"""What a broken stream is continued from: the token ids the client already has, as the workers reported them
(docs/router.md, "What a request goes through", 6: which field each route asks for, and why chat differs).

1. `with_ids` / `prefill_asks`: a stream that may be continued (`migration.resumable`) asks its workers for ids.
2. `strip_ids`: what the router added is taken out of every event before it is relayed, so the client's bytes are
   those of a request that did not ask.
3. `progress`: on a break, the text, the prompt's ids, the output ids and the token count relayed (`tokens`: the
   ids when reported, else the worker's counts, `event_tokens`).
4. `continuation`: the prompt's ids + the output ids relayed as the new prompt, the budget less the tokens relayed;
   without ids (chat on SGLang), the text the client has (which loses a token without text and re-tokenizes).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

from . import sse

MAX_KEYS = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/completions": ("max_tokens",)}
COMPLETIONS_MAX_TOKENS = 16   # /v1/completions' budget when the client gives none (SGLang's and OpenAI's default)
GENERATE_MAX_NEW_TOKENS = 128  # /generate's when sampling_params has no max_new_tokens (SGLang's SamplingParams)
ASK = {"/v1/chat/completions": "stream_token_ids", "/v1/completions": "return_token_ids"}
LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")   # cumulative in /generate's meta_info
_IDS = re.compile(rb',"(?:prompt_)?token_ids":\[[0-9,]*\]')   # compact JSON, as SGLang and our workers write it


def _one(body: dict[str, Any], key: str = "n") -> bool:
    return body.get(key) in (None, 1)


def migratable(path: str, body: dict[str, Any]) -> bool:
    """Whether a stream of this request can be continued elsewhere (one choice, one prompt)."""
    if path == "/v1/chat/completions":
        return _one(body)
    if path == "/v1/completions":
        return _one(body) and isinstance(body.get("prompt"), str)
    params = body.get("sampling_params") or {}
    ids = body.get("input_ids")
    single = isinstance(body.get("text"), str) or (isinstance(ids, list) and all(isinstance(i, int) for i in ids))
    return single and isinstance(params, dict) and _one(params)


def with_ids(path: str, body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body the workers get for a resumable stream, and whether the router asked for ids the client did not
    (then `strip_ids` takes them out of the events)."""
    key = ASK.get(path)
    if key is None or body.get(key):
        return body, False
    return {**body, key: True}, True


def prefill_asks(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What only the prefill leg of a resumable stream is asked for: a `/generate` text prompt's ids
    (`prompt_ids_in` reads them from its answer)."""
    if path == "/generate" and body.get("text") is not None and not body.get("return_prompt_token_ids"):
        return {"return_prompt_token_ids": True}
    return {}


def answer_docs(content: bytes) -> list[Any]:
    """The JSON documents of a whole answer: its SSE events', or its body's."""
    return [parse_event(e) for e in (content.split(b"\n\n") if b"data:" in content else [b"data: " + content])]


def prompt_ids_in(content: bytes) -> list[int] | None:
    """The prompt's ids a prefill's `/generate` answer reports; None when it did not."""
    for doc in answer_docs(content):
        if isinstance(doc, dict) and isinstance(doc.get("prompt_token_ids"), list):
            return doc["prompt_token_ids"]
    return None


def strip_ids(run: bytes) -> bytes:
    """A run of events without the `token_ids` / `prompt_token_ids` the router asked for."""
    return _IDS.sub(b"", run) if b'token_ids":[' in run else run


def parse_event(event: bytes) -> Any:
    """An event's JSON data; None when it has none."""
    text = sse.data_of(event).strip()
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


@dataclass(frozen=True)
class Progress:
    """What the client already has."""

    text: str = ""
    prompt_ids: list[int] | None = None      # the prompt's ids, as the worker reported them (None: it did not)
    ids: list[int] = field(default_factory=list)   # output ids (/generate's output_ids, or each chunk's token_ids)
    tokens: int = 0                          # output tokens relayed
    logprobs: dict[str, list] = field(default_factory=dict)   # /generate's cumulative logprob lists


def progress(path: str, events: list[bytes], start: Progress = Progress()) -> Progress:
    """`start` and what `events` added."""
    text, prompt, ids, tokens, logprobs = start.text, start.prompt_ids, list(start.ids), start.tokens, start.logprobs
    for event in events:
        doc = parse_event(event)
        if not isinstance(doc, dict):
            continue
        if path == "/generate":
            text, ids = doc.get("text", text), doc.get("output_ids", ids)
            prompt = prompt if prompt is not None else doc.get("prompt_token_ids")
            meta = doc.get("meta_info", {})
            tokens = meta.get("completion_tokens", len(ids))
            logprobs = {k: meta[k] for k in LOGPROB_LISTS if isinstance(meta.get(k), list)} or logprobs
            continue
        usage = doc.get("usage")
        for choice in doc.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if path == "/v1/chat/completions" else choice.get("text")
            text += piece or ""
            tokens += event_tokens(path, choice)
            if prompt is None and isinstance(choice.get("prompt_token_ids"), list):
                prompt = choice["prompt_token_ids"]
            ids.extend(choice.get("token_ids") or ())
        if doc.get("choices") and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]   # continuous usage stats: the worker's own count so far
    return Progress(text, prompt, ids, tokens, logprobs)


def event_tokens(path: str, choice: dict[str, Any]) -> int:
    """The tokens one streamed choice carries, as the worker reports them: its `token_ids` when asked, else one
    logprob entry each when logprobs were asked (SGLang's multi-token events, `stream_interval` > 1), else one per
    event, empty ones included (a worker that streams held-back text with a later token's event)."""
    if isinstance(choice.get("token_ids"), list):
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content" if path == "/v1/chat/completions" else "tokens") \
        if isinstance(logprobs, dict) else None
    return len(entries) if isinstance(entries, list) else 1


def continuation(path: str, body: dict[str, Any], done: Progress) -> dict | None:
    """The request that continues `body` (as the workers got it) after `done`; None when its output budget is
    spent."""
    new = copy.deepcopy(body)
    if path == "/generate":
        params = new.setdefault("sampling_params", {})
        params.setdefault("max_new_tokens", GENERATE_MAX_NEW_TOKENS)   # else the continuation gets 128 more again
        if params["max_new_tokens"] is not None:   # None: up to the context, as the first attempt
            params["max_new_tokens"] -= done.tokens
            if params["max_new_tokens"] <= 0:
                return None
        prompt = new.get("input_ids") if done.prompt_ids is None else done.prompt_ids
        if isinstance(prompt, list):
            new.pop("text", None)
            new["input_ids"] = list(prompt) + list(done.ids)
        else:
            new["text"] += done.text
        return new
    if path == "/v1/completions" and new.get("max_tokens") is None:   # the continuation's default would be 16 again
        new["max_tokens"] = COMPLETIONS_MAX_TOKENS
    for key in MAX_KEYS[path]:
        if isinstance(new.get(key), (int, float)):   # admission took ints and whole floats (5.0) only
            new[key] = int(new[key]) - done.tokens
            if new[key] <= 0:
                return None
    if done.prompt_ids is not None:
        new["prompt" if path == "/v1/completions" else "input_ids"] = list(done.prompt_ids) + list(done.ids)
        return new
    if path == "/v1/completions":
        new["prompt"] += done.text
        return new
    messages = new["messages"]
    last = messages[-1] if messages else None
    if new.get("continue_final_message") and isinstance(last, dict) and str(last.get("role")).lower() == "assistant" \
            and isinstance(last.get("content"), str):   # SGLang takes a role in any case
        last["content"] += done.text
    else:
        messages.append({"role": "assistant", "content": done.text})
    new["continue_final_message"] = True
    return new
