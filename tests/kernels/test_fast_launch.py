"""fast_launch with a stand-in kernel (the real launcher needs a GPU): the JIT path for each new
specialization, the kept handle with addresses and constexpr values in parameter order afterwards."""

from __future__ import annotations

import inspect

import torch

from dsv4_cluster.kernels import fast_launch


class _Param:
    def __init__(self, name):
        self.is_constexpr = name.isupper()


class _Handle:
    function, packed_metadata = "fn", "meta"

    def __init__(self, runs):
        self.runs = runs

    def run(self, *args):
        self.runs.append(args)


class _Kernel:
    """Parameters x_ptr, n, BLOCK (constexpr), y_ptr (default None)."""

    def __init__(self):
        def kernel(x_ptr, n, BLOCK, y_ptr=None):
            pass

        self.signature = inspect.signature(kernel)
        self.arg_names = list(self.signature.parameters)
        self.params = [_Param(n) for n in self.arg_names]
        self.jit, self.runs = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.jit.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        return _Handle(self.runs)


def test_jit_once_per_specialization_then_the_handle(monkeypatch):
    monkeypatch.setattr(fast_launch, "_on_cuda", lambda t: True)
    monkeypatch.setattr(fast_launch, "_hooks_set", lambda: False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    kernel = _Kernel()
    x, y = torch.zeros(64), torch.zeros(64)
    fast_launch.launch(kernel, (4,), (x, 32), dict(BLOCK=16, num_warps=4))
    assert len(kernel.jit) == 1 and not kernel.runs
    fast_launch.launch(kernel, (4,), (y, 48), dict(BLOCK=16, num_warps=4))  # same class: 16-aligned, % 16
    assert len(kernel.jit) == 1
    assert kernel.runs == [(4, 1, 1, 7, "fn", "meta", None, None, None, y.data_ptr(), 48, 16, None)]
    fast_launch.launch(kernel, (4,), (y, 48), dict(BLOCK=32, num_warps=4))  # another constexpr value
    fast_launch.launch(kernel, (4,), (y[1:], 48), dict(BLOCK=16, num_warps=4))  # not 16-byte aligned
    fast_launch.launch(kernel, (4,), (y, 1), dict(BLOCK=16, num_warps=4))  # an int equal to 1
    fast_launch.launch(kernel, (4,), (y, 48), dict(BLOCK=16, num_warps=8))  # another launch option
    assert len(kernel.jit) == 5 and len(kernel.runs) == 1


def test_hooks_are_seen_only_when_one_is_installed():
    """Triton 3.5+ keeps each launch hook as a never-None HookChain: an empty chain is no hook (the fast path
    was never taken on the H200 while this read `is not None`)."""
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    assert not fast_launch._hooks_set()

    def profiler_hook(metadata):
        return None

    if hasattr(chain, "add"):
        chain.add(profiler_hook)
        try:
            assert fast_launch._hooks_set()
        finally:
            chain.remove(profiler_hook)
    else:
        knobs.runtime.launch_enter_hook = profiler_hook
        try:
            assert fast_launch._hooks_set()
        finally:
            knobs.runtime.launch_enter_hook = chain
    assert not fast_launch._hooks_set()
