"""The `prefix` policy's memory: an approximate radix tree of the prompts each prefill worker has seen.

The router does not tokenize, so, like SGLang's `cache_aware` router, it works on the prompt's text: the text is cut
into blocks of `BLOCK_CHARS` characters and block i is named by a hash chained over blocks 0..i (Python's own
64-bit hash: the names live in this process only), so one set of names per worker is a radix tree of everything
sent there (a name is in the set iff that whole prefix was). A worker's match for a prompt is how many of its
leading blocks are in the worker's set. One index, name -> workers holding it, finds the longest match over all
workers with a binary search over the prompt's blocks (O(log blocks), not O(workers x log blocks): at 64 prefills
and a 10k-character prompt that took 0.8 ms of the router's single thread per request). Each worker's set keeps its
`capacity` most recently used names (LRU), as a prefill's own cache keeps its recently used pages; that is why it
is approximate: the router forgets what the worker may still hold and may remember what it evicted.

The choice (`PrefixChooser.choose`), the rule stated once:
1. Among the eligible prefills, find the longest match (ties: the lower load, then round robin).
2. If it covers at least `threshold` of the prompt's blocks and its worker's load is within `balance_abs` of the
   least loaded worker's (load: requests in flight through this router + KV usage, as `least_load` counts it),
   send it there: the prefill will find that prefix in its cache.
3. Otherwise send it to the least loaded worker (ties round robin): no worker has enough of it, or the one that
   has is that much busier than another, and queueing behind it would cost more than recomputing.
4. Either way the chosen worker now has the whole prompt: its names are added to that worker's set.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Sequence

from .worker import Worker

BLOCK_CHARS = 64


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The text a request's prompt starts with, as the prefill will see it in order (chat: each message's role and
    content; completions: the prompt; /generate: the text or the token ids)."""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or ():
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, list):     # OpenAI content parts: their text, in order
                    content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
                parts.append(f"<{m.get('role')}>{content}")
        return "".join(parts)
    prompt = body.get("prompt") if path.endswith("/completions") else body.get("text", body.get("input_ids"))
    if isinstance(prompt, list):                  # a batch: its first item (the pair serves the whole batch)
        prompt = prompt[0] if prompt and isinstance(prompt[0], (str, list)) else prompt
    return prompt if isinstance(prompt, str) else ",".join(map(str, prompt or ()))


def block_names(text: str) -> list[int]:
    """The chained names of the text's whole blocks (a last partial block is not named: it is rarely shared)."""
    names, h = [], 0
    for i in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        h = hash((h, text[i:i + BLOCK_CHARS]))
        names.append(h)
    return names


class WorkerPrefixes:
    """One worker's set of block names, least recently used first out past `capacity`; `holders` (name -> worker
    names), when given, is kept in step with the set under the worker's `name`."""

    def __init__(self, capacity: int, holders: dict[int, set[str]] | None = None, name: str = "") -> None:
        self.capacity = capacity
        self._names: OrderedDict[int, None] = OrderedDict()
        self._holders, self._name = holders, name

    def match(self, names: list[int]) -> int:
        """How many of the leading names are in the set (a chain: once one is missing, the rest are too)."""
        lo, hi = 0, len(names)
        while lo < hi:                                     # the matched names are a prefix of `names`
            mid = (lo + hi + 1) // 2
            if names[mid - 1] in self._names:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, names: list[int]) -> None:
        own, holders = self._names, self._holders
        for n in names:
            if n in own:
                own.move_to_end(n)
                continue
            own[n] = None
            if holders is not None:
                holders.setdefault(n, set()).add(self._name)
        while len(own) > self.capacity:
            n = own.popitem(last=False)[0]
            if holders is not None:
                held = holders[n]
                held.discard(self._name)
                if not held:
                    del holders[n]

    def __len__(self) -> int:
        return len(self._names)


class PrefixChooser:
    """The `prefix` policy for prefill workers (see the module docstring for the rule)."""

    def __init__(self, threshold: float = 0.5, balance_abs: float = 2.0, capacity: int = 200_000) -> None:
        self.threshold, self.balance_abs, self.capacity = threshold, balance_abs, capacity
        self._trees: dict[str, WorkerPrefixes] = {}
        self._holders: dict[int, set[str]] = {}     # block name -> the workers whose set holds it
        self._turn = itertools.count()

    def tree(self, worker: Worker) -> WorkerPrefixes:
        if worker.name not in self._trees:
            self._trees[worker.name] = WorkerPrefixes(self.capacity, self._holders, worker.name)
        return self._trees[worker.name]

    def longest(self, names: list[int], eligible: set[str]) -> int:
        """The longest match among the `eligible` workers (a chain: who holds block i holds blocks 0..i-1)."""
        lo, hi = 0, len(names)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            held = self._holders.get(names[mid - 1])
            if held is not None and not held.isdisjoint(eligible):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def choose(self, eligible: Sequence[Worker], text: str | None) -> Worker:
        names = block_names(text or "")
        least = min(w.load for w in eligible)
        chosen = None
        if names:
            best = self.longest(names, {w.name for w in eligible})
            if best and best >= self.threshold * len(names):
                held = self._holders[names[best - 1]]
                top = [w for w in eligible if w.name in held]
                w = min(top, key=lambda x: x.load)
                if w.load - least <= self.balance_abs:
                    chosen = w
        if chosen is None:
            tied = [w for w in eligible if w.load == least]
            chosen = tied[next(self._turn) % len(tied)]
        if names:
            self.tree(chosen).add(names)
        return chosen
