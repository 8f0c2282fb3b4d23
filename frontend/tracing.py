"""The trace context: which Param and Flag objects stand for which graph symbols during `trace`."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TraceContext:
    paths: dict[int, str]  # id(Param or Flag) -> module path
    updates: dict[str, Any] = field(default_factory=dict)  # buffer path -> its new value (a Tensor)
    # stochastic ops' per-op streams, numbered within the trace: retracing a module gives the same graph (and
    # compile-cache key); executions still differ through the run seed mixed in with them
    op_seeds: Iterator[int] = field(default_factory=lambda: itertools.count(1))


_current: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("kiln_trace", default=None)


def current_trace() -> TraceContext | None:
    return _current.get()


@contextlib.contextmanager
def tracing(paths: dict[int, str]) -> Iterator[TraceContext]:
    ctx = TraceContext(paths)
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
