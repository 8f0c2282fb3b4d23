"""Warnings kiln gives once per key in a process (a key per call site, or one for the whole process).

Counted here, not by Python's `warnings` registry: TVM resets that registry, so "default" filtering would repeat
a warning at every call.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable

warned: set[Hashable] = set()  # the keys already warned about; tests clear it


def warn_once(key: Hashable, message: str, category: type[Warning], stacklevel: int) -> None:
    """Warn with `message` unless `key` was warned about already; `stacklevel` counts from the caller."""
    if key not in warned:
        warned.add(key)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
