"""`python -m bench.kernels sm120_reference render A.json B.json`: two mode runs' JSON (two processes, since forcing
the GPU class is per process) -> the committed tables, without a GPU."""

from __future__ import annotations

import json


def _mode_file(tmp_path, mode, cfgs, gluon_why=None):
    rows = [dict(layer="c4", B=b, heads=16, cfg=c, diff=0.002, ref_max=0.35, us=10.0 + b + i)
            for b in (1, 8) for i, c in enumerate(cfgs)]
    path = tmp_path / f"{mode}.json"
    path.write_text(json.dumps(dict(mode=mode, device="GPU X", gluon_api_unavailable=gluon_why,
                                    versions={"torch": "2.11", "triton": "3.8.0"}, rows=rows)))
    return path


def test_render_merges_the_mode_runs_into_the_committed_tables(tmp_path, monkeypatch):
    # imported here, not at collection: the kernel modules must first be imported after tests/conftest.py set
    # TRITON_INTERPRET (read when a @triton.jit function is defined), or every interpreter test of this worker fails
    from bench import kernels, sm120_reference

    monkeypatch.setattr(sm120_reference, "RESULTS", tmp_path)
    a = _mode_file(tmp_path, "sm90", ["sm90_auto", "h16_triton"])
    b = _mode_file(tmp_path, "h16only", ["h16_triton", "h16_mma2_w4"], gluon_why="not on this build")
    assert kernels.main(["sm120_reference", "render", str(a), str(b)]) == 0
    result = json.loads((tmp_path / "sm120_reference.json").read_text())
    assert list(result["runs"]) == [sm120_reference.TITLES["sm90"], sm120_reference.TITLES["h16only"]]
    md = (tmp_path / "sm120_reference.md").read_text()
    assert "| B | sm90_auto | h16_triton |" in md and "| 8 | 18.0 | 19.0 |" in md
    assert "| B | h16_triton | h16_mma2_w4 |" in md
    assert "checked `gluon_api_unavailable()` is None" in md  # the sm90 run's check, recorded
