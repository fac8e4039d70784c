"""Output-token logprobs in SGLang 0.5.23's three answer shapes (OpenAI chat, legacy completions, `/generate`), but
toward OpenAI's definition in legacy completions: `text_offset` holds real offsets and `top_logprobs` one dict per
token. `/generate` reports no prompt logprobs, as SGLang's default `logprob_start_len` -1.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.sampling import TokenLogprob
from ..engine.tokenizer import ByteTokenizer


@dataclass(frozen=True)
class Entry:
    """One output token's logprobs and where its text starts (characters of output text before it)."""

    token_id: int
    logprob: TokenLogprob
    offset: int


def chat(entries: list[Entry], tok: ByteTokenizer) -> dict:
    """`choices[].logprobs` of a chat completion or chunk."""
    def one(token_id: int, logprob: float) -> dict:
        return {"token": tok.token_text(token_id), "logprob": logprob, "bytes": list(tok.token_bytes(token_id))}
    return {"content": [{**one(e.token_id, e.logprob.logprob),
                         "top_logprobs": [one(i, lp) for i, lp in e.logprob.top]} for e in entries]}


def completion(entries: list[Entry], tok: ByteTokenizer) -> dict:
    """`choices[].logprobs` of a legacy completion or chunk."""
    return {"tokens": [tok.token_text(e.token_id) for e in entries],
            "token_logprobs": [e.logprob.logprob for e in entries],
            "top_logprobs": [{tok.token_text(i): lp for i, lp in e.logprob.top} for e in entries],
            "text_offset": [e.offset for e in entries]}


def generate_meta(entries: list[Entry], tok: ByteTokenizer, top_n: int, with_text: bool) -> dict:
    """`meta_info`'s logprob fields of `/generate` ([logprob, token id, text or null] triples)."""
    def triple(token_id: int, logprob: float) -> list:
        return [logprob, token_id, tok.token_text(token_id) if with_text else None]
    meta = {"input_token_logprobs": [], "output_token_logprobs": [triple(e.token_id, e.logprob.logprob)
                                                                   for e in entries],
            "output_token_logprobs_length": len(entries)}
    if top_n > 0:
        meta["input_top_logprobs"] = []
        meta["output_top_logprobs"] = [[triple(i, lp) for i, lp in e.logprob.top] for e in entries]
    return meta
