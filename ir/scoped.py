"""`scoped`: a context variable set for the code run inside a `with` block, and restored after it (the run seed of
stochastic ops, the rewrite hook of pass instruments)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: ContextVar[T], value: T) -> Iterator[None]:
    """Set `var` to `value` inside the block; its previous value comes back however the block ends."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
