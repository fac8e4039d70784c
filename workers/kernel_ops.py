"""The model's three kernel calls (sparse decode, indexer, top-k), dispatched and counted.

On CUDA a kernel named in `--kernels` runs our Triton/Gluon kernel (the `*_triton` entry points of
`dsv4_cluster.kernels`), any other runs the PyTorch reference op on the GPU; on CPU every op is the reference (the
oracle). Every call adds one
to a counter on the model's device (`calls[kernel, impl] += 1`, a device-side add), so a CUDA-graph replay
advances the counters exactly as the eager calls it captured: `/server_info` reports what ran from these counts,
never from the flag. `counts()` reads them (a host sync; the engine thread calls it between steps).

Prefill chunks select compressed entries with whole-tensor torch ops on any device (`selection.py`): the indexer
and top-k kernels are decode kernels (one query row per request), and a chunk's rows share one page table.
"""

from __future__ import annotations

import torch

from dsv4_cluster.core import KERNEL_NAMES

from ..kernels.indexer.reference import indexer_ref
from ..kernels.sparse_mla_decode import sparse_mla_decode_ref
from ..kernels.topk.reference import topk_ref

IMPLS = ("reference", "triton", "gluon")


class KernelOps:
    def __init__(self, device: str, requested: tuple[str, ...], n_heads: int, dtype: torch.dtype):
        self.device = torch.device(device)
        self.kernel = {k: False for k in KERNEL_NAMES}
        self.impl = {k: "reference" for k in KERNEL_NAMES}
        self.calls = torch.zeros(len(KERNEL_NAMES), len(IMPLS), dtype=torch.int64, device=self.device)
        self._slot = {k: (i, 0) for i, k in enumerate(KERNEL_NAMES)}
        if self.device.type == "cuda":
            self.route(tuple(k for k in requested if k in KERNEL_NAMES), n_heads, dtype)

    def route(self, names: tuple[str, ...], n_heads: int, dtype: torch.dtype) -> None:
        """Run `names` on our kernels (`*_triton` entry points; the sparse decode picks Gluon where it applies).
        CUDA workers route what --kernels asks for; on CPU tensors the kernels run only under TRITON_INTERPRET=1
        (tests/kernels/test_engine_kernel_path.py routes them there)."""
        for k in names:
            self.kernel[k], self.impl[k] = True, "triton"
        if "sparse_mla_decode" in names:
            from ..kernels.sparse_mla_decode.launch import gluon_unavailable

            probe = torch.empty(1, n_heads, 512, dtype=dtype, device=self.device)
            self.impl["sparse_mla_decode"] = "triton" if gluon_unavailable(probe, False) else "gluon"
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
        if self.kernel["sparse_mla_decode"]:
            from ..kernels.sparse_mla_decode.launch import sparse_mla_decode_triton

            return sparse_mla_decode_triton(q, kv, window_idx, extra_kv, extra_idx, sink)[0]
        return sparse_mla_decode_ref(q, kv, window_idx, extra_kv, extra_idx, sink)[0]

    def indexer(self, q_idx, weights, keys, pages, live) -> torch.Tensor:
        """Scores [T, max_pages * E] (the kernel writes only the live prefix of each row)."""
        self._count("indexer")
        if self.kernel["indexer"]:
            from ..kernels.indexer.triton_indexer import indexer_triton

            return indexer_triton(q_idx, weights, keys, pages, live)
        return indexer_ref(q_idx, weights, keys, pages, live)

    def topk(self, scores, live, k: int) -> torch.Tensor:
        self._count("topk")
        if self.kernel["topk"]:
            from ..kernels.topk.radix_select import topk_triton

            return topk_triton(scores, live, k)
        return topk_ref(scores, live, k)

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
