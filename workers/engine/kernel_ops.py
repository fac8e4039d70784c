"""The model's three kernel calls (sparse decode, indexer, top-k), dispatched and counted.

On CUDA a kernel named in `--kernels` runs ours (which one and its launch config: `kernels/dispatch.py`), any
other the PyTorch reference on the GPU; on CPU every op is the reference (the oracle). Every call adds one to a
device-side counter, so CUDA-graph replays count as the calls they captured: `/server_info` reports what ran from
these counts, never from the flag. fp8 pools go to the fp8 kernels; the references dequantise exactly the rows
they read. A ratio-128 layer's call (`dense=True`) runs the Triton kernel with a split count fixed from the batch
(`dense_config`): a count chosen from the index list's width would grow with the configured context.
"""

from __future__ import annotations


import torch

from dsv4_cluster.core import KERNEL_NAMES

from ...kernels.indexer.reference import indexer_fp8_ref, indexer_ref
from ...kernels.sparse_mla_decode import sparse_mla_decode_ref
from ...kernels.sparse_mla_decode.reference import sparse_mla_decode_paged_ref
from ...kernels.topk.reference import topk_ref

IMPLS = ("reference", "triton", "gluon", "gluon_mma_v2", "gluon_h16")


class KernelOps:
    def __init__(self, device: str, requested: tuple[str, ...], n_heads: int, dtype: torch.dtype,
                 nominal_rows: int = 640):
        self.device = torch.device(device)
        self.nominal_rows = nominal_rows   # rows of a ratio-4 layer's query (window + top-k): dense_config
        self.n_heads, self.dtype = n_heads, dtype
        self.kernel = {k: False for k in KERNEL_NAMES}
        self.impl = {k: "reference" for k in KERNEL_NAMES}
        self.paged_impl = "triton"  # the sparse decode's on fp8 pages (see decode_impls)
        self._below: tuple[int, tuple[str, str]] | None = None  # (min_batch, (float, paged) below it): decode_impls
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
        if "sparse_mla_decode" in names and self.device.type == "cuda":
            from ...kernels.sparse_mla_decode.plan import _min_batch

            self.impl["sparse_mla_decode"], self.paged_impl = decode_impls(self.device, n_heads, dtype)
            below = _min_batch(self.device, n_heads)
            self._below = (below, decode_impls(self.device, n_heads, dtype, True)) if below > 1 else None
        self._slot = {k: (i, IMPLS.index(self.impl[k])) for i, k in enumerate(KERNEL_NAMES)}

    @property
    def all_kernels(self) -> bool:
        """Every op runs a kernel: nothing in a decode step syncs with the host (it can be graph-captured)."""
        return all(self.kernel.values())

    def _count(self, name: str, impl: str | None = None) -> None:
        i, j = self._slot[name] if impl is None else (KERNEL_NAMES.index(name), IMPLS.index(impl))
        self.calls[i, j] += 1

    def sparse_decode(self, q, kv, window_idx, extra_kv, extra_idx, sink, *, geometry=None, extra_lens=None,
                      dense: bool = False) -> torch.Tensor:
        """Attention over each query's window rows of `kv` and its `extra_idx` rows of `extra_kv` (the first
        extra_lens[b] of them when given). geometry: (main, extra) `PageGeometry` when the buffers are fp8
        pages (slot indices), None for float rows. dense: a ratio-128 layer's call (see the module doc)."""
        kernel = self.kernel["sparse_mla_decode"]
        impl = None
        if kernel:  # what the launch picks for this batch (the row's fallback below its min_batch)
            small = self._below is not None and q.shape[0] < self._below[0]
            float_impl, paged_impl = self._below[1] if small else (self.impl["sparse_mla_decode"], self.paged_impl)
            impl = "triton" if dense else paged_impl if geometry is not None else float_impl
        self._count("sparse_mla_decode", impl)
        if geometry is not None:
            window, extra = (kv, geometry[0], window_idx, None), (extra_kv, geometry[1], extra_idx, extra_lens)
            if kernel:
                from ...kernels.sparse_mla_decode.launch import sparse_decode_paged

                config = self.dense_config(q.shape[0]) if dense else None
                return sparse_decode_paged(q, window, extra, sink, None, None, None, config=config)[0]
            return sparse_mla_decode_paged_ref(q, window, extra, sink)[0]
        if kernel:
            from ...kernels.sparse_mla_decode.launch import sparse_mla_decode_triton

            config = self.dense_config(q.shape[0]) if dense else None
            return sparse_mla_decode_triton(q, kv, window_idx, extra_kv, extra_idx, sink, None, None, extra_lens,
                                            config=config)[0]
        return sparse_mla_decode_ref(q, kv, window_idx, extra_kv, extra_idx, sink, None, None, extra_lens)[0]

    def dense_config(self, batch: int):
        """The Triton launch of a ratio-128 call: splits as for `nominal_rows` rows per query at this batch size
        (shapes only, so graph-capturable, and the same at every configured context)."""
        from ...kernels.sparse_mla_decode.plan import dense_config

        return dense_config(self.device, batch, self.nominal_rows, self.n_heads, self.dtype)

    def indexer(self, q_idx, weights, keys, pages, live) -> torch.Tensor:
        """Scores [T, max_pages * E] (the kernel writes only the live prefix of each row)."""
        self._count("indexer")
        fp8 = keys.dtype == torch.uint8          # the fp8 key pages of kernels/indexer/fp8_keys.py
        if self.kernel["indexer"]:
            from ...kernels.indexer.triton_indexer import indexer_fp8_triton, indexer_triton

            return (indexer_fp8_triton if fp8 else indexer_triton)(q_idx, weights, keys, pages, live)
        return (indexer_fp8_ref if fp8 else indexer_ref)(q_idx, weights, keys, pages, live)

    def topk(self, scores, live, k: int) -> torch.Tensor:
        self._count("topk")
        if self.kernel["topk"]:
            from ...kernels.topk.radix_select import topk_triton

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


def decode_impls(device: torch.device, n_heads: int, dtype: torch.dtype,
                 below_min_batch: bool = False) -> tuple[str, str]:
    """What the dispatch table's launches pick for the sparse decode on this GPU class and head count: (on float
    rows, on fp8 pages); below_min_batch: for a batch under the row's `min_batch` (its fallback). They differ where
    the row is the mma.sync kernel, which takes fp8 pages alone."""
    from ...kernels.sparse_mla_decode.config import LaunchConfig, choose_backend

    return tuple(choose_backend(device, n_heads, dtype, fp8, LaunchConfig(), below_min_batch)[0]
                 for fp8 in (False, True))
