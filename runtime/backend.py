"""The backend interface every execution path goes through; the interpreter is the reference backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kiln.ir import Graph, Interpreter


class Backend(Protocol):
    """Runs one function of a graph on numpy inputs.

    `copy=False` lets a backend return read-only views of buffers it keeps alive instead of fresh arrays, for a
    caller that only reads the outputs or feeds them back (a captured training step's parameters and state).
    """

    name: str

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0,
            copy: bool = True) -> tuple[np.ndarray, ...]: ...


class InterpreterBackend:
    """The numpy reference interpreter: slow, exact, the oracle for every other backend."""

    name = "interpreter"

    def run(self, graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0,
            copy: bool = True) -> tuple[np.ndarray, ...]:
        return Interpreter(graph).run(inputs, function, seed)  # its results are new arrays either way


_default: Backend = InterpreterBackend()


def default_backend() -> Backend:
    return _default


def set_default_backend(backend: Backend) -> Backend:
    """Install `backend` for realizing tensors; returns the previous one."""
    global _default
    previous, _default = _default, backend
    return previous
