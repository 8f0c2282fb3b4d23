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
