"""How one worker is chosen among the eligible workers of a role (the router setting `policy`: `PolicySettings`, also
the topology's `router.policy`).

- `round_robin`: each in turn.
- `random`: uniformly at random.
- `least_load`: the lowest load, where load = requests in flight through this router + the worker's
  reported KV token usage (0..1, `sglang:token_usage` from its `/metrics`, polled with the health checks);
  ties go round robin.
- `power_of_two`: two at random, the less loaded of them (load as above).
- `prefix` (prefill only): the worker that has seen the longest prefix of this prompt, unless it is much busier
  than the least loaded one (router/prefix_policy.py states the rule; its knobs are the setting `policy.prefix`):
  multi-turn chat finds its history's KV in that prefill's prefix cache.

`POLICIES` is the one registry: a policy is a function of (chooser, eligible workers, prompt), whether it reads
the workers' reported load (then the health checks poll `/metrics` too), whether it is for prefill workers only,
and the state it keeps per chooser. Adding one is one entry there; the settings, the topology schema and their
error messages read the names from it.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo

from .prefix_policy import PrefixChooser, PrefixPolicy
from .worker import Worker


class Chooser:
    """One role's policy with its own turn counter, random source and the policy's own state."""

    def __init__(self, policy: str, seed: int | None = None, prefix: PrefixPolicy | None = None) -> None:
        self.policy = POLICIES[policy]
        self.turn = itertools.count()
        self.rng = random.Random(seed)
        self.state = self.policy.state(prefix or PrefixPolicy()) if self.policy.state is not None else None

    def choose(self, eligible: Sequence[Worker], prompt: str | None = None) -> Worker:
        """One of `eligible` by the policy; `prompt`: the request's prompt text (the `prefix` policy's key)."""
        if len(eligible) == 1 and self.state is None:  # a stateful policy still records what it saw
            return eligible[0]
        return self.policy.choose(self, eligible, prompt)


def _round_robin(c: Chooser, eligible: Sequence[Worker], prompt: str | None) -> Worker:
    return eligible[next(c.turn) % len(eligible)]


def _random(c: Chooser, eligible: Sequence[Worker], prompt: str | None) -> Worker:
    return c.rng.choice(eligible)


def _least_load(c: Chooser, eligible: Sequence[Worker], prompt: str | None) -> Worker:
    best = min(w.load for w in eligible)
    return _round_robin(c, [w for w in eligible if w.load == best], prompt)


def _power_of_two(c: Chooser, eligible: Sequence[Worker], prompt: str | None) -> Worker:
    a, b = c.rng.sample(eligible, 2)
    return a if a.load <= b.load else b


def _prefix(c: Chooser, eligible: Sequence[Worker], prompt: str | None) -> Worker:
    return c.state.choose(eligible, prompt)


@dataclass(frozen=True)
class PolicySpec:
    choose: Callable[[Chooser, Sequence[Worker], str | None], Worker]
    weighs_load: bool  # reads the workers' reported KV usage (the health checks poll /metrics for it)
    prefill_only: bool = False  # aims at a prompt cache, which a decode does not have
    state: Callable[[PrefixPolicy], Any] | None = None  # what one chooser keeps between requests (made per chooser)


POLICIES: dict[str, PolicySpec] = {
    "round_robin": PolicySpec(_round_robin, weighs_load=False),
    "random": PolicySpec(_random, weighs_load=False),
    "least_load": PolicySpec(_least_load, weighs_load=True),
    "power_of_two": PolicySpec(_power_of_two, weighs_load=True),
    "prefix": PolicySpec(_prefix, weighs_load=True, prefill_only=True, state=PrefixChooser),
}


def _known(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; use one of {', '.join(POLICIES)}")
    return name


def _for_decode(name: str, info: ValidationInfo) -> str:
    if POLICIES[name].prefill_only:
        raise ValueError(f"{info.field_name} policy {name!r} is for prefill workers (a decode has no prompt cache to "
                         "aim at); use least_load or power_of_two for decode")
    return name


Policy = Annotated[str, AfterValidator(_known)]
DecodePolicy = Annotated[str, AfterValidator(_known), AfterValidator(_for_decode)]


class PolicySettings(BaseModel):
    """The router setting `policy`: each role's policy (a name in `POLICIES`) and the `prefix` policy's knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    prefill: Policy = Field(default="round_robin", description=f"how a prefill is chosen: {', '.join(POLICIES)}")
    decode: DecodePolicy = Field(default="round_robin", description="how a decode is chosen: " + ", ".join(
        name for name, spec in POLICIES.items() if not spec.prefill_only))
    prefix: PrefixPolicy = Field(default_factory=PrefixPolicy, description="the prefill `prefix` policy's knobs "
                                 "(docs/router.md, \"The prefix policy\")")
