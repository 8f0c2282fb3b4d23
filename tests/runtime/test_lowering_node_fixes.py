"""TVM lowering bugs the ONNX node tests found through kiln's TVM build (`KILN_ONNX_NODE_TESTS=tvm`), each as a
one-op kiln graph compiled with TVM and checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import Builder
from kiln.runtime.tvm.compile import compile_graph

pytestmark = pytest.mark.usefixtures("module_cache")


def test_float_max_min_of_infinities_is_the_infinity() -> None:
    """numpy: the max of a row of -inf is -inf (TVM's reduction started from the lowest finite float, -3.4e38, so
    the expanded ONNX Attention's `Equal(ReduceMax(bias), -inf)` missed every fully masked row); min likewise."""
    b = Builder("Extreme")
    x = b.input("x", ((None, 4), "f32"))
    b.ret(b.max(x, axes=[-1]), b.min(x, axes=[-1]), b.max(x, keepdims=True))
    arr = np.array([[-np.inf] * 4, [1, 2, 3, -np.inf], [np.inf] * 4, [np.inf, 1, 2, 3]], np.float32)
    rows_max, rows_min, whole = compile_graph(b.build())(arr)
    np.testing.assert_array_equal(rows_max, np.max(arr, axis=-1))
    np.testing.assert_array_equal(rows_min, np.min(arr, axis=-1))
    np.testing.assert_array_equal(whole, np.max(arr, axis=None, keepdims=True))


@pytest.mark.parametrize("shapes", [((8, 8), (8, 1), (1, 8)), ((2, 4, 8, 8), (2, 4, 8, 1), (2, 4, 1, 8))])
def test_a_matmul_over_a_length_one_dim_plus_a_tensor(shapes) -> None:
    """numpy: `s + a @ b` with a contraction of length 1 is `s` plus the outer product (the expanded ONNX
    LinearAttention's state update; TVM's build computed `2s + a @ b`), and `linear` (a 2-D weight) likewise."""
    b = Builder("OuterUpdate")
    s, x, y = (b.input(n, (shape, "f32")) for n, shape in zip("sxy", shapes))
    b.ret(b.add(s, b.matmul(x, y)), *([b.add(s, b.linear(x, y))] if len(shapes[2]) == 2 else []))
    rng = np.random.default_rng(0)
    arrs = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    outs = compile_graph(b.build())(*arrs)
    for got in outs if isinstance(outs, tuple) else (outs,):
        np.testing.assert_allclose(got, arrs[0] + np.matmul(arrs[1], arrs[2]), rtol=1e-6, atol=1e-6)
