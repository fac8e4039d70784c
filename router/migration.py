"""Migration: a stream whose decode died (or was lost: its health checks failed) continues on a fresh pair instead of
ending with an error, so that a greedy stream interrupted by a decode's death equals the uninterrupted one byte for
byte (NVIDIA Dynamo's `--migration-limit`; docs/router.md, "What a request goes through", 6, says what the client
sees).

`resume.py` builds the continuation; this module splices its events onto the old stream: `/generate`'s cumulative
`text` / `output_ids` / logprobs prefixed with the old ones, legacy `text_offset`s shifted, usage counting the
relayed tokens as completion with the first attempt's `cached_tokens`, and the first stream's `id` and `created`
with no second `delta.role` (`Seam`). At most `migration_limit` times; n > 1 and batches are not migrated. Events
are kept raw while the stream runs and parsed when a migration happens, or every `FOLD_AT` runs (so a long stream
holds a bounded number of them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from . import sse
from .errors import RouterError
from .resume import Progress, answer_docs, continuation, migratable, parse_event, progress, prompt_ids_in, strip_ids

if TYPE_CHECKING:
    from .attempt import Attempt
    from .settings import RouterSettings
    from .stream import StreamOwner

log = logging.getLogger(__name__)

FOLD_AT = 256  # runs of events kept raw before they are folded into the progress so far (bounds memory per stream)


def resumable(settings: RouterSettings, path: str, body: dict[str, Any]) -> bool:
    """Whether a stream of this request is continued when its decode dies."""
    return settings.migration_limit > 0 and migratable(path, body)


@dataclass(frozen=True)
class Seam:
    """What the client's stream already said about itself, which a continuation's events take over: its id and
    created time, and the first attempt's cached prompt tokens (None: not known)."""

    id: str | None = None
    created: int | None = None
    cached_tokens: int | None = None


def identity(path: str, event: bytes) -> tuple[str | None, int | None]:
    """The stream's id and created time, as its first event states them."""
    data = parse_event(event)
    if not isinstance(data, dict):
        return None, None
    if path == "/generate":
        meta = data.get("meta_info")
        return (meta.get("id") if isinstance(meta, dict) else None), None
    return data.get("id"), data.get("created")


def first_cached(path: str, content: bytes) -> int | None:
    """The cached prompt tokens the first attempt's prefill reported (its usage, or /generate's meta_info), from
    its whole answer (JSON, or SSE events); None when it did not say."""
    for data in answer_docs(content):
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


def splice(path: str, done: Progress, seam: Seam = Seam()) -> Callable[[bytes], bytes]:
    """Rewrites a continuation's events so that they read as the rest of the first stream, which sent `done`."""
    text, tokens = done.text, done.tokens

    def rewrite(event: bytes) -> bytes:
        data = parse_event(event)
        if not isinstance(data, dict):
            return event
        _take_over(path, data, seam)
        for choice in data.get("choices") or ():   # legacy completions: offsets in the whole output text
            offsets = (choice.get("logprobs") or {}).get("text_offset")
            if isinstance(offsets, list):
                choice["logprobs"]["text_offset"] = [o + len(text) for o in offsets]
        if done.prompt_ids is not None and "prompt_token_ids" in data:   # /generate's, in every event: the first's
            data["prompt_token_ids"] = done.prompt_ids
        for choice in data.get("choices") or ():   # a completions chunk's: on the stream's first chunk only
            choice.pop("prompt_token_ids", None)
        if path == "/generate":
            data["text"] = text + data.get("text", "")
            if "output_ids" in data:
                data["output_ids"] = done.ids + data["output_ids"]
            meta = data.get("meta_info")
            if isinstance(meta, dict):
                meta["completion_tokens"] = meta.get("completion_tokens", 0) + tokens
                meta["prompt_tokens"] = meta.get("prompt_tokens", tokens) - tokens
                finish = meta.get("finish_reason")
                if isinstance(finish, dict) and finish.get("type") == "length" \
                        and isinstance(finish.get("length"), int):
                    finish["length"] += tokens   # the output budget, which the continuation had less of by as much
                if seam.cached_tokens is not None and "cached_tokens" in meta:
                    meta["cached_tokens"] = seam.cached_tokens
                for key, before in done.logprobs.items():
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
        # written as the worker wrote it: non-ASCII as UTF-8 (SGLang) or escaped (the embedded engine, json.dumps)
        return b"data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=event.isascii()).encode() + b"\n\n"
    return rewrite


