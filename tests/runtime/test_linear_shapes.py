"""Linear layers over drawn shapes (issue 13's ranges: rows from 1 to 300, among them counts no register tile divides
such as 37 and ViT's 197 tokens, K and N from 1 to 300 and whole panels such as 64, where a bf16 product takes the
bias into its store), with a bias and a relu the kernel takes into its store, built for the host in f32 and in bf16,
against float64 numpy: f32 within 1e-4 of the largest value, bf16 within docs/precision.md's bound. Fixed draws
(`derandomize`), so a failure names a shape that fails every run; a bf16 store wrapping past the output's rows (16
rows out of a C padded to 32, 37 out of 64) is the kind of bug it is here for."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_matmul_pack import _linear_graph
from test_precision import bf16_bound  # the documented bound, one place

from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.target import cpu_target

pytestmark = pytest.mark.usefixtures("module_cache")  # a scratch cache; a failing schedule rule fails the test
TARGET = cpu_target()
ROWS = st.integers(1, 300) | st.sampled_from([37, 197])
WIDTHS = st.integers(1, 300) | st.sampled_from([64, 96, 256])
# no shrinking: each step is a build, and shrinking a failure took 5 minutes
DRAWS = settings(max_examples=10, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
                 suppress_health_check=[HealthCheck.function_scoped_fixture])


@DRAWS
@given(rows=ROWS, k=WIDTHS, n=WIDTHS, relu=st.booleans())
def test_f32_linear_layers_over_drawn_shapes(rows: int, k: int, n: int, relu: bool) -> None:
    graph, x, want = _linear_graph((rows,), k, n, relu, seed=rows * 1_000_003 + k * 1009 + n)
    got = np.asarray(compile_graph(graph, target=TARGET)(x))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(float(np.abs(want).max()), 1.0))


@DRAWS
@given(rows=ROWS, k=WIDTHS, n=WIDTHS, relu=st.booleans())
def test_bf16_linear_layers_over_drawn_shapes(rows: int, k: int, n: int, relu: bool) -> None:
    graph, x, want = _linear_graph((rows,), k, n, relu, seed=rows * 1_000_003 + k * 1009 + n)
    got = np.asarray(compile_graph(graph, target=TARGET, precision="bf16")(x))
    bound = bf16_bound(x.astype(np.float64), graph.params["w"].data.astype(np.float64)) + 2.0 ** -23 * np.abs(want)
    assert np.all(np.abs(got - want) <= bound), f"{rows}x{k} -> {n}: {np.argwhere(np.abs(got - want) > bound)[:5]}"
