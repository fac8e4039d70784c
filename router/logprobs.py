"""`/generate` with `return_logprob`: the prefill computed the prompt's logprobs, the decode did not.

docs/protocol.md, "One request", step 5: P's `meta_info.input_token_logprobs` go in front of D's, for whole
answers and for each streamed event alike (SGLang's own routers do the same).
"""

from __future__ import annotations

import json
from typing import Any

from . import sse

KEY = "input_token_logprobs"


def wanted(path: str, body: dict[str, Any]) -> bool:
    return path == "/generate" and bool(body.get("return_logprob"))


def prepend(prefill: Any, decode: Any) -> Any:
    """`decode` with P's input logprobs in front of its own (item by item for batches)."""
    if isinstance(prefill, list) and isinstance(decode, list) and len(prefill) == len(decode):
        return [prepend(p, d) for p, d in zip(prefill, decode)]
    if isinstance(prefill, dict) and isinstance(decode, dict):
        p_meta, d_meta = prefill.get("meta_info"), decode.get("meta_info")
        if isinstance(p_meta, dict) and isinstance(d_meta, dict):
            if isinstance(p_meta.get(KEY), list) and isinstance(d_meta.get(KEY), list):
                d_meta[KEY] = p_meta[KEY] + d_meta[KEY]
    return decode


def final_answer(content: bytes) -> Any:
    """P's answer as JSON: the body itself, or the last JSON event of a drained SSE stream."""
    try:
        return json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        pass
    last = None
    for event in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = sse.data_of(event).strip()
        if data.startswith(("{", "[")):
            try:
                last = json.loads(data)
            except json.JSONDecodeError:
                continue
    return last


def merge_body(prefill_content: bytes, decode_content: bytes) -> bytes:
    """A whole D answer with P's input logprobs in front; unchanged if either is not JSON."""
    try:
        decode = json.loads(decode_content)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return decode_content
    return json.dumps(prepend(final_answer(prefill_content), decode)).encode()


def merge_event(prefill_answer: Any, event: bytes) -> bytes:
    """One D event with P's input logprobs in front; other events pass unchanged."""
    data = sse.data_of(event).strip()
    if prefill_answer is None or not data.startswith(("{", "[")):
        return event
    try:
        decode = json.loads(data)
    except json.JSONDecodeError:
        return event
    return b"data: " + json.dumps(prepend(prefill_answer, decode)).encode() + b"\n\n"
