"""SGLang 0.5.23's own sm_120 decode and indexer fallbacks, loaded unmodified from its source, for the H200 stand-in.

- `flash_mla_sparse_decode_triton` (flash_mla_sm120_triton.py): the module imports only torch and triton, so it is
  imported whole from its file.
- the PyTorch decode fallback `_sm120_sparse_decode_fwd` (+ `_gather_and_dequant`, flash_mla_sm120.py) and
  `fp8_paged_mqa_logits_torch_sm120` (dsv4/indexer.py): their modules import SGLang's runtime (environ, platform,
  DeepGEMM ...), which does not load beside the H200's torch 2.11; these functions use only torch, so their source
  is taken from the file (`ast`) and executed unmodified with torch, F and the module-level names they read
  (layout constants; FP8_DTYPE = float8_e4m3fn, what SGLang picks on NVIDIA).

FlashInfer's sm_120 CUDA kernel (`_sparse_mla_sm120`, SGLang's default there) is built for sm_120 only: it cannot
run on an H200, so it is not among the baselines.
`SGLANG_SRC` names SGLang's package folder (default: the installed sglang's).
"""

from __future__ import annotations

import ast
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

DECODE_CONSTANTS = ("_NOPE_DIM", "_ROPE_DIM", "_NOPE_ROPE_STRIDE", "_TILE_SIZE", "_NUM_TILES", "_SCALE_STRIDE", "_D")


def sglang_root() -> Path:
    if os.environ.get("SGLANG_SRC"):
        return Path(os.environ["SGLANG_SRC"])
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError("SGLang's source is needed: install sglang==0.5.23 or set SGLANG_SRC to its package folder")
    return Path(spec.origin).parent


def _functions(path: Path, names: tuple[str, ...], constants: tuple[str, ...], namespace: dict) -> dict:
    tree = ast.parse(path.read_text(), filename=str(path))
    picked = [n for n in tree.body if (isinstance(n, ast.FunctionDef) and n.name in names) or
              (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in constants for t in n.targets))]
    missing = set(names) - {n.name for n in picked if isinstance(n, ast.FunctionDef)}
    if missing:
        raise RuntimeError(f"{path} no longer defines {', '.join(sorted(missing))}")
    exec(compile(ast.Module(body=picked, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def load() -> SimpleNamespace:
    """SGLang's sm_120 baselines: triton_decode, torch_decode, torch_indexer (their SGLang signatures)."""
    from typing import Any

    import torch
    import torch.nn.functional as F

    root = sglang_root()
    ops = root / "kernels" / "ops" / "attention"
    spec = importlib.util.spec_from_file_location("sglang_sm120_triton", ops / "flash_mla_sm120_triton.py")
    triton_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(triton_mod)
    dec = _functions(ops / "flash_mla_sm120.py", ("_gather_and_dequant", "_sm120_sparse_decode_fwd"), DECODE_CONSTANTS,
                     {"torch": torch})
    idx = _functions(root / "srt" / "layers" / "attention" / "dsv4" / "indexer.py",
                     ("fp8_paged_mqa_logits_torch_sm120",), (),
                     {"torch": torch, "F": F, "Any": Any, "FP8_DTYPE": torch.float8_e4m3fn})
    return SimpleNamespace(triton_decode=triton_mod.flash_mla_sparse_decode_triton,
                           torch_decode=dec["_sm120_sparse_decode_fwd"],
                           torch_indexer=idx["fp8_paged_mqa_logits_torch_sm120"], root=str(root))
