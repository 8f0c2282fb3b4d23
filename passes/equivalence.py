"""Equivalence checking: interpret a function before and after a pass on the same random inputs."""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, Function, Graph, Interpreter, KilnError, TensorType

DYNAMIC_DIM = 3  # the size random inputs give each `?` dim


def random_input(t: TensorType, rng: np.random.Generator) -> np.ndarray:
    shape = tuple(DYNAMIC_DIM if d is None else d for d in t.shape)
    if t.dtype.is_float:
        return rng.standard_normal(shape).astype(t.dtype.numpy)
    if t.dtype is DType.bool:
        return rng.random(shape) < 0.5
    return rng.integers(0, 2, shape).astype(t.dtype.numpy)  # small ints stay valid as indices


def tolerance(dtype: DType) -> tuple[float, float]:
    """(rtol, atol) for comparing two evaluations of the same math that may round differently."""
    return {DType.f64: (1e-9, 1e-12), DType.f32: (1e-4, 1e-5), DType.f16: (1e-2, 1e-3),
            DType.bf16: (2e-2, 1e-2)}.get(dtype, (0.0, 0.0))


def first_difference(fn: Function, before: Graph, after: Graph, seed: int = 0) -> str | None:
    """A description of the first output element that differs, or None when the outputs agree.

    Raises KilnError when the function cannot be evaluated on random inputs before the pass.
    """
    rng = np.random.default_rng(seed)
    inputs = [random_input(a.type, rng) for a in fn.args]
    old = Interpreter(before).run(inputs, fn.name, seed)
    try:
        new = Interpreter(after).run(inputs, fn.name, seed)
    except KilnError as e:
        return f"@{fn.name} no longer evaluates: {e}"
    if len(old) != len(new):
        return f"@{fn.name} returned {len(old)} values before and {len(new)} after"
    for i, (a, b) in enumerate(zip(old, new)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"@{fn.name} result {i}: {a.dtype}{list(a.shape)} before, {b.dtype}{list(b.shape)} after"
        rtol, atol = tolerance(DType.from_numpy(a.dtype))
        x, y = a.astype(np.float64), b.astype(np.float64)
        bad = ~np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            index = tuple(int(j) for j in np.argwhere(bad)[0])
            return f"@{fn.name} result {i} at index {list(index)}: {a[index]!r} before, {b[index]!r} after"
    return None
