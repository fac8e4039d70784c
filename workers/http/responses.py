"""Response bodies in OpenAI's and SGLang's shapes, plain and SSE. Stop trimming follows SGLang's detokenizer: a
matched stop string or token id is left out unless `no_stop_trim`; streamed text that could begin a stop string
is held back until the next tokens decide.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Literal

from . import logprob_format
from ..engine.request import Finish
from ..engine.sampling import SamplingParams, TokenLogprob
from ..engine.tokenizer import ByteTokenizer, IncrementalDecoder
from .logprob_format import Entry

Kind = Literal["chat", "completion", "generate"]


@dataclass(frozen=True)
class GenSpec:
    """A validated generation request, whatever endpoint it came from."""

    kind: Kind
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    room: int | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    logprob_text: bool = True          # /generate's return_text_in_logprobs (the OpenAI routes always show text)
    token_ids: bool = False            # each event's output ids and the prompt's (completions' return_token_ids)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def bootstrap_url(self) -> str | None:
        """The paired prefill's bootstrap server (SGLang's default port 8998 when none is given)."""
        if self.bootstrap_host is None:
            return None
        return f"http://{self.bootstrap_host}:{self.bootstrap_port or 8998}"


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the start (not the whole) of one of `stops`."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class ResponseBuilder:
    def __init__(self, spec: GenSpec, tokenizer: ByteTokenizer):
        self.spec, self.tok = spec, tokenizer
        self.ids: list[int] = []
        self.text = ""                 # what the client has been sent (or will get, when not streaming)
        self._raw = ""                 # every token's text, stop strings included
        self._finish: Finish | None = None
        self._decoder = IncrementalDecoder()
        self._trim = not spec.params.no_stop_trim
        self.cached_tokens = 0         # prompt tokens whose KV came from the prefill's prefix cache
        self.logprobs: list[Entry] = []
        self._logprobs_sent = 0        # entries already streamed
        self._ids_sent = 0             # output ids already streamed (`token_ids`)
        self._aborted: str | None = None   # why /abort_request ended it

    def push(self, token_id: int, finish: Finish | None = None, cached_tokens: int | None = None,
             logprob: TokenLogprob | None = None) -> str:
        """Add one output token; returns the text the client may see now that it has not seen yet."""
        self.ids.append(token_id)
        if self.spec.params.logprobs:
            if logprob is None:
                raise RuntimeError(f"output token {len(self.ids)} came without the logprob this request asked for")
            self.logprobs.append(Entry(token_id, logprob, len(self._raw)))
        if cached_tokens is not None:
            self.cached_tokens = cached_tokens
        self._finish = finish
        piece = self._decoder.push(token_id)
        if not (self._trim and finish is not None and isinstance(finish.matched, int)):
            self._raw += piece
        if finish is None:
            visible = self._raw[: len(self._raw) - held_back(self._raw, self.spec.params.stop if self._trim else ())]
        elif self._trim and isinstance(finish.matched, str):
            visible = self._raw[: self._raw.rfind(finish.matched)]
        else:
            visible = self._raw
        delta, self.text = visible[len(self.text):], visible
        return delta

    def abort(self, message: str) -> str:
        """The request was ended through /abort_request: the text held back for a possible stop string is the
        output's after all; returns what the client has not seen. The meta's finish_reason is abort's."""
        self._aborted = message
        delta, self.text = self._raw[len(self.text):], self._raw
        return delta

    @property
    def holding(self) -> bool:
        """The output's end may start a stop string (its text is held back unless `no_stop_trim`; SGLang streams no
        event then either way), or a character's first bytes are in."""
        return self._finish is None and (self._decoder.pending or held_back(self._raw, self.spec.params.stop) > 0)

    def _usage(self) -> dict:
        p, c = len(self.spec.prompt_ids), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}   # OpenAI's and SGLang's field

    def _id(self) -> str:
        prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "generate": ""}[self.spec.kind]
        return prefix + self.spec.rid

    def _meta(self, reason: str | None, prefill_only: bool) -> dict:
        if reason is None:
            finish = None
        elif reason == "abort":
            finish = {"type": "abort", "message": self._aborted}
        elif prefill_only or reason == "length":
            finish = {"type": "length", "length": 0 if prefill_only else len(self.ids)}
        else:
            finish = {"type": "stop", "matched": self._finish.matched if self._finish else None}
        meta = {"id": self.spec.rid, "prompt_tokens": len(self.spec.prompt_ids),
                "completion_tokens": len(self.ids), "cached_tokens": self.cached_tokens, "finish_reason": finish}
        if self.spec.params.logprobs:
            meta.update(logprob_format.generate_meta(self.logprobs, self.tok, self.spec.params.top_logprobs,
                                                     self.spec.logprob_text))
        return meta

    def _choice_logprobs(self, entries: list[Entry]) -> dict | None:
        if not self.spec.params.logprobs:
            return None
        shape = logprob_format.chat if self.spec.kind == "chat" else logprob_format.completion
        return shape(entries, self.tok)

    def _unsent_logprobs(self) -> list[Entry]:
        entries, self._logprobs_sent = self.logprobs[self._logprobs_sent:], len(self.logprobs)
        return entries

    def _with_ids(self, body: dict, first: bool) -> dict:
        """`body` with the ids asked for (`GenSpec.token_ids`): the prompt's on the first event (on every one in
        /generate, as SGLang sends them) and, in a choice, the output ids since the last event."""
        if not self.spec.token_ids:
            return body
        if self.spec.kind == "generate":
            return {**body, "prompt_token_ids": self.spec.prompt_ids}
        ids, self._ids_sent = self.ids[self._ids_sent:], len(self.ids)
        choice = body["choices"][0]
        choice["token_ids"] = ids
        if first:
            choice["prompt_token_ids"] = self.spec.prompt_ids
        return body

    def final(self, reason: str, prefill_only: bool = False) -> dict:
        s = self.spec
        if s.kind == "generate":
            return self._with_ids({"text": self.text, "output_ids": self.ids,
                                   "meta_info": self._meta(reason, prefill_only)}, True)
        base = {"id": self._id(), "created": s.created, "model": s.model, "usage": self._usage()}
        if s.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": reason, "logprobs": self._choice_logprobs(self.logprobs)}
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": self.text, "finish_reason": reason,
                  "logprobs": self._choice_logprobs(self.logprobs)}
        return self._with_ids({**base, "object": "text_completion", "choices": [choice]}, True)

    def chunk(self, delta: str, reason: str | None, first: bool = False, prefill_only: bool = False) -> dict:
        s = self.spec
        if s.kind == "generate":
            return self._with_ids({"text": self.text, "output_ids": list(self.ids),
                                   "meta_info": self._meta(reason, prefill_only)}, first)
        base = {"id": self._id(), "created": s.created, "model": s.model}
        if s.kind == "chat":
            d = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice = {"index": 0, "delta": d, "finish_reason": reason,
                      "logprobs": self._choice_logprobs(self._unsent_logprobs())}
            return self._with_ids({**base, "object": "chat.completion.chunk", "choices": [choice]}, first)
        choice = {"index": 0, "text": delta, "finish_reason": reason,
                  "logprobs": self._choice_logprobs(self._unsent_logprobs())}
        return self._with_ids({**base, "object": "text_completion", "choices": [choice]}, first)

    def usage_chunk(self) -> dict | None:
        s = self.spec
        if s.kind == "generate" or not s.include_usage:
            return None
        obj = "chat.completion.chunk" if s.kind == "chat" else "text_completion"
        return {"id": self._id(), "created": s.created, "model": s.model, "object": obj, "choices": [],
                "usage": self._usage()}


def error_body(status: int, message: str) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str):
    """The error body as a JSON response with its status (the routes' and the generation path's one form)."""
    from fastapi.responses import JSONResponse

    return JSONResponse(error_body(status, message), status_code=status)