class Migration:
    """The events a stream sent, and what a move to a fresh pair needs: the continuation's body, then the splice.
    The request that owns the stream (`Flight.relay`) starts the continuation's attempt."""

    def __init__(self, flight: StreamOwner) -> None:
        self.flight = flight
        self.left = flight.state.settings.migration_limit
        self.keep = resumable(flight.state.settings, flight.path, flight.body)
        self.strip = self.keep and flight.ids_asked
        self.sent: list[bytes] = []   # runs of events sent since the last fold
        self._folded = Progress()
        self._rewrite: Callable[[bytes], bytes] | None = None
        self._identity: tuple[str | None, int | None] | None = None   # the stream's id and created, from its start
        self._seam: Seam | None = None          # taken over by every continuation (from the first break on)
        self._prompt: list[int] | None = None   # /generate: the prompt's ids, as the first prefill reported them
        self._done = Progress()                 # what the stream said before its last break

    def outgoing(self, run: bytes) -> bytes:
        """The bytes to send for a run of complete events (spliced after a migration), remembered while migration is
        possible (as runs: split into events only when a migration or a fold reads them)."""
        if self._rewrite is not None:
            run = b"".join(self._rewrite(e) for e in sse.events(run))
        elif self.keep and self._identity is None and run:
            self._identity = identity(self.flight.path, sse.first_event(run))
        if self.keep:
            self.sent.append(run)
            if len(self.sent) >= FOLD_AT:
                self._folded, self.sent = progress(self.flight.path, self._sent_events(), self._folded), []
        return strip_ids(run) if self.strip else run

    def _sent_events(self) -> list[bytes]:
        return sse.events(b"".join(self.sent))

    def continuation(self, old: Attempt, broke: RouterError) -> dict[str, Any] | None:
        """The body that continues the stream on a fresh pair after `old` broke (counted against
        `migration_limit`); None when this stream cannot go on (then it ends with the break's error)."""
        if not self.keep or self.left <= 0:
            return None
        path = self.flight.path
        if self._seam is None:   # the stream's first attempt: what its prefill reported holds for the whole stream
            first = old.prefill.result() if old.prefill.done() and not old.prefill.cancelled() \
                and old.prefill.exception() is None and old.prefill.result().ok else None
            self._seam = Seam(*(self._identity or (None, None)),
                              cached_tokens=first_cached(path, first.content) if first is not None else None)
            self._prompt = prompt_ids_in(first.content) if first is not None and path == "/generate" else None
        done = progress(path, self._sent_events(), self._folded)
        if done.prompt_ids is None and self._prompt is not None:
            done = replace(done, prompt_ids=self._prompt)
        body = continuation(path, self.flight.upstream, done)
        if body is None:
            return None
        log.warning("rid %s: %s after %d tokens; continued from %s", old.req.rid, broke.message, done.tokens,
                    "text (its workers reported no prompt ids)" if done.prompt_ids is None else
                    f"{len(done.prompt_ids)} prompt + {len(done.ids)} output token ids")
        self.left -= 1
        self._done = done
        return body

    def continued(self) -> None:
        """The continuation streams: its events are spliced onto the stream from now on."""
        self.flight.state.metrics.migrations.inc()
        self._rewrite = splice(self.flight.path, self._done, self._seam)
