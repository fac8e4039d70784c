"""Eager adapter calls at the cost of their launches: a launch plan recorded once per shape class, then replayed.

Why: SGLang runs every step above `--cuda-graph-max-bs` (and every step it does not capture) eagerly, and an
adapter call there cost 110-320 us of host time (argument checks, views, plan lookups, the launch-spec key
over ~45 kernel arguments: ~350 interpreter calls), against FlashMLA's 15-65 us.

How: an adapter computes `signature(tensors, scalars)` per call: the key of its shape class (each tensor's
shape, strides, dtype and device, the scalars, the CUDA stream) and the tensors' addresses. The first call
of a key runs the adapter's normal path: every argument check, then the computation inside `recording`,
which notes what reaches the GPU: each kernel launch through `fast_launch` (its compiled handle, grid and
arguments) and each memset, and refuses to keep a plan when anything else ran (an aten op that is not a
view or an allocation, a tensor argument it cannot trace to one input). A kernel's tensor argument is traced
to the input whose storage and extent hold it (an offset from that input's address: the views the adapter
takes) or, when it belongs to no input, kept as is (scratch and workspace: the plan holds it alive, so
its memory stays valid; calls on one stream run in order, as with `workspace.scratch`). A plan holds only that
scratch, never a tensor of the call that recorded it (its inputs and outputs are addresses filled per replay), so
eager batch churn and graph warm-ups pin no caller memory. Later calls of the
key skip the checks and replay the launches with the new addresses: the C launcher, nothing per argument
in Python but one add per tensor argument.

What is checked per call: the key (so any change of shape, stride, dtype, device, scalar or stream is a
miss and goes through every check), that every address is 16-byte aligned (Triton specialises on it), that
the stream is not capturing a CUDA graph (a capture takes the normal path: its scratch belongs to the
graph), that no Triton launch hook (a profiler) is installed. What is checked per key: everything else
the adapter checks. Values are never checked on the hot path (as before); with DSV4_KERNEL_DEBUG=1
(`debug.value_checks`) nothing is cached, so every call runs its value checks.

CPU tensors: the adapters run the references there, so a plan holds the checked call and no launches
(`Plan.steps` is None); the Triton interpreter (TRITON_INTERPRET=1) records and replays like CUDA.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import debug, fast_launch

# aten ops that do no device work: allocations and views. Anything else during a recording means the
# computation is not launches + memsets alone, and the key is not cached.
NO_WORK_OPS = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "view", "_unsafe_view", "slice",
    "select", "as_strided", "alias", "unsqueeze", "squeeze", "t", "transpose", "permute", "expand", "detach",
    "unflatten", "split", "unbind", "narrow", "lift_fresh"})
MEMSET_OPS = frozenset({"zero_", "fill_"})
MAX_PLANS = 4096  # per cache; past this the cache starts over (a server sees a few dozen shape classes)


def signature(tensors: tuple, scalars: tuple) -> tuple[tuple, list[int]]:
    """(key, addresses) of a call: per tensor (None allowed) its shape, strides, dtype and device index
    (-1 = CPU), the hashable `scalars`, and the current stream of the first tensor's CUDA device."""
    metas, ptrs = [], []
    for t in tensors:
        if t is None:
            metas.append(None)
            ptrs.append(0)
        else:
            metas.append((t.shape, t.stride(), t.dtype, t.get_device()))
            ptrs.append(t.data_ptr())
    dev = metas[0][3]
    stream = torch._C._cuda_getCurrentRawStream(dev) if dev >= 0 else 0
    return (tuple(metas), scalars, stream), ptrs


class Plan:
    """A recorded call: `extra` (what the adapter keeps: checked call info, output shapes, ...) and `steps`
    (launches and memsets in order; None: nothing to replay, the adapter computes, e.g. its CPU reference)."""

    __slots__ = ("extra", "steps", "stream", "device")

    def __init__(self, extra: dict, steps, stream: int, device: int):
        self.extra, self.steps, self.stream, self.device = extra, steps, stream, device

    def replay(self, ptrs: list[int], tensors: tuple) -> None:
        """The recorded launches with these addresses (`ptrs` of `tensors`, the call's inputs + outputs)."""
        for step in self.steps:
            step(ptrs, tensors, self.stream)


class LaunchCache:
    """key -> Plan for one adapter (see the module docstring). `uncached` counts why keys were not kept."""

    def __init__(self, name: str):
        self.name = name
        self.plans: dict[tuple, Plan] = {}
        self.uncached: dict[str, int] = {}

    def hit(self, key: tuple, ptrs: list[int]) -> Plan | None:
        """The plan to replay for this call, or None (a miss, or a call that must take the normal path)."""
        plan = self.plans.get(key)
        if plan is None:
            return None
        if plan.steps is not None:
            if any(p & 15 for p in ptrs) or fast_launch._hooks_set():
                return None
            if plan.device >= 0 and torch._C._cuda_isCurrentStreamCapturing():
                return None
        return plan

    @contextlib.contextmanager
    def recording(self, key: tuple, ptrs: list[int], tensors: tuple, extra: dict, replayable: bool = True):
        """Run the adapter's computation inside; afterwards keep `Plan(extra, steps)` for `key` if it is sound.
        `tensors`/`ptrs`: the inputs of `signature` plus the outputs the adapter allocated (their addresses
        appended). replayable=False: keep the checked call without launches (the CPU reference path)."""
        device = key[0][0][3] if key[0] and key[0][0] is not None else -1
        why = self._unrecordable(ptrs, device)
        if why is not None or not replayable:
            yield
            if why is None:
                self._keep(key, Plan(extra, None, key[2], device))
            else:
                self._count(why)
            return
        steps: list = []
        mode = _Recorder(steps)
        token = fast_launch.start_recording(steps)
        try:
            with mode:
                yield
        finally:
            fast_launch.stop_recording(token)
        why = mode.bad
        compiled = None
        if why is None:
            compiled, why = _compile(steps, tensors, ptrs)
        if why is None:
            self._keep(key, Plan(extra, compiled, key[2], device))
        else:
            self._count(why)

    def _unrecordable(self, ptrs, device) -> str | None:
        if debug.value_checks():
            return "value checks on (DSV4_KERNEL_DEBUG)"
        if any(p & 15 for p in ptrs):
            return "an address not 16-byte aligned"
        if fast_launch._hooks_set():
            return "a Triton launch hook is installed"
        if device >= 0 and torch.cuda.is_current_stream_capturing():
            return "CUDA-graph capture"
        return None

    def _keep(self, key, plan) -> None:
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan

    def _count(self, why: str) -> None:
        self.uncached[why] = self.uncached.get(why, 0) + 1


