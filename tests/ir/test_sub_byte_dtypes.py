"""The sub-byte value dtypes in the IR: i4/u4/i2/u2 integer codes as cast values (`DType.holds_values`), float4
(f4e2m1fn) and f8e8m0fnu as narrow floats; `.kir` text and the interpreter, checked against ml_dtypes' conversions."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kiln.ir import Builder, DType, ShapeError, interpret, parse, print_graph

CODES = (DType.i4, DType.u4, DType.i2, DType.u2)
ML = {DType.i4: ml_dtypes.int4, DType.u4: ml_dtypes.uint4, DType.i2: ml_dtypes.int2, DType.u2: ml_dtypes.uint2,
      DType.f4e2m1fn: ml_dtypes.float4_e2m1fn, DType.f8e8m0fnu: ml_dtypes.float8_e8m0fnu}
# ONNX's Cast node test inputs for int4 (-9 .. 15) and a few truncations and far values
X = np.concatenate([np.arange(-9, 16), [-0.5, 15.9, -8.7, 300.0, -300.0]]).astype(np.float32)


def wrapped(x: np.ndarray, bits: int, signed: bool) -> np.ndarray:
    """The oracle of kiln's cast to a code, in Python integers (no ml_dtypes): truncation toward zero, then modulo
    2**bits into the code's range; NaN and infinities 0."""
    low = -(1 << (bits - 1)) if signed else 0
    flat = [0 if isinstance(v, float) and not math.isfinite(v) else (int(v) - low) % (1 << bits) + low
            for v in x.reshape(-1).tolist()]
    return np.array(flat, np.int64).reshape(x.shape)


def test_dtype_properties() -> None:
    for d in CODES:
        assert d.is_packed and d.is_int_code and d.holds_values and not d.is_int and d.kind == "int"
        assert d.int_range == (int(ml_dtypes.iinfo(ML[d]).min), int(ml_dtypes.iinfo(ML[d]).max))
    assert [DType.i2.bits, DType.u2.bits, DType.f4e2m1fn.bits, DType.f8e8m0fnu.bits] == [2, 2, 4, 8]
    for d in (DType.f4e2m1fn, DType.f8e8m0fnu):
        assert d.is_float and not d.is_float8 and d.compute is DType.f32 and not d.is_packed
    assert DType.f4e2m1fn.finite_max == 6.0 and DType.f8e8m0fnu.finite_max == 2.0**127
    assert not DType.nf4.holds_values  # nf4 codes index a float table
    assert all(DType.from_numpy(np.dtype(t)) is d for d, t in ML.items())


@pytest.mark.parametrize("dtype", CODES, ids=lambda d: d.value)
def test_cast_to_a_code_truncates_and_wraps_as_numpy_and_back_is_exact(dtype: DType) -> None:
    """ONNX's Cast node tests to INT4/UINT4/INT2/UINT2 store truncation toward zero, then modulo 2**bits (their
    inputs -9..15 wrap: -9 -> 7); from them every value converts exactly."""
    b = Builder("M")
    x, h = b.input("x", ((len(X),), "f32")), b.input("h", ((len(X),), "f16"))
    code = b.cast(x, dtype=dtype)
    b.ret(code, b.cast(h, dtype=dtype), b.cast(code, dtype=DType.f32), b.cast(code, dtype=DType.i8),
          b.cast(code, dtype=DType.u4 if dtype is DType.i2 else DType.i2))
    got = interpret(b.build(), [X, X.astype(np.float16)])
    want = wrapped(X, dtype.bits, dtype.value.startswith("i")).astype(np.int8).astype(ML[dtype])
    other = ml_dtypes.uint4 if dtype is DType.i2 else ml_dtypes.int2
    wants = [want, want, want.astype(np.float32), want.astype(np.int8),
             np.asarray(want.astype(np.int64) % 2 ** (4 if dtype is DType.i2 else 2)).astype(np.int8).astype(other)]
    for g, w in zip(got, wants):
        assert g.dtype == w.dtype and np.array_equal(g.astype(np.int64), w.astype(np.int64)), (g, w)
    assert int(got[0][0]) == (7 if dtype is DType.i4 else 7 if dtype is DType.u4 else -1 if dtype is DType.i2 else 3)


