"""An import-only torchvision for SGLang's modules where no torchvision build loads beside the CPU torch.

SGLang's config package imports `torchvision.transforms` at module level (vision models' preprocessing); no
registry's torchvision loads beside the CPU torch 2.13 here (every build links torch's CUDA libraries). Text models
never call it, so the SGLang contract tests' child (tests/sglang_child.py) and the SGLang-backend harness
(bench/sglang_backend_*.py) put this on the import path: importing works, any *use* raises. A real, loadable
torchvision always wins.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any


class _Unusable:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unusable(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is an import-only stand-in here; nothing may use it")


class TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attr(name: str, _prefix: str = spec.name) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return _Unusable(f"{_prefix}.{name}")

        module.__getattr__ = attr  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0"  # older than any real release: transformers skips its vision paths


def install_torchvision_stand_in() -> None:
    try:
        import torchvision  # noqa: F401  (a real, loadable torchvision wins)
    except (ImportError, RuntimeError):
        sys.modules.pop("torchvision", None)
        sys.meta_path.append(TorchvisionStandIn())
