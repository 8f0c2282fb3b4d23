"""Type inference's fast paths (equal shapes, unnamed dims, counted arity, lazy messages) give what the general
rules give: numpy's broadcasting for static shapes, the same errors for bad operand counts and dims."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import DType, ShapeError, TensorType, lookup
from kiln.ir.registry import infer
from kiln.ir.types import broadcast_axes


@pytest.mark.parametrize("shape", [(), (1,), (3, 1, 4), (2, 3)])
def test_equal_static_shapes_broadcast_as_numpy_does(shape: tuple[int, ...]) -> None:
    assert broadcast_axes(shape, shape) == np.broadcast_shapes(shape, shape)


def test_equal_dynamic_shapes_keep_their_names() -> None:
    # "among dynamic dims, one name (against itself ...) is kept"; an anonymous `?` against itself stays `?`
    axes = ("batch", None, 1, 16)
    assert broadcast_axes(axes, axes) == axes
    assert TensorType.of(axes, DType.f32) == TensorType((None, None, 1, 16), DType.f32, ("batch", None, None, None))
    assert TensorType.of((None, 16), DType.f32) == TensorType((None, 16), DType.f32)


def test_unequal_shapes_still_fail_to_broadcast() -> None:
    with pytest.raises(ShapeError, match=r"do not broadcast"):
        broadcast_axes((2, 3), (4, 3))


def test_operand_counts_are_checked_against_the_schema() -> None:
    f = TensorType((2, 2), DType.f32)
    with pytest.raises(ShapeError, match=r"^matmul: takes operands \(lhs, rhs\) but got 1$"):
        infer("matmul", [f], {})
    with pytest.raises(ShapeError, match=r"^linear: takes operands \(x, weight, bias\?\) but got 4$"):
        infer("linear", [f] * 4, {})
    assert infer("linear", [f, f], {})[1] == (f,)  # the optional bias may be left out
    assert lookup("matmul").operands == ("lhs", "rhs")


def test_matmul_names_mismatched_contracted_dims() -> None:
    with pytest.raises(ShapeError, match=r"^matmul: contracted dims of operand 0 \[2, 3\] and operand 1 \[4, 5\] "
                                         r"differ \(3 vs 4\)$"):
        infer("matmul", [TensorType((2, 3), DType.f32), TensorType((4, 5), DType.f32)], {})


def test_variadic_ops_need_one_operand() -> None:
    with pytest.raises(ShapeError, match=r"^concat: takes operands \(xs\*\) but got 0$"):
        infer("concat", [], {"axis": 0})


def test_dtypes_hash_by_identity_and_survive_pickling() -> None:
    import pickle
    table = {d: d.value for d in DType}
    assert all(table[pickle.loads(pickle.dumps(d))] == d.value for d in DType)
    assert DType("f32") in {DType.f32} and DType["bf16"] is DType.bf16


@pytest.mark.parametrize(("shape", "concrete", "want"), [
    ((None, 16), (3, 16), True), ((None, 16), (3, 15), False), ((2, 3), (2, 3), True), ((2, 3), (2, 3, 1), False),
    ((), (), True), ((None,), (), False),
])
def test_a_concrete_shape_matches_a_type_dim_by_dim(shape, concrete, want) -> None:
    """"Whether a concrete shape is an instance of this (possibly dynamic) type": `?` takes any size, others equal."""
    assert TensorType(shape, DType.f32).matches(concrete) is want
