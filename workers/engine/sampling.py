"""Sampling parameters and next-token selection.

Values are checked against `dsv4_cluster.request_schema` (SGLang's `SamplingParams.verify` ranges) also for
parameters built outside a body; a temperature below `SAMPLING_EPS` is greedy, as in SGLang (dividing by it would
give NaNs). `max_new_tokens` 0 is refused: this engine does not do prompt-only requests. Logprobs are SGLang
0.5.23's default: the log-softmax after the vocabulary mask and temperature, before top-p; alternatives most likely
first, ties to the lower id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4_cluster import request_schema

from .tokenizer import PRINTABLE_IDS

Allowed = tuple[int, ...]   # the ids a token may be drawn from (tokenizer.next_ids)

SAMPLING_EPS = 1e-6   # SGLang's _SAMPLING_EPS: below it, sampling is greedy


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    no_stop_trim: bool = False      # keep a matched stop string / stop token in the text
    logprobs: bool = False          # report each output token's logprob (and `top_logprobs` alternatives)
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        request_schema.check("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens == 0:
            raise ValueError("max_new_tokens 0 (a prompt-only request, no output) is not supported by the embedded "
                             "engine (SGLang's workers take it); ask for at least 1 token")
        request_schema.check("temperature", float(self.temperature))
        request_schema.check("top_p", float(self.top_p))
        if self.seed is not None:
            request_schema.check("sampling_seed", self.seed)
        request_schema.check("top_logprobs", self.top_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


@dataclass(frozen=True)
class TokenLogprob:
    """An output token's logprob and the `top_logprobs` most likely (token id, logprob), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def to_wire(self) -> list:
        """JSON-ready [logprob, [[id, logprob], ...]] (prefill -> decode in the KV notification)."""
        return [self.logprob, [list(t) for t in self.top]]

    @classmethod
    def from_wire(cls, value: object) -> TokenLogprob:
        """`to_wire`'s value back; ValueError or TypeError when malformed."""
        logprob, top = value
        return cls(float(logprob), tuple((int(i), float(lp)) for i, lp in top))


class Sampler:
    """Picks tokens from logits, restricted to the ids a request may write next (`tokenizer.next_ids`: printable
    ASCII and EOS, or the bytes of a whole multi-byte character)."""

    def __init__(self, vocab_size: int):
        self._vocab_size = vocab_size
        self._masks: dict[Allowed, torch.Tensor] = {}

    def _mask(self, allowed: Allowed) -> torch.Tensor:
        mask = self._masks.get(allowed)
        if mask is None:
            mask = self._masks[allowed] = torch.full((self._vocab_size,), float("-inf"))
            mask[list(allowed)] = 0.0
        return mask

    def sample_batch(self, logits: torch.Tensor, params: list[SamplingParams], steps: list[int],
                     allowed: list[Allowed] | None = None) -> list[int]:
        """`sample` for every row of logits [B, vocab]: the greedy rows in one argmax, the others one by one."""
        allowed = allowed or [PRINTABLE_IDS] * len(params)
        masks = torch.stack([self._mask(a) for a in allowed])
        greedy = torch.argmax(logits.float() + masks, dim=-1).tolist()
        return [g if p.greedy else self.sample(row, p, s, a)
                for g, row, p, s, a in zip(greedy, logits, params, steps, allowed)]

    def sample(self, logits: torch.Tensor, params: SamplingParams, step: int, allowed: Allowed = PRINTABLE_IDS) -> int:
        """logits [vocab] float32 -> token id for output position `step`. Greedy ties go to the lowest id.

        Random draws use a generator seeded from (params.seed, step), so the prefill process (step 0)
        and the decode process (steps 1..) continue one seeded sequence without sharing state.
        """
        logits = logits.float().cpu() + self._mask(allowed)
        if params.greedy:
            return int(torch.argmax(logits))
        # in float64: a temperature past float32's range would turn the -inf of masked ids into NaN
        probs = torch.softmax(logits.double() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < params.top_p
            keep[0] = True   # the most likely token always stays (as in SGLang), however small top_p is
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        gen = torch.Generator()
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed((params.seed * 1_000_003 + step) % (2**63))
        return int(torch.multinomial(probs, 1, generator=gen))

    def logprobs(self, logits: torch.Tensor, params: SamplingParams, token: int,
                 allowed: Allowed = PRINTABLE_IDS) -> TokenLogprob:
        """logits [vocab] the token was drawn from (as `sample` got them) -> its logprob and the top alternatives."""
        scaled = logits.double().cpu() + self._mask(allowed)
        if not params.greedy:
            scaled = scaled / params.temperature
        logp = torch.log_softmax(scaled, dim=-1)
        top = ()
        if params.top_logprobs:
            values, ids = torch.sort(logp, descending=True, stable=True)
            top = tuple(zip(ids[:params.top_logprobs].tolist(), values[:params.top_logprobs].tolist()))
        return TokenLogprob(float(logp[token]), top)

    def logprobs_batch(self, logits: torch.Tensor, params: list[SamplingParams], tokens: list[int],
                       allowed: list[Allowed] | None = None) -> list[TokenLogprob | None]:
        """`logprobs` for the rows whose request asked for them (None for the others)."""
        allowed = allowed or [PRINTABLE_IDS] * len(params)
        return [self.logprobs(row, p, t, a) if p.logprobs else None
                for row, p, t, a in zip(logits, params, tokens, allowed)]
