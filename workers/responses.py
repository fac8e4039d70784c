"""Response bodies in OpenAI's (chat, completions) and SGLang's (/generate) shapes, plain and SSE."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Literal

from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, IncrementalDecoder

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
    created: int = field(default_factory=lambda: int(time.time()))


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class ResponseBuilder:
    def __init__(self, spec: GenSpec, tokenizer: ByteTokenizer):
        self.spec, self.tok = spec, tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._decoder = IncrementalDecoder()

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        delta = self._decoder.push(token_id)
        self.text += delta
        return delta

    def _usage(self) -> dict:
        p, c = len(self.spec.prompt_ids), len(self.ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _id(self) -> str:
        prefix = {"chat": "chatcmpl-", "completion": "cmpl-", "generate": ""}[self.spec.kind]
        return prefix + self.spec.rid

    def _meta(self, reason: str | None, prefill_only: bool) -> dict:
        if reason is None:
            finish = None
        elif prefill_only or reason == "length":
            finish = {"type": "length", "length": 0 if prefill_only else len(self.ids)}
        else:
            finish = {"type": "stop", "matched": self.ids[-1] if self.ids else None}
        return {"id": self.spec.rid, "prompt_tokens": len(self.spec.prompt_ids),
                "completion_tokens": len(self.ids), "finish_reason": finish}

    def final(self, reason: str, prefill_only: bool = False) -> dict:
        s = self.spec
        if s.kind == "generate":
            return {"text": self.text, "output_ids": self.ids, "meta_info": self._meta(reason, prefill_only)}
        base = {"id": self._id(), "created": s.created, "model": s.model, "usage": self._usage()}
        if s.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": reason, "logprobs": None}
            return {**base, "object": "chat.completion", "choices": [choice]}
        choice = {"index": 0, "text": self.text, "finish_reason": reason, "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice]}

    def chunk(self, delta: str, reason: str | None, first: bool = False, prefill_only: bool = False) -> dict:
        s = self.spec
        if s.kind == "generate":
            return {"text": self.text, "output_ids": list(self.ids), "meta_info": self._meta(reason, prefill_only)}
        base = {"id": self._id(), "created": s.created, "model": s.model}
        if s.kind == "chat":
            d = {"role": "assistant", "content": delta} if first else {"content": delta}
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            return {**base, "object": "chat.completion.chunk", "choices": [choice]}
        choice = {"index": 0, "text": delta, "finish_reason": reason, "logprobs": None}
        return {**base, "object": "text_completion", "choices": [choice]}

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