class _Recorder(TorchDispatchMode):
    """Notes memsets (as steps) and the first aten op that is neither a memset nor free of device work."""

    def __init__(self, steps: list):
        super().__init__()
        self.steps, self.bad = steps, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in MEMSET_OPS:
            self.steps.append(("memset", func, args, kwargs))
        elif name not in NO_WORK_OPS and self.bad is None:
            self.bad = f"aten.{name} ran (not a launch, memset, view or allocation)"
        return func(*args, **kwargs)


def _extent(t: torch.Tensor) -> int:
    """Bytes from t's address to one past its last element."""
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _trace(t: torch.Tensor, tensors: tuple, ptrs: list[int]):
    """(input index, byte offset) of tensor argument t, None when it belongs to no input (scratch), or a
    string saying why it cannot be traced."""
    storage = t.untyped_storage().data_ptr()
    p = t.data_ptr()
    same = [i for i, x in enumerate(tensors) if x is not None and x.untyped_storage().data_ptr() == storage]
    if not same:
        return None
    inside = [i for i in same if ptrs[i] <= p < ptrs[i] + max(_extent(tensors[i]), 1)]
    if len(inside) != 1:
        return (f"a kernel argument lies in {len(inside)} inputs' memory (inputs {same} share a storage): "
                "not traceable to one")
    return inside[0], p - ptrs[inside[0]]


def _compile(steps, tensors, ptrs):
    """Recorded steps -> replay closures, or (None, why)."""
    out = []
    for step in steps:
        kind = step[0]
        if kind == "memset":
            _, func, args, kwargs = step
            target = args[0]
            if _trace(target, tensors, ptrs) is not None:
                return None, "a memset of an input or output (only scratch memsets are replayed)"
            out.append(lambda p, t, s, func=func, args=args, kwargs=kwargs: func(*args, **kwargs))
            continue
        if kind == "handle":
            _, handle, grid, values, device = step
            template, slots, held = [], [], []
            for pos, v in enumerate(values):
                if isinstance(v, torch.Tensor):
                    src = _trace(v, tensors, ptrs)
                    if isinstance(src, str):
                        return None, src
                    if src is not None:
                        slots.append((pos, src[0], src[1]))
                        template.append(0)  # filled from the call's own addresses at each replay
                    else:
                        template.append(v.data_ptr())
                        held.append(v)  # scratch: the plan keeps it alive, and nothing of the caller's
                else:
                    template.append(v)
            g = tuple(grid) + (1,) * (3 - len(grid))
            out.append(_handle_step(handle, g, template, tuple(slots), held))
            continue
        _, kernel, grid, args, kwargs = step  # "jit": the interpreter (CPU tensors)
        subst = {}
        for where, seq in (("a", args), ("k", kwargs.items())):
            for pos, v in enumerate(seq):
                v = v[1] if where == "k" else v
                if isinstance(v, torch.Tensor):
                    src = _trace(v, tensors, ptrs)
                    if isinstance(src, str):
                        return None, src
                    if src is not None:
                        subst[(where, pos)] = (src[0], src[1], v.dtype, tuple(v.shape), v.stride())
        out.append(_jit_step(kernel, grid, _unheld(args, subst, "a"), dict(zip(kwargs, _unheld(
            kwargs.values(), subst, "k"))), subst))
    return out, None


def _unheld(values, subst, where):
    """`values` with the tensors traced to the call's inputs replaced by None (each replay substitutes its own):
    a plan holds scratch, never the caller's tensors."""
    return [None if (where, n) in subst else v for n, v in enumerate(values)]


def _handle_step(handle, g, template, slots, held):
    run, function, meta = handle.run, handle.function, handle.packed_metadata
    g0, g1, g2 = g

    def step(ptrs, tensors, stream, held=held):
        vals = list(template)
        for pos, i, off in slots:
            vals[pos] = ptrs[i] + off
        run(g0, g1, g2, stream, function, meta, None, None, None, *vals)
    return step


def _jit_step(kernel, grid, args, kwargs, subst):
    def view(tensors, src):
        i, off, dtype, shape, stride = src
        base = tensors[i]
        storage = base.untyped_storage()
        byte = base.data_ptr() + off - storage.data_ptr()
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.empty(0, dtype=dtype, device=base.device).set_(storage, byte // size, shape, stride)

    def step(ptrs, tensors, stream):
        a = [view(tensors, subst[("a", n)]) if ("a", n) in subst else v for n, v in enumerate(args)]
        k = {name: view(tensors, subst[("k", n)]) if ("k", n) in subst else v
             for n, (name, v) in enumerate(kwargs.items())}
        kernel[grid](*a, **k)
    return step

