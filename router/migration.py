"""Migration: a stream whose decode died continues on a fresh pair instead of ending with an error.

The prompt plus what the client already received becomes the new prompt, the rest of the output budget
is carried over, and the new stream's events are spliced onto the old one, so that a greedy stream
interrupted by a decode's death equals the uninterrupted one (NVIDIA Dynamo's `--migration-limit`):

- chat: the text sent so far is appended as the final assistant message with `continue_final_message`
  (SGLang's and the embedded engine's way to continue a reply); `/v1/completions`: appended to `prompt`;
  `/generate`: appended to `text`, or the output ids to `input_ids`, and the new events' cumulative
  `text` / `output_ids` (and output logprobs) are prefixed with the old ones; legacy completions' `text_offset`s
  are shifted by the text sent (chat logprobs are per chunk: nothing to splice).
- `max_tokens` / `max_completion_tokens` / `max_new_tokens` shrink by the tokens already sent, as the worker reports
  them (`/generate`: `meta_info.completion_tokens`; OpenAI routes: per-chunk usage when the client asked for
  continuous usage stats, else each event's logprob entries, else one token per event, empty ones included:
  `event_tokens`). The continuation goes on from the text the client has (`input_ids` only for a `/generate`
  request given as ids): a token without text (an EOS with `ignore_eos`) or text still held back when the decode
  died is not in it, so such a stream can differ from the uninterrupted one from the seam on. The final
  usage counts move those tokens from prompt back to completion, so usage stays right, and `cached_tokens` is the
  first attempt's (its prefill's report), not the continuation's (whose prompt the first attempt just cached).
- The seam does not show: the continuation's events carry the first stream's `id` and `created` (`/generate`:
  `meta_info.id`), and no second `delta.role` (`Seam`).
- With no other decode eligible (the production topology has one), the stream is held up to `stream_hold_s` for
  the restarted one, then continued there the same way.
- At most `migration_limit` times per request; requests with several choices or prompts (n > 1, batches)
  are not migrated. Events are kept raw (as the runs relayed) while the stream runs and parsed when a migration
  happens, or every `FOLD_AT` runs (so a long stream holds a bounded number of them).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from . import sse
from .attempt import Attempt
from .errors import RouterError

if TYPE_CHECKING:
    from .stream import StreamOwner

MAX_KEYS = {"/v1/chat/completions": ("max_completion_tokens", "max_tokens"), "/v1/completions": ("max_tokens",)}


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


def _data(event: bytes) -> Any:
    text = sse.data_of(event).strip()
    if not text.startswith("{"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


Progress = tuple[str, list[int], int, dict[str, list]]   # text, output ids, tokens, /generate's logprob lists
LOGPROB_LISTS = ("output_token_logprobs", "output_top_logprobs")   # cumulative in /generate's meta_info
FOLD_AT = 256  # runs of events kept raw before they are folded into the progress so far (bounds memory per stream)


def progress(path: str, events: list[bytes], start: Progress = ("", [], 0, {})) -> Progress:
    """What the client already has, after `start`: its text, output ids and output logprobs (`/generate`), and how
    many tokens."""
    text, ids, tokens, logprobs = start
    for event in events:
        data = _data(event)
        if not isinstance(data, dict):
            continue
        if path == "/generate":
            text, ids = data.get("text", text), data.get("output_ids", ids)
            meta = data.get("meta_info", {})
            tokens = meta.get("completion_tokens", len(ids))
            logprobs = {k: meta[k] for k in LOGPROB_LISTS if isinstance(meta.get(k), list)} or logprobs
            continue
        usage = data.get("usage")
        for choice in data.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") if path == "/v1/chat/completions" else choice.get("text")
            text += piece or ""
            tokens += event_tokens(path, choice)
        if data.get("choices") and isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]   # continuous usage stats: the worker's own count so far
    return text, ids, tokens, logprobs


def event_tokens(path: str, choice: dict[str, Any]) -> int:
    """The tokens one streamed choice carries, as the worker reports them: one logprob entry each when logprobs
    were asked (SGLang's multi-token events, `stream_interval` > 1), else one per event, empty ones included (text
    held back for a stop string, or the first bytes of a character, come out with a later token's event)."""
    logprobs = choice.get("logprobs")
    entries = logprobs.get("content" if path == "/v1/chat/completions" else "tokens") \
        if isinstance(logprobs, dict) else None
    return len(entries) if isinstance(entries, list) else 1


def continuation(path: str, body: dict[str, Any], text: str, ids: list[int], tokens: int) -> dict | None:
    """The request that continues `body` after `text`; None when its output budget is spent."""
    new = copy.deepcopy(body)
    if path == "/generate":
        params = new.setdefault("sampling_params", {})
        if "max_new_tokens" in params:
            params["max_new_tokens"] -= tokens
            if params["max_new_tokens"] <= 0:
                return None
        if isinstance(new.get("text"), str):
            new["text"] += text
        else:
            new["input_ids"] = list(new["input_ids"]) + list(ids)
        return new
    for key in MAX_KEYS[path]:
        if isinstance(new.get(key), int):
            new[key] -= tokens
            if new[key] <= 0:
                return None
    if path == "/v1/completions":
        new["prompt"] += text
        return new
    messages = new["messages"]
    last = messages[-1] if messages else None
    if new.get("continue_final_message") and isinstance(last, dict) and last.get("role") == "assistant" \
            and isinstance(last.get("content"), str):
        last["content"] += text
    else:
        messages.append({"role": "assistant", "content": text})
    new["continue_final_message"] = True
    return new


@dataclass(frozen=True)
class Seam:
    """What the client's stream already said about itself, which a continuation's events take over: its id and
    created time, and the first attempt's cached prompt tokens (None: not known)."""

    id: str | None = None
    created: int | None = None
    cached_tokens: int | None = None


def identity(path: str, event: bytes) -> tuple[str | None, int | None]:
    """The stream's id and created time, as its first event states them."""
    data = _data(event)
    if not isinstance(data, dict):
        return None, None
    if path == "/generate":
        meta = data.get("meta_info")
        return (meta.get("id") if isinstance(meta, dict) else None), None
    return data.get("id"), data.get("created")


def first_cached(path: str, content: bytes) -> int | None:
    """The cached prompt tokens the first attempt's prefill reported (its usage, or /generate's meta_info), from
    its whole answer (JSON, or SSE events); None when it did not say."""
    docs = [_data(e) for e in content.split(b"\n\n")] if b"data:" in content else [_data(b"data: " + content)]
    for data in docs:
        if not isinstance(data, dict):
            continue
        if path == "/generate":
            cached = (data.get("meta_info") or {}).get("cached_tokens")
        else:
            cached = ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        if isinstance(cached, int):
            return cached
    return None


def _take_over(path: str, data: dict[str, Any], seam: Seam) -> None:
    """The continuation's event `data` speaks as the first stream: its id, created, and one role chunk."""
    if path == "/generate":
        if seam.id is not None and isinstance(data.get("meta_info"), dict):
            data["meta_info"]["id"] = seam.id
        return
    if seam.id is not None and "id" in data:
        data["id"] = seam.id
    if seam.created is not None and "created" in data:
        data["created"] = seam.created
    for choice in data.get("choices") or ():
        if isinstance(choice.get("delta"), dict):
            choice["delta"].pop("role", None)


def splice(path: str, text: str, ids: list[int], tokens: int, logprobs: dict[str, list],
           seam: Seam = Seam()) -> Callable[[bytes], bytes]:
    """Rewrites a continuation's events so that they read as the rest of the first stream."""
    def rewrite(event: bytes) -> bytes:
        data = _data(event)
        if not isinstance(data, dict):
            return event
        _take_over(path, data, seam)
        for choice in data.get("choices") or ():   # legacy completions: offsets in the whole output text
            offsets = (choice.get("logprobs") or {}).get("text_offset")
            if isinstance(offsets, list):
                choice["logprobs"]["text_offset"] = [o + len(text) for o in offsets]
        if path == "/generate":
            data["text"] = text + data.get("text", "")
            if "output_ids" in data:
                data["output_ids"] = list(ids) + data["output_ids"]
            meta = data.get("meta_info")
            if isinstance(meta, dict):
                meta["completion_tokens"] = meta.get("completion_tokens", 0) + tokens
                meta["prompt_tokens"] = meta.get("prompt_tokens", tokens) - tokens
                if seam.cached_tokens is not None and "cached_tokens" in meta:
                    meta["cached_tokens"] = seam.cached_tokens
                for key, before in logprobs.items():
                    if isinstance(meta.get(key), list):
                        meta[key] = before + meta[key]
                if "output_token_logprobs_length" in meta and "output_token_logprobs" in meta:
                    meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        usage = data.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= tokens
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + tokens
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                # the first attempt's count; else, of the client's prompt, at most all
                details["cached_tokens"] = seam.cached_tokens if seam.cached_tokens is not None else \
                    min(details["cached_tokens"], usage["prompt_tokens"])
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    return rewrite


class Migration:
    """The stream's current attempt, the events it sent, and the move to a fresh pair."""

    def __init__(self, flight: StreamOwner, attempt: Attempt) -> None:
        self.flight, self.attempt = flight, attempt
        self.left = flight.state.settings.migration_limit
        self.keep = self.left > 0 and migratable(flight.path, flight.body)
        self.sent: list[bytes] = []   # runs of events sent since the last fold
        self._folded: Progress = ("", [], 0, {})
        self._rewrite: Callable[[bytes], bytes] | None = None
        self._identity: tuple[str | None, int | None] | None = None   # the stream's id and created, from its start

    def outgoing(self, run: bytes) -> bytes:
        """The bytes to send for a run of complete events (spliced after a migration), remembered while migration is
        possible (as runs: split into events only when a migration or a fold reads them)."""
        if self._rewrite is not None:
            run = b"".join(self._rewrite(e) for e in sse.events(run))
        elif self.keep and self._identity is None and run:
            self._identity = identity(self.flight.path, sse.events(run)[0])
        if self.keep:
            self.sent.append(run)
            if len(self.sent) >= FOLD_AT:
                self._folded, self.sent = progress(self.flight.path, self._sent_events(), self._folded), []
        return run

    def _sent_events(self) -> list[bytes]:
        return sse.events(b"".join(self.sent))

    async def next_attempt(self, broke: RouterError) -> bool:
        """Continue on a fresh pair; False when this stream cannot (then it ends with the break's error)."""
        if not self.keep or self.left <= 0 or self.flight.gone:
            return False
        path = self.flight.path
        text, ids, tokens, logprobs = progress(path, self._sent_events(), self._folded)
        body = continuation(path, self.flight.body, text, ids, tokens)
        if body is None:
            return False
        self.left -= 1
        old = self.attempt
        try:
            # with no decode that answers (the only one died), held up to `stream_hold_s` for its restart
            attempt = await self.flight.start(body, avoid={old.req.pair.decode}, failed=broke, counted=False)
        except RouterError:
            return False
        finally:
            old.req.pair.release()
        decode = attempt.decode
        if not decode.ok or not decode.content_type.startswith("text/event-stream"):
            attempt.abort_both()
            return False
        self.flight.state.metrics.migrations.inc()
        self.attempt = attempt
        first = old.prefill.result() if old.prefill.done() and not old.prefill.cancelled() \
            and old.prefill.exception() is None else None
        seam = Seam(*(self._identity or (None, None)),
                    cached_tokens=first_cached(path, first.content) if first is not None and first.ok else None)
        self._rewrite = splice(path, text, ids, tokens, logprobs, seam)
        return True
