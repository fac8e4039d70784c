"""Batched, chunked prefill: several prompts per forward, long ones split by a token budget, same result."""

from __future__ import annotations

import pytest
import torch

from dsv4_cluster.kernels.indexer.reference import indexer_ref as indexer
from dsv4_cluster.kernels.topk.reference import topk_ref as topk
from dsv4_cluster.workers.engine.model import ModelConfig
from dsv4_cluster.workers.engine.selection import select_rows as _select_rows, select_shared_table as _select_shared_table
from dsv4_cluster.workers.engine.runner import Chunk, ModelRunner, RunnerConfig


@pytest.mark.parametrize("tokens,pages,first_pos", [(210, 14, 14), (5, 3, 0), (37, 10, 100), (512, 40, 128)])
def test_shared_table_selection_equals_the_kernels_reference(tokens, pages, first_pos):
    gen = torch.Generator().manual_seed(tokens)
    keys = torch.randn(64, 4, 32, generator=gen)
    table = torch.full((128,), -1, dtype=torch.int32)
    table[:pages] = torch.randperm(64, generator=gen)[:pages].to(torch.int32)
    positions = torch.arange(first_pos, first_pos + tokens)
    live = ((positions + 1) // 4).to(torch.int32).clamp(max=pages * 4)
    q, w = torch.randn(tokens, 4, 32, generator=gen), torch.randn(tokens, 4, generator=gen)
    expected = topk(indexer(q, w, keys, table.clamp(min=0)[None].expand(tokens, -1).contiguous(), live), live, 8)
    assert torch.equal(_select_shared_table(q, w, keys, table, live, 8), expected)


@pytest.mark.parametrize("rows", [1, 3, 16, 64])
def test_per_row_selection_equals_the_kernels_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    keys = torch.randn(256, 4, 32, generator=gen)
    lens = torch.randint(1, 60, (rows,), generator=gen)
    tables = torch.full((rows, 64), -1, dtype=torch.int32)
    for r, n in enumerate(lens.tolist()):
        tables[r, :n] = torch.randperm(256, generator=gen)[:n].to(torch.int32)
    positions = torch.stack([torch.randint(0, int(n) * 16, (1,), generator=gen)[0] for n in lens])
    live = ((positions + 1) // 4).to(torch.int32)
    q, w = torch.randn(rows, 4, 32, generator=gen), torch.randn(rows, 4, generator=gen)
    expected = topk(indexer(q, w, keys, tables.clamp(min=0), live), live, 8)
    assert torch.equal(_select_rows(q, w, keys, tables, live, 8), expected)


def _runner() -> ModelRunner:
    return ModelRunner(RunnerConfig(model=ModelConfig(), page_size=16, max_total_tokens=4096, context_length=1024))


def test_chunked_and_batched_prefill_equal_one_prompt_at_a_time():
    runner = _runner()
    prompts = [[32 + i % 95 for i in range(n)] for n in (7, 150, 333)]
    whole = []
    for ids in prompts:
        pages = runner.pool.alloc(len(ids))
        whole.append(runner.prefill(ids, pages))
        runner.pool.release(pages)
    pages = [runner.pool.alloc(len(ids)) for ids in prompts]
    # step 1: all of the short prompt, 100 tokens of the second; step 2: the rest of both long ones
    first = runner.extend([Chunk(prompts[0], 0, pages[0]), Chunk(prompts[1][:100], 0, pages[1]),
                           Chunk(prompts[2][:64], 0, pages[2])])
    second = runner.extend([Chunk(prompts[1][100:], 100, pages[1]), Chunk(prompts[2][64:], 64, pages[2])])
    for got, expected in zip([first[0], second[0], second[1]], whole):
        assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4)
        assert int(got.argmax()) == int(expected.argmax())
