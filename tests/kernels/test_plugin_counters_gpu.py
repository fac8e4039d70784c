"""The plugin's counter publisher beside a CUDA-graph capture on the GPU: SGLang captures its decode graphs in
CUDA's global capture mode while our publisher thread copies the counters every second. On the H200 that copy
once invalidated the capture of SGLang's own backend ("operation not permitted when stream is capturing")."""

from __future__ import annotations

import threading

import pytest
import torch

from dsv4_cluster.kernels.sglang_plugin.attestation import CounterPublisher, read_json
from dsv4_cluster.kernels.sglang_plugin.install import Counters

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_gpu_publisher_copies_while_another_thread_captures_and_the_capture_holds(tmp_path):
    counters = Counters("cuda")
    publisher = CounterPublisher(tmp_path, 0, counters)
    publisher.publish()  # its stream and pinned buffer are made here, outside any capture
    x = torch.zeros(1024, device="cuda")
    inside, copied, result = threading.Event(), threading.Event(), {}

    def side() -> None:  # what the publisher's thread does: relax, then copy while the capture is open
        from dsv4_cluster.kernels.sglang_plugin.attestation import relax_capture_mode

        result["relaxed"] = relax_capture_mode()
        inside.wait(10)
        try:
            result["counts"] = publisher.snapshot()
        except Exception as e:  # reported below, not swallowed
            result["error"] = f"{type(e).__name__}: {e}"
        copied.set()

    thread = threading.Thread(target=side)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # torch's default: global capture mode, as SGLang captures
        counters.bump("sparse_mla_decode")
        x.add_(1)
        inside.set()
        assert copied.wait(10)
        x.mul_(3)
    thread.join()
    assert result.get("relaxed") is True and "error" not in result, result
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert x[0].item() == 12 and counters.values.tolist()[0] == 2  # ((0 + 1) * 3 + 1) * 3; two replays counted
    publisher.publish()
    assert read_json(tmp_path / "counters-rank0.json")["counts"]["sparse_mla_decode"] == 2
