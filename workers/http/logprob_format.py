"""Output-token logprobs in the three answer shapes: OpenAI chat, OpenAI legacy completions, SGLang's `/generate`.

The shapes are SGLang 0.5.23's (`serving_chat._build_token_logprobs_from_raw`, `openai/utils.to_openai_style_logprobs`,
`tokenizer_manager.add_logprob_to_meta_info`), with two differences, both toward OpenAI's definition:
- legacy completions: `text_offset` holds each token's character offset in the generated text (SGLang: -1, "not
  supported yet"), and `top_logprobs` has one dict per token, `{}` for `logprobs: 0` (SGLang: an empty list);
- every token has an entry, the one that ended the output (EOS, a stop token) too, as in SGLang.
`/generate` reports no prompt logprobs: `input_token_logprobs` (and `input_top_logprobs`) are empty, as SGLang's
are for `logprob_start_len` -1, its default.
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
