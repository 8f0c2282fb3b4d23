"""Pause Python's cyclic garbage collector around bulk IR construction.

Ops and their result values reference each other, so building a large graph allocates millions of objects in
cycles; each full collection then walks the whole heap, which made parsing and rewriting slower per op as
graphs grew. Nothing built inside is garbage yet, so collecting during the build only costs time.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic collector for the block (re-enabling it only if it was on)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
