"""Where NIXL's Python API lives: `nixl`, or `nixl_cu13` alone (what `nixl-cu13` provides). Checked without
importing, so preflight stays cheap.
"""

from __future__ import annotations

import importlib
import importlib.util

NIXL_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
INSTALL_HINT = "pip install nixl-cu13 (or nixl-cu12 where CUDA 12 is installed)"


def nixl_package() -> str | None:
    """The first importable NIXL package, or None."""
    return next((p for p in NIXL_PACKAGES if importlib.util.find_spec(p) is not None), None)


def load_nixl_api():
    """NIXL's `_api` module; ImportError with the install hint when none is installed."""
    package = nixl_package()
    if package is None:
        raise ImportError(f"NIXL is not installed: {INSTALL_HINT}")
    return importlib.import_module(f"{package}._api")
