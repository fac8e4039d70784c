"""The `prefix` policy for prefill workers: its settings (the router setting `policy.prefix`) and its choice.

The choice (`PrefixChooser.choose`), the rule stated once:
1. Among the eligible prefills, find the longest match of the prompt's blocks (`prefix_tree.py`).
2. It is this prompt's *history* when it ends where no other prompt went on (a session's previous turn ends there:
   `PrefixIndex.extends_a_leaf`) and covers at least `threshold` of the prompt's blocks. A match that ends where
   other prompts branched off is a prefix they share (a system prompt every session starts with): it draws the
   request only within the tighter `shared_balance_abs` (step 4), so that the few prefills holding it do not take
   every new session.
3. History whose least loaded holder is within `balance_abs` of the least loaded eligible worker (load: requests in
   flight through this router + KV usage, as `least_load` counts it) goes there: that prefill has it in its cache.
4. Otherwise (a new session, or a holder that much busier) the prompt goes by the prefix it shares with others:
   among the prefills within `shared_balance_abs` of the least loaded, those holding the longest part of it (at
   least `threshold` of the prompt) that can take the rest without evicting (else all of them), the least loaded of
   these, ties round robin.
5. Either way the chosen worker now holds the whole prompt: its names are added to that worker's set, whose size
   follows the worker's KV capacity (`/server_info`'s `max_total_num_tokens`, read by the health checks).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from .prefix_tree import BYTES_PER_NAME, PrefixIndex, WorkerPrefixes, block_names
from .worker import Worker


class PrefixPolicy(BaseModel):
    """The `prefix` policy's knobs (the router setting `policy.prefix`, in the topology `router.policy.prefix`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    threshold: float = Field(default=0.5, gt=0, le=1, description="share of a prompt's blocks a prefill's copy of "
                             "its history must cover for the request to follow it")
    balance_abs: float = Field(default=2.0, ge=0, description="how much busier (requests in flight + KV usage) "
                               "than the least loaded prefill the holder of a history may be and still get it")
    shared_balance_abs: float = Field(default=1.0, ge=0, description="how much busier than the least loaded "
                                      "prefill one holding a prefix other prompts share (a system prompt) may be and "
                                      "still get a new prompt that starts with it")
    block_chars: int = Field(default=64, ge=8, description="characters per named block of a prompt")
    chars_per_token: float = Field(default=4.0, gt=0, description="characters per token, to size each prefill's "
                                   "memory from its KV capacity in tokens")
    max_names_per_worker: int = Field(default=200_000, ge=16, description=f"cap on one prefill's remembered blocks "
                                      f"(~{BYTES_PER_NAME} B each), and the size used until its KV capacity is known")

    def names_for(self, kv_tokens: int | None) -> int:
        """How many blocks a prefill of `kv_tokens` KV tokens can hold (all of its KV holding prompt pages), capped."""
        if not kv_tokens:
            return self.max_names_per_worker
        return max(16, min(self.max_names_per_worker, int(kv_tokens * self.chars_per_token / self.block_chars)))


class PrefixChooser:
    """The `prefix` policy's state and choice (the module docstring states the rule)."""

    def __init__(self, policy: PrefixPolicy | None = None) -> None:
        self.policy = policy or PrefixPolicy()
        self.index = PrefixIndex()
        self._trees: dict[str, WorkerPrefixes] = {}
        self._bits: dict[str, int] = {}
        self._turn = itertools.count()

    def bit(self, worker: Worker) -> int:
        if worker.name not in self._bits:
            self._bits[worker.name] = 1 << len(self._bits)
        return self._bits[worker.name]

    def tree(self, worker: Worker) -> WorkerPrefixes:
        tree = self._trees.get(worker.name)
        if tree is None:
            tree = self._trees[worker.name] = WorkerPrefixes(0, self.index, self.bit(worker))
        tree.capacity = self.policy.names_for(worker.kv_tokens)
        return tree

    def names(self) -> int:
        """Blocks remembered over all workers (a name two workers hold counts twice)."""
        return sum(len(t) for t in self._trees.values())

    def _warmest(self, tied: list[Worker], names: list[int]) -> list[Worker]:
        """Of these workers, those holding the longest part of the prompt (a prefix it shares with others, at least
        `threshold` of it) that can take the rest of it without evicting; all of them when none can."""
        mask = 0
        for w in tied:
            mask |= self._bits[w.name]
        k = self.index.longest(names, mask)
        if not k or k < self.policy.threshold * len(names):
            return tied
        held = self.index.holders(names[k - 1]) & mask
        room = [w for w in tied if self._bits[w.name] & held
                and len(tree := self.tree(w)) + len(names) - k <= tree.capacity]
        return room or tied

    def choose(self, eligible: Sequence[Worker], text: str | None) -> Worker:
        p, bits = self.policy, self._bits
        names = block_names(text or "", p.block_chars)
        loads = [w.load for w in eligible]
        least = min(loads)
        chosen = None
        if names:
            mask = 0
            for w in eligible:
                mask |= bits.get(w.name) or self.bit(w)
            best = self.index.longest(names, mask)
            if best and best >= p.threshold * len(names) and self.index.extends_a_leaf(names, best):
                held = self.index.holders(names[best - 1]) & mask
                load, at = min((load, i) for i, (w, load) in enumerate(zip(eligible, loads)) if bits[w.name] & held)
                if load - least <= p.balance_abs:
                    chosen = eligible[at]
        if chosen is None:
            tied = [w for w, load in zip(eligible, loads) if load <= least + p.shared_balance_abs]
            if names and len(tied) > 1:
                tied = self._warmest(tied, names)
            low = min(w.load for w in tied)
            tied = [w for w in tied if w.load == low]
            chosen = tied[next(self._turn) % len(tied)]
        if names:
            self.tree(chosen).add(names)
        return chosen
