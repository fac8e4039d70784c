"""The model's three kernel calls (sparse decode, indexer, top-k), dispatched and counted.

On CUDA a kernel named in `--kernels` runs our Triton/Gluon kernel (`dsv4_cluster.kernels` entry points), any
other runs the PyTorch reference op on the GPU; on CPU every op is the reference (the oracle). Every call adds one
to a counter on the model's device (`calls[kernel, impl] += 1`, a device-side add), so a CUDA-graph replay
advances the counters exactly as the eager calls it captured: `/server_info` reports what ran from these counts,
never from the flag. `counts()` reads them (a host sync; the engine thread calls it between steps).

Prefill chunks select compressed entries with whole-tensor torch ops on any device (`selection.py`): the indexer
and top-k kernels are decode kernels (one query row per request), and a chunk's rows share one page table.
"""

from __future__ import annotations

import torch

from dsv4_cluster.core import KERNEL_NAMES

from ..kernels.indexer import indexer as indexer_kernel
from ..kernels.sparse_mla_decode import sparse_mla_decode, sparse_mla_decode_ref
from ..kernels.topk import topk as topk_kernel

IMPLS = ("reference", "triton", "gluon")


class KernelOps:
    def __init__(self, device: str, requested: tuple[str, ...], n_heads: int, dtype: torch.dtype):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.kernel = {k: cuda and k in requested for k in KERNEL_NAMES}
        self.impl = {k: ("triton" if on else "reference") for k, on in self.kernel.items()}
        if self.kernel["sparse_mla_decode"]:
            from ..kernels.sparse_mla_decode.launch import gluon_unavailable

            probe = torch.empty(1, n_heads, 512, dtype=dtype, device=self.device)
            self.impl["sparse_mla_decode"] = "triton" if gluon_unavailable(probe, False) else "gluon"
        self.calls = torch.zeros(len(KERNEL_NAMES), len(IMPLS), dtype=torch.int64, device=self.device)
        self._slot = {k: (i, IMPLS.index(self.impl[k])) for i, k in enumerate(KERNEL_NAMES)}

    @property
    def all_kernels(self) -> bool:
        """Every op runs a kernel: nothing in a decode step syncs with the host (it can be graph-captured)."""
        return all(self.kernel.values())

    def _count(self, name: str, impl: str | None = None) -> None:
        i, j = self._slot[name] if impl is None else (KERNEL_NAMES.index(name), IMPLS.index(impl))
        self.calls[i, j] += 1

    def sparse_decode(self, q, kv, window_idx, extra_kv, extra_idx, sink) -> torch.Tensor:
        self._count("sparse_mla_decode")
        fn = sparse_mla_decode if self.kernel["sparse_mla_decode"] else sparse_mla_decode_ref
        return fn(q, kv, window_idx, extra_kv=extra_kv, extra_idx=extra_idx, sink=sink)[0]

    def indexer(self, q_idx, weights, keys, pages, live) -> torch.Tensor:
        """Scores [T, max_pages * E] (on CUDA only the live prefix of each row is written)."""
        self._count("indexer")
        return indexer_kernel(q_idx, weights, keys, pages, live)

    def topk(self, scores, live, k: int) -> torch.Tensor:
        self._count("topk")
        return topk_kernel(scores, live, k)

    def count_reference(self, *names: str) -> None:
        """Count ops the model ran as whole-tensor torch code (the reference formula) instead of a kernel."""
        for name in names:
            self._count(name, "reference")

    def counts(self) -> dict[str, dict[str, int]]:
        """{kernel: {impl: calls}} for every impl that ran at least once."""
        rows = self.calls.tolist()
        return {k: {impl: n for impl, n in zip(IMPLS, rows[i]) if n} for i, k in enumerate(KERNEL_NAMES)}

    @staticmethod
    def summary(counts: dict[str, dict[str, int]], requested: tuple[str, ...]) -> dict[str, str]:
        """{kernel: what ran}: the impls with calls, most first ("gluon", "reference", "triton+reference", ...);
        "off" for a kernel not requested that never ran as one, "not called yet" for a requested one without
        calls."""
        out = {}
        for name in KERNEL_NAMES:
            ran = sorted(counts.get(name, {}).items(), key=lambda kv: -kv[1])
            kernels_ran = [impl for impl, _ in ran if impl != "reference"]
            if name not in requested and not kernels_ran:
                out[name] = "off"
            else:
                out[name] = "+".join(impl for impl, _ in ran) or "not called yet"
        return out
