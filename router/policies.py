"""How one worker is chosen among the eligible workers of a role (`RouterSettings.prefill_policy` /
`decode_policy`, from the topology).

- `round_robin`: each in turn.
- `random`: uniformly at random.
- `least_load`: the lowest load, where load = requests in flight through this router + the worker's
  reported KV token usage (0..1, `sglang:token_usage` from its `/metrics`, polled with the health checks);
  ties go round robin.
- `power_of_two`: two at random, the less loaded of them (load as above).
- `prefix` (prefill only): the worker that has seen the longest prefix of this prompt, unless it is much busier
  than the least loaded one (router/prefix_tree.py states the rule): multi-turn chat and shared system prompts find
  their KV in that prefill's prefix cache.
"""

from __future__ import annotations

import itertools
import random
from typing import Literal, Sequence

from .prefix_tree import PrefixChooser
from .worker import Worker

Policy = Literal["round_robin", "random", "least_load", "power_of_two", "prefix"]
POLICIES: tuple[str, ...] = ("round_robin", "random", "least_load", "power_of_two", "prefix")
PREFILL_ONLY: tuple[str, ...] = ("prefix",)     # a decode has no prompt cache to aim at


class Chooser:
    """One role's policy with its own turn counter and random source."""

    def __init__(self, policy: Policy, seed: int | None = None) -> None:
        self.policy = policy
        self._turn = itertools.count()
        self._rng = random.Random(seed)
        self._prefix = PrefixChooser() if policy == "prefix" else None

    def choose(self, eligible: Sequence[Worker], prompt: str | None = None) -> Worker:
        """One of `eligible` by the policy; `prompt`: the request's prompt text (the `prefix` policy's key)."""
        if self._prefix is not None:
            return self._prefix.choose(eligible, prompt)
        if len(eligible) == 1:
            return eligible[0]
        if self.policy == "round_robin":
            return eligible[next(self._turn) % len(eligible)]
        if self.policy == "random":
            return self._rng.choice(eligible)
        if self.policy == "power_of_two":
            a, b = self._rng.sample(eligible, 2)
            return a if a.load <= b.load else b
        best = min(w.load for w in eligible)
        tied = [w for w in eligible if w.load == best]
        return tied[next(self._turn) % len(tied)]
