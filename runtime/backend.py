"""The backend interface every execution path goes through; the interpreter is the reference backend."""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol

import numpy as np

from kiln.ir import Graph, Interpreter


class Backend(Protocol):
    """Runs one function of a graph on numpy inputs.

    `copy=False` lets a backend return read-only views of buffers it keeps alive instead of fresh arrays, for a
    caller that only reads the outputs or feeds them back (a captured training step's parameters and state).
    `donate` gives the positions of inputs the caller will not read again: a backend may write results into them
    (it never writes an array the caller made itself, only views it handed out).
    """

    name: str

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0,
            copy: bool = True, donate: Collection[int] = ()) -> tuple[np.ndarray, ...]: ...


class InterpreterBackend:
    """The numpy reference interpreter: slow, exact, the oracle for every other backend."""

    name = "interpreter"

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0,
            copy: bool = True, donate: Collection[int] = ()) -> tuple[np.ndarray, ...]:
        return Interpreter(graph).run(inputs, function, seed)  # its results are new arrays either way


_default: Backend = InterpreterBackend()


def default_backend() -> Backend:
    return _default


def set_default_backend(backend: Backend) -> Backend:
    """Install `backend` for realizing tensors; returns the previous one."""
    global _default
    previous, _default = _default, backend
    return previous


@contextlib.contextmanager
def using_backend(backend: Backend | None) -> Iterator[Backend]:
    """Realize tensors on `backend` inside the block (None: keep the current one), the previous one restored
    however the block ends; yields the backend in effect."""
    if backend is None:
        yield _default
        return
    previous = set_default_backend(backend)
    try:
        yield backend
    finally:
        set_default_backend(previous)