@pytest.mark.parametrize("dtype", CODES, ids=lambda d: d.value)
def test_cast_to_a_code_never_leaves_out_of_range_values_to_ml_dtypes(dtype: DType) -> None:
    """Far, non-finite and wide-integer values follow kiln's rule, not ml_dtypes' (whose out-of-range conversion
    changed in 0.7 and, in 0.6, gives 0 from 2**31 up where the rule wraps: 2**40 + 3 -> 3)."""
    far = np.array([2.0**40 + 3, -(2.0**40) - 3, 2.0**31 + 5, 1e300, -1e300, np.nan, np.inf, -np.inf, 9.99, -9.99,
                    -(2.0**33) + 0.5], np.float64)
    ints = np.array([300, -300, 2**40 + 3, -(2**62) - 5, 2**63 - 1], np.int64)
    big = np.array([2**64 - 1, 2**63 + 9], np.uint64)
    b = Builder("M")
    args = [b.input(n, ((len(a),), t)) for n, a, t in (("f", far, "f64"), ("i", ints, "i64"), ("u", big, "u64"))]
    b.ret(*(b.cast(a, dtype=dtype) for a in args))
    got = interpret(b.build(), [far, ints, big])
    for g, a in zip(got, (far, ints, big)):
        assert g.dtype == ML[dtype]
        assert np.array_equal(g.astype(np.int64), wrapped(a, dtype.bits, dtype.value.startswith("i"))), (a, g)


def test_narrow_floats_cast_and_compute_in_f32_rounded_back() -> None:
    """float4 has no inf or NaN (ml_dtypes saturates to ±6); f8e8m0fnu holds powers of two only."""
    x = np.array([0.48, 1.05, -3.5, 9.0, 1e6, -0.0, 0.25], np.float32)
    b = Builder("M")
    v = b.input("x", ((len(x),), "f32"))
    f4, e8 = b.cast(v, dtype=DType.f4e2m1fn), b.cast(b.abs(v), dtype=DType.f8e8m0fnu)
    b.ret(f4, b.add(f4, f4), b.mul(e8, e8))
    got = interpret(b.build(), [x])
    f4_want = x.astype(ml_dtypes.float4_e2m1fn)
    e8_want = np.abs(x).astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    wants = [f4_want, (f4_want.astype(np.float32) * 2).astype(ml_dtypes.float4_e2m1fn),
             (e8_want * e8_want).astype(ml_dtypes.float8_e8m0fnu)]
    for g, w in zip(got, wants):
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes()
    assert float(got[0][4]) == 6.0


def test_casts_from_and_to_nf4_are_refused() -> None:
    b = Builder("M")
    with pytest.raises(ShapeError, match="^cast: to nf4, whose codes index a float table"):
        b.cast(b.input("x", ((2,), "f32")), dtype=DType.nf4)
    with pytest.raises(ShapeError, match="^cast: operand 0 has packed dtype nf4; dequantize it first"):
        b.cast(b.input("c", ((2,), "nf4")), dtype=DType.f32)


def test_codes_stay_refused_by_arithmetic() -> None:
    """Only cast computes on a code: add on i2 is refused naming the operand."""
    b = Builder("M")
    x = b.input("x", ((2,), "i2"))
    with pytest.raises(ShapeError, match="add: operand 0 has dtype i2"):
        b.add(x, x)


@pytest.mark.parametrize("dtype", [*CODES, DType.f4e2m1fn, DType.f8e8m0fnu], ids=lambda d: d.value)
def test_kir_text_round_trips_the_types(dtype: DType) -> None:
    b = Builder("M")
    x = b.input("x", ((3,), dtype.value))
    b.ret(b.cast(b.cast(x, dtype=DType.f32), dtype=dtype))
    text = print_graph(b.build())
    assert f"tensor<3x{dtype.value}>" in text
    assert print_graph(parse(text)) == text
