"""The plugin's own logic without SGLang: its settings from the environment and its device counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsv4_cluster.kernels.sglang_plugin.attestation import CounterPublisher, read_json
from dsv4_cluster.kernels.sglang_plugin.install import Counters, holds_adapter
from dsv4_cluster.kernels.sglang_plugin.settings import (
    ATTEST_DIR_ENV, KERNELS_ENV, PluginSettingsError, settings_from_env)
from tests.helpers import wait_for


def test_inert_without_the_env_var() -> None:
    assert settings_from_env({}).active is False
    assert settings_from_env({KERNELS_ENV: " "}).active is False


def test_kernels_and_folder_from_env() -> None:
    s = settings_from_env({KERNELS_ENV: "topk, indexer", ATTEST_DIR_ENV: "/x"})
    assert (s.kernels, s.attest_dir, s.active) == (("topk", "indexer"), "/x", True)


@pytest.mark.parametrize("env, message", [
    ({KERNELS_ENV: "topk,flash", ATTEST_DIR_ENV: "/x"}, "unknown kernel(s) flash"),
    ({KERNELS_ENV: "topk"}, f"{ATTEST_DIR_ENV} is not"),
])
def test_bad_env_is_refused_by_name(env: dict, message: str) -> None:
    with pytest.raises(PluginSettingsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings_from_env(env)


def test_counted_adapter_bumps_its_counter_and_is_recognised(tmp_path: Path) -> None:
    from dsv4_cluster.kernels import sglang_adapters

    counters = Counters("cpu")
    wrapped = counters.counted("topk", sglang_adapters.topk_transform_paged_v2)
    assert holds_adapter(wrapped, "topk") and not holds_adapter(sglang_adapters.topk_transform_paged_v2, "topk")
    counters.bump("topk")
    counters.bump("topk")
    counters.bump("indexer")
    publisher = CounterPublisher(tmp_path, 3, counters)
    publisher.publish()
    assert read_json(tmp_path / "counters-rank3.json")["counts"] == {"sparse_mla_decode": 0, "indexer": 1, "topk": 2,
                                                                 "sparse_mla_decode_stock": 0,
                                                                 "sparse_mla_decode_metadata": 0}


def test_counter_publisher_keeps_publishing_after_a_failed_snapshot(tmp_path: Path, monkeypatch) -> None:
    from dsv4_cluster.kernels.sglang_plugin import attestation

    monkeypatch.setattr(attestation, "COUNTER_PERIOD_S", 0.05)
    counters = Counters("cpu")
    publisher = CounterPublisher(tmp_path, 0, counters)
    calls = {"n": 0}
    real = publisher.snapshot

    def flaky() -> list[int]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return real()

    monkeypatch.setattr(publisher, "snapshot", flaky)
    publisher.start()
    counters.bump("indexer")
    try:
        wait_for(lambda: calls["n"] >= 4, 10, "4 snapshots", interval_s=0.02)
    finally:
        publisher.stop()
    assert calls["n"] >= 4 and publisher.last_error and "capturing" in publisher.last_error
    assert read_json(tmp_path / "counters-rank0.json")["counts"]["indexer"] == 1
