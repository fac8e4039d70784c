"""The sampler (workers/engine/sampling.py) at extreme values: a valid temperature or top_p never fails (found by
schemathesis: a 500 from torch), and a tiny top_p still keeps the most likely token."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.workers.engine.sampling import Sampler, SamplingParams
from dsv4_cluster.workers.engine.tokenizer import PRINTABLE_IDS, VOCAB_SIZE


@pytest.mark.parametrize("temperature", [1e-6, 0.5, 2.0, 3e38, 1.7e308])
@pytest.mark.parametrize("top_p", [1.0, 0.5, 1e-300, 5e-324])
def test_sampling_never_fails_on_valid_extremes(temperature, top_p):
    logits = torch.randn(VOCAB_SIZE, generator=torch.Generator().manual_seed(1)) * 5
    token = Sampler(VOCAB_SIZE).sample(logits, SamplingParams(temperature=temperature, top_p=top_p, seed=7), 0)
    assert token in PRINTABLE_IDS


def test_a_tiny_top_p_keeps_the_most_likely_token():
    logits = torch.full((VOCAB_SIZE,), -5.0)
    logits[65] = 5.0
    params = SamplingParams(temperature=1.0, top_p=1e-300, seed=3)
    assert {Sampler(VOCAB_SIZE).sample(logits, params, step) for step in range(5)} == {65}
