"""`bench/sglang_backend_report.compare`: how the device run's stock and plugin outputs are judged (no GPU needed)."""

from __future__ import annotations

import torch

from bench.sglang_backend_report import compare


def _save(path, outputs, topk):
    torch.save({"outputs": outputs, "topk": topk}, path)


def _case(tmp_path, swapped_rows: list[int], skew: float = 0.0):
    gen = torch.Generator().manual_seed(0)
    ref = {k: torch.randn(8, 16, 512, generator=gen) for k in ("window", "ratio4", "ratio128")}
    got = {k: v + 1e-4 * torch.randn(v.shape, generator=gen) for k, v in ref.items()}
    got["ratio128"] = got["ratio128"] + skew
    topk = torch.arange(8 * 512).view(8, 512)
    theirs = topk.clone()
    for r in swapped_rows:
        theirs[r, 7] = 10**6 + r  # one entry either side of a tie
        got["ratio4"][r] += 0.05 * ref["ratio4"][r]
    _save(tmp_path / "stock_outputs.pt", ref, topk)
    _save(tmp_path / "plugin_outputs.pt", got, theirs)
    return compare(tmp_path)


def test_swapped_rows_are_listed_and_left_out_of_the_ratio4_error(tmp_path):
    eq = _case(tmp_path, [0, 3])
    assert eq["ratio4"]["ok"] and eq["ratio4"]["rows"] == 6 and eq["ratio4"]["rel_error"] < 1e-3
    assert set(eq["ratio4"]["swapped_rows"]) == {"0", "3"} and eq["ratio4"]["swapped_rows"]["0"] > 0.04
    assert eq["topk"] == {"rows": 8, "rows_equal": 6, "max_swapped": 1, "sizes": [512], "ok": True}
    assert eq["window"]["rows"] == 8 and eq["window"]["ok"]


def test_a_real_difference_fails(tmp_path):
    assert not _case(tmp_path, [], skew=0.5)["ratio128"]["ok"]


def test_most_rows_swapped_fails_the_topk_check(tmp_path):
    assert not _case(tmp_path, [0, 1, 2, 3, 4])["topk"]["ok"]


def test_the_pool_holds_the_largest_batch_and_the_equality_case_without_doubling():
    """43 layers at 128 requests x 4,096 tokens (~70 GB) did not fit an H100; the equality case's 8 requests fit in
    what 128 x 2,048 take, and a run of only small batches still gets the equality case's 4,096 tokens."""
    from bench.sglang_backend import EQ_CASE, pool_shape
    from bench.sglang_backend_rig import request_pages as pages
    for batches, live, want in (([1, 8, 32, 64, 128], 2048, (128, 2048)), ([8], 2048, (8, 4096)),
                                ([1, 8], 4096, (8, 4096))):
        reqs, tokens = pool_shape(batches, live)
        assert (reqs, tokens) == want
        assert reqs * pages(tokens) >= max(max(batches) * pages(live), EQ_CASE["batch"] * pages(EQ_CASE["live"]))
