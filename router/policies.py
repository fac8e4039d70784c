"""How one worker is chosen among the eligible workers of a role (`RouterSettings.prefill_policy` /
`decode_policy`, from the topology's `router.policy`).

- `round_robin`: each in turn.
- `random`: uniformly at random.
- `least_load`: the lowest load, where load = requests in flight through this router + the worker's
  reported KV token usage (0..1, `sglang:token_usage` from its `/metrics`, polled with the health checks);
  ties go round robin.
- `power_of_two`: two at random, the less loaded of them (load as above).

`POLICIES` is the one registry: a policy is a function of (chooser, eligible workers) and whether it reads
the workers' reported load (then the health checks poll `/metrics` too). Adding one is one line there; the
settings, the topology schema and their error messages read the names from it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Annotated, Callable, Sequence

from pydantic import AfterValidator

from .worker import Worker


class Chooser:
    """One role's policy with its own turn counter and random source."""

    def __init__(self, policy: str, seed: int | None = None) -> None:
        self.policy = POLICIES[policy]
        self.turn = itertools.count()
        self.rng = random.Random(seed)

    def choose(self, eligible: Sequence[Worker]) -> Worker:
        if len(eligible) == 1:
            return eligible[0]
        return self.policy.choose(self, eligible)


def _round_robin(c: Chooser, eligible: Sequence[Worker]) -> Worker:
    return eligible[next(c.turn) % len(eligible)]


def _random(c: Chooser, eligible: Sequence[Worker]) -> Worker:
    return c.rng.choice(eligible)


def _least_load(c: Chooser, eligible: Sequence[Worker]) -> Worker:
    best = min(w.load for w in eligible)
    return _round_robin(c, [w for w in eligible if w.load == best])


def _power_of_two(c: Chooser, eligible: Sequence[Worker]) -> Worker:
    a, b = c.rng.sample(eligible, 2)
    return a if a.load <= b.load else b


@dataclass(frozen=True)
class PolicySpec:
    choose: Callable[[Chooser, Sequence[Worker]], Worker]
    weighs_load: bool  # reads the workers' reported KV usage (the health checks poll /metrics for it)


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(_round_robin, weighs_load=False),
    "random": PolicySpec(_random, weighs_load=False),
    "least_load": PolicySpec(_least_load, weighs_load=True),
    "power_of_two": PolicySpec(_power_of_two, weighs_load=True),
}


def _known(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    return name


Policy = Annotated[str, AfterValidator(_known)]
