"""Rewrite tracking: the hook the rewrite driver consults before applying a rule, so pass statistics can count
rewrites and bisection can number and skip them, without the driver knowing about either."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Protocol

from .graph import Op
from .scoped import scoped


class RewriteHook(Protocol):
    """What an instrument (kiln.passes' PassManager) implements to watch the rewrites of the pass it runs."""

    def allow_rewrite(self, op: Op) -> bool:
        """Whether a rule may replace `op`; called once per replacement a rule offers."""

    def count(self, name: str, n: int) -> None:
        """Add `n` to the pass statistic `name`."""


_ACTIVE: ContextVar[RewriteHook | None] = ContextVar("kiln_rewrite_hook", default=None)


def tracking(hook: RewriteHook) -> contextlib.AbstractContextManager[None]:
    """Route the rewrites and statistics of the code run inside to `hook`."""
    return scoped(_ACTIVE, hook)


def active_hook() -> RewriteHook | None:
    return _ACTIVE.get()


def count(name: str, n: int = 1) -> None:
    """Report `n` more of the named statistic (ops folded, params frozen...) for the pass now running, if any
    instrument listens; a no-op otherwise."""
    hook = _ACTIVE.get()
    if hook is not None and n:
        hook.count(name, n)
