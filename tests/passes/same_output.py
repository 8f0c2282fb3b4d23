"""Interestingness check for the bisection tests: exit 0 when @forward of the `.kir` file given last computes
what `expected` computes with numpy (the oracle of tests/passes/test_pass_debugging.py's module), 1 otherwise."""

from __future__ import annotations

import sys

import numpy as np

from kiln.ir import interpret, parse_file


def expected(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.exp(x - y) * (y - x) + (x - y) + x * (x + y)


def inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)


if __name__ == "__main__":
    x, y = inputs()
    (got,) = interpret(parse_file(sys.argv[-1]), [x, y])
    sys.exit(0 if np.allclose(got, expected(x, y), rtol=1e-5, atol=1e-6) else 1)
