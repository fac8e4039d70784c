"""The kernels' debug switch: value checks that read device memory (a host sync) run only when it is on.

Shape, dtype and device checks are free and always run. Checks of index and length *values* need the
values on the host, which stalls the stream; SGLang's hot path must not pay that, so the adapters run
them only with DSV4_KERNEL_DEBUG=1 in the environment (read once, at import).
"""

from __future__ import annotations

import os

_VALUE_CHECKS = os.environ.get("DSV4_KERNEL_DEBUG", "") == "1"


def value_checks() -> bool:
    return _VALUE_CHECKS
