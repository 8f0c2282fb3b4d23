"""Captured training steps on the TVM backend against the reference interpreter, the check the packing and the
transposed-matmul tests both make of a whole step."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

import kiln
from kiln import optim
from kiln.runtime.backend import using_backend
from kiln.runtime.tvm.backend import TVMBackend


def assert_steps_match_interpreter(model: kiln.Module, loss: Callable, shapes: Sequence[tuple],
                                   batches: Sequence[tuple[np.ndarray, ...]]) -> None:
    """SGD steps (lr 0.1) of `model` over `batches` compiled by `compile_step` for inputs of `shapes`: the TVM
    build's losses and new parameters equal the interpreter's (rounding apart)."""
    results = []
    for backend in (None, TVMBackend(fast_math=False)):
        with using_backend(backend):
            step = kiln.compile_step(model, loss, optim.SGD(), *((s, "f32") for s in shapes))
            losses = [step(1e-1, *batch) for batch in batches]
            results.append((losses, {p: np.array(v.state.get()) for p, v in step.model().leaves()
                                     if isinstance(v, kiln.Param)}))
    (want_loss, want), (got_loss, got) = results
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-6, err_msg=path)
