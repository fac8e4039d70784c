"""Launch a compiled Triton / Gluon kernel without the JIT's per-call work: the eager hot path.

Why: on the H200 an eager SGLang call of ours cost 100+ us of host time against 16 us of GPU time, and
FlashMLA's 33. A `kernel[grid](...)` launch binds every argument, hashes the specialization, and its C
launcher asks the driver about every pointer argument (`cuPointerGetAttribute`, one driver call per
tensor). Here the first launch of a specialization goes through the JIT as usual and its compiled handle
is kept; later launches of the same specialization call that handle directly, with each tensor passed as
its address (the launcher skips its driver query for integers).

The specialization key is what Triton specialises on: each constexpr's value, each tensor's dtype and
16-byte alignment, each integer's equality to 1, divisibility by 16 and 32-bit range, the launch options.
Non-CUDA tensors (the interpreter) and launch hooks (profilers) always take the JIT path.
"""

from __future__ import annotations

import torch
from triton import knobs

_HANDLES: dict[tuple, object] = {}
_RECORDING: list = []  # launch_cache: the step lists being recorded (innermost last); empty = not recording


class SharedMemoryError(RuntimeError):
    """A kernel specialization needs more shared memory per block than its GPU class allows."""
_CONSTEXPR: dict[object, tuple[tuple[str, ...], tuple[bool, ...]]] = {}


def _spec(value, is_constexpr: bool):
    if is_constexpr:
        return value
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -(1 << 31) <= value < (1 << 31)
    return type(value)


def launch(kernel, grid: tuple, args: tuple, kwargs: dict, max_shared: int | None = None) -> None:
    """kernel[grid](*args, **kwargs), through the kept compiled handle after the first launch of a
    specialization (see the module docstring). Same arguments and effect as the JIT launch.

    max_shared: the shared memory per block the caller's GPU class allows (`dispatch.SMEM_PER_BLOCK`); a
    specialization compiled to need more raises `SharedMemoryError` at its first launch and is not kept (on the
    class itself the driver would refuse it; where the class is forced on a larger GPU, this is the check)."""
    first = args[0]
    if not _on_cuda(first) or _hooks_set():
        if _RECORDING:
            _RECORDING[-1].append(("jit", kernel, grid, args, kwargs))
            with _paused():
                kernel[grid](*args, **kwargs)
            return
        kernel[grid](*args, **kwargs)
        return
    layout = _CONSTEXPR.get(kernel)
    if layout is None:
        layout = _CONSTEXPR[kernel] = (tuple(kernel.arg_names), tuple(p.is_constexpr for p in kernel.params))
    names, constexpr = layout
    values = list(args)
    options = {}
    for name, value in kwargs.items():
        if name not in names:
            options[name] = value
    for name in names[len(args):]:
        values.append(kwargs[name] if name in kwargs else _default(kernel, name))
    key = (kernel, first.device.index, grid, tuple(map(_spec, values, constexpr)), tuple(options.items()))
    handle = _HANDLES.get(key)
    if handle is None:
        with _paused() if _RECORDING else _NO_CONTEXT:
            kernel[grid](*args, **kwargs)
            handle = kernel.warmup(*args, grid=grid, **kwargs)
        if max_shared is not None and handle.metadata.shared > max_shared:
            raise SharedMemoryError(f"{getattr(kernel, '__name__', kernel)} with {kwargs} needs {handle.metadata.shared} B "
                                    f"of shared memory per block, over the {max_shared} B this GPU class allows")
        _HANDLES[key] = handle
        if _RECORDING:
            _RECORDING[-1].append(("handle", handle, grid, values, first.device.index))
        return
    if _RECORDING:
        _RECORDING[-1].append(("handle", handle, grid, values, first.device.index))
    full = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
    stream = torch._C._cuda_getCurrentRawStream(first.device.index)
    g = grid + (1,) * (3 - len(grid))
    handle.run(g[0], g[1], g[2], stream, handle.function, handle.packed_metadata, None, None, None, *full)


def start_recording(steps: list) -> int:
    """From now on every launch also appends a step to `steps` (launch_cache): ("handle", compiled handle,
    grid, argument values, device) on the kept-handle path, ("jit", kernel, grid, args, kwargs) otherwise.
    Returns the token for `stop_recording`."""
    _RECORDING.append(steps)
    return len(_RECORDING)


def stop_recording(token: int) -> None:
    del _RECORDING[token - 1:]


def _paused():
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NO_CONTEXT = _Null()


def _on_cuda(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def _default(kernel, name: str):
    param = kernel.signature.parameters[name]
    if param.default is param.empty:
        raise TypeError(f"{kernel.__name__ if hasattr(kernel, '__name__') else kernel}: missing argument {name!r}")
    return param.default


def _hooks_set() -> bool:
    """Is a launch hook (a profiler) installed? Triton 3.5+ keeps each hook as a `HookChain` that is never
    None (its `calls` list is empty when no hook is set); older releases keep a callable or None."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False
