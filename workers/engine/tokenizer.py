"""Byte-level tokenizer with a chat template: ids 0..255 are bytes, a few special tokens follow. Prefill and decode
tokenize the same request independently, so it must be a pure function of the text.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

BOS, EOS, SYSTEM, USER, ASSISTANT, END_TURN = 256, 257, 258, 259, 260, 261
VOCAB_SIZE = 264  # 256 bytes + 6 specials, padded to a multiple of 8
SPECIAL_NAMES = {BOS: "<bos>", EOS: "<eos>", SYSTEM: "<|system|>", USER: "<|user|>",
                 ASSISTANT: "<|assistant|>", END_TURN: "<|end|>"}
ROLE_TOKENS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT}
# The tiny model's weights are random, so its text means nothing; sampling is restricted to
# printable ASCII (and EOS) so that every response is valid UTF-8 a client can display. A prompt with a
# non-ASCII character also lets it write multi-byte characters, always whole (`next_ids`): one byte per
# token, so such a character is split across 2-4 tokens, as a BPE vocabulary's byte fallback splits them.
PRINTABLE_IDS = tuple(range(32, 127)) + (EOS,)
LEADS = {0xC3: 1, 0xCE: 1, 0xE2: 2, 0xF0: 3}   # lead byte -> continuation bytes: é, Greek, €/…, emoji planes
WITH_LEADS = PRINTABLE_IDS + tuple(LEADS)
CONTINUATION = tuple(range(0x80, 0xC0))
AFTER_F0 = tuple(range(0x90, 0xC0))   # F0's first continuation byte (below 0x90 would be an overlong form)


class ChatTemplateError(ValueError):
    """A chat message the template cannot render (unknown role, non-text content)."""


@dataclass(frozen=True)
class ByteTokenizer:
    vocab_size: int = VOCAB_SIZE
    eos_token_id: int = EOS

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes: its byte, or a special token's name (as a detokenizer that keeps specials shows it)."""
        return bytes([token_id]) if token_id < 256 else SPECIAL_NAMES.get(token_id, "").encode()

    def token_text(self, token_id: int) -> str:
        """One token's text as logprobs show it (a byte that is not UTF-8 on its own shows as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], continue_final: bool = False) -> list[int]:
        """<bos> then, per message, <|role|> content <|end|>; then <|assistant|> to prompt a reply.

        `continue_final` (SGLang's `continue_final_message`) with a final assistant message leaves that
        message open, so the reply continues it: the same ids as the prompt plus that text."""
        ids = [BOS]
        open_last = continue_final and bool(messages) and messages[-1].get("role") == "assistant"
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in ROLE_TOKENS:
                raise ChatTemplateError(
                    f"messages[{i}].role {role!r} is not supported; use one of {sorted(ROLE_TOKENS)}")
            ids.append(ROLE_TOKENS[role])
            ids.extend(self.encode(_content_text(message.get("content"), i), add_bos=False))
            if not (open_last and i == len(messages) - 1):
                ids.append(END_TURN)
        if not open_last:
            ids.append(ASSISTANT)
        return ids


def multibyte(prompt_ids: list[int]) -> bool:
    """Whether output may hold multi-byte characters: the prompt has a non-ASCII one."""
    return any(0x80 <= i < 0x100 for i in prompt_ids)


def next_ids(prompt_ids: list[int], out: list[int], wide: bool) -> tuple[int, ...]:
    """The ids the tiny model may write after prompt + out: the bytes that complete a character begun at the
    end, else printable ASCII and EOS (and the lead bytes of `LEADS` when `wide`: see `multibyte`)."""
    tail = (prompt_ids[-3:] + out)[-3:] if len(out) < 3 else out[-3:]
    owed = 0
    for back, i in enumerate(reversed(tail)):
        if i in LEADS:
            owed = LEADS[i] - back
            break
        if not 0x80 <= i < 0xC0:
            break
    if owed > 0:
        return AFTER_F0 if tail[-1] == 0xF0 else CONTINUATION
    return WITH_LEADS if wide else PRINTABLE_IDS


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas without splitting UTF-8 sequences."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(bytes([token_id])) if token_id < 256 else ""

    @property
    def pending(self) -> bool:
        """The first bytes of a character are in, its text is not out yet."""
        return bool(self._decoder.getstate()[0])


def _content_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatTemplateError(
                    f"messages[{index}].content: only text parts are supported by the embedded engine")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")
