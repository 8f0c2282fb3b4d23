"""The trace context: which Param and Flag objects stand for which graph symbols during `trace`."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TraceContext:
    paths: dict[int, str]  # id(Param or Flag) -> module path
    updates: dict[str, Any] = field(default_factory=dict)  # buffer path -> its new value (a Tensor)


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
