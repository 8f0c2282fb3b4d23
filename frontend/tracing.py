"""The trace context: which Param and Flag objects stand for which graph symbols during `trace`, and where in the
user's code (Python line, module path) the op being recorded comes from."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kiln.ir
import kiln.passes
import kiln.runtime
from kiln.ir.location import FileLoc, Location, NameLoc

# kiln's layers' source folders (this one's included): a frame from a file under one is not the user's
_KILN_DIRS = tuple(os.path.dirname(f) + os.sep for f in (kiln.ir.__file__, kiln.passes.__file__,
                                                          kiln.runtime.__file__, __file__) if f)
_is_kiln: dict[str, bool] = {}  # co_filename -> whether it is under _KILN_DIRS


def user_frame() -> tuple[str, int] | None:
    """(file, line) of the innermost frame outside kiln: the user's call that led here (a `sys._getframe` walk)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        inside = _is_kiln.get(name)
        if inside is None:
            inside = _is_kiln[name] = name.startswith(_KILN_DIRS)
        if not inside:
            return name, frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


@dataclass
class TraceContext:
    paths: dict[int, str]  # id(Param or Flag) -> module path
    updates: dict[str, Any] = field(default_factory=dict)  # buffer path -> its new value (a Tensor)
    # stochastic ops' per-op streams, numbered within the trace: retracing a module gives the same graph (and
    # compile-cache key); executions still differ through the run seed mixed in with them
    op_seeds: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    modules: dict[int, str] = field(default_factory=dict)  # id(Module) -> module path
    scope: str = ""  # the module path of the module whose forward runs now
    replayed: Location | None = None  # the own location of an op replayed from an imported graph, which wins
    _locs: dict[tuple[str, int, str], Location] = field(default_factory=dict)

    @contextlib.contextmanager
    def entered(self, module: object) -> Iterator[None]:
        """While `module`'s forward runs, ops are recorded under its path (a module outside the traced tree keeps
        its caller's)."""
        outer = self.scope
        self.scope = self.modules.get(id(module), outer)
        try:
            yield
        finally:
            self.scope = outer

    def location(self) -> Location | None:
        """Where the op being recorded comes from: the user's line, under the current module path (one object per
        place, so equal places fuse without repeats)."""
        if self.replayed is not None:
            return self.replayed
        frame = user_frame()
        if frame is None:
            return None
        key = (*frame, self.scope)
        loc = self._locs.get(key)
        if loc is None:
            at = FileLoc(*frame)
            loc = self._locs[key] = NameLoc(self.scope, at) if self.scope else at
        return loc


_current: contextvars.ContextVar[TraceContext | None] = contextvars.ContextVar("kiln_trace", default=None)


def current_trace() -> TraceContext | None:
    return _current.get()


@contextlib.contextmanager
def tracing(paths: dict[int, str], modules: dict[int, str] | None = None) -> Iterator[TraceContext]:
    ctx = TraceContext(paths, modules=modules or {})
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
