"""Sampling parameters and next-token selection (greedy when temperature is 0)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .tokenizer import PRINTABLE_IDS


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


class Sampler:
    """Picks tokens from logits, restricted to printable ASCII and EOS (see tokenizer.PRINTABLE_IDS)."""

    def __init__(self, vocab_size: int):
        mask = torch.full((vocab_size,), float("-inf"))
        mask[list(PRINTABLE_IDS)] = 0.0
        self._mask = mask

    def sample(self, logits: torch.Tensor, params: SamplingParams, step: int) -> int:
        """logits [vocab] float32 -> token id for output position `step`. Greedy ties go to the lowest id.

        Random draws use a generator seeded from (params.seed, step), so the prefill process (step 0)
        and the decode process (steps 1..) continue one seeded sequence without sharing state.
        """
        logits = logits.float().cpu() + self._mask
        if params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < params.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        gen = torch.Generator()
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed((params.seed * 1_000_003 + step) % (2**63))
        return int(torch.multinomial(probs, 1, generator=gen))
