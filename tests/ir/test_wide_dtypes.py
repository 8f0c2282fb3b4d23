"""The unsigned (u16, u32, u64) and float8 (f8e4m3fn, f8e4m3fnuz, f8e5m2, f8e5m2fnuz) dtypes in the IR: `.kir`
text, type rules and the interpreter, checked against numpy integer arithmetic and ml_dtypes' float8 conversions."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kiln.ir import Builder, DType, ShapeError, interpret, parse, print_graph

UNSIGNED = (DType.u16, DType.u32, DType.u64)
FLOAT8 = (DType.f8e4m3fn, DType.f8e4m3fnuz, DType.f8e5m2, DType.f8e5m2fnuz)
ML = {DType.f8e4m3fn: ml_dtypes.float8_e4m3fn, DType.f8e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
      DType.f8e5m2: ml_dtypes.float8_e5m2, DType.f8e5m2fnuz: ml_dtypes.float8_e5m2fnuz}
# values every float8 holds exactly, the greatest finite one, and (where the type has them) -0, inf and NaN
EDGES = np.array([0.0, -0.0, 1.5, -0.25, np.inf, -np.inf, np.nan], np.float32)


def test_dtype_properties() -> None:
    for d in UNSIGNED:
        assert d.is_int and not d.is_float and d.kind == "int" and d.compute is d
        assert d.int_range == (0, 2**d.bits - 1) and d.numpy == np.dtype(f"uint{d.bits}")
    for d in FLOAT8:
        assert d.is_float and d.is_float8 and d.bits == 8 and d.numpy.itemsize == 1
        assert d.compute is DType.f32  # computed on in f32 and rounded back, as f16 and bf16
        assert d.finite_max == float(ml_dtypes.finfo(ML[d]).max)
    assert [DType.f8e4m3fn.finite_max, DType.f8e4m3fnuz.finite_max, DType.f8e5m2.finite_max] == [448, 240, 57344]
    assert all(DType.from_numpy(d.numpy) is d for d in (*UNSIGNED, *FLOAT8))


@pytest.mark.parametrize("dtype", [*UNSIGNED, *FLOAT8], ids=lambda d: d.value)
def test_kir_text_round_trips_types_and_constants(dtype: DType) -> None:
    if dtype.is_int:
        values = np.array([0, 1, dtype.int_range[1]], dtype.numpy)
    else:
        values = EDGES.astype(ML[dtype])  # inf becomes NaN where the type has no inf
    b = Builder("M")
    x = b.input("x", ((3 if dtype.is_int else len(EDGES),), dtype.value))
    b.ret(b.equal(x, b.constant(values)))
    text = print_graph(b.build())
    assert f"tensor<3x{dtype.value}>" in text or f"tensor<7x{dtype.value}>" in text
    again = parse(text)
    assert print_graph(again) == text
    const = again.functions["forward"].ops[0].attrs["value"]
    nan = np.isnan(values.astype(np.float32)) if dtype.is_float else np.zeros(values.shape, bool)
    assert const.dtype == values.dtype and np.array_equal(np.isnan(const.astype(np.float64)), nan)
    assert const[~nan].tobytes() == values[~nan].tobytes()  # bit for bit, -0 kept (text keeps no NaN sign)


def test_unsigned_arithmetic_wraps_and_compares_as_numpy() -> None:
    """Integer ops on u32 wrap modulo 2**32; u64 comparisons order values above 2**63 correctly."""
    b = Builder("M")
    x, y = b.input("x", ((3,), "u32")), b.input("y", ((3,), "u32"))
    p, q = b.input("p", ((3,), "u64")), b.input("q", ((3,), "u64"))
    u, v = b.input("u", ((3,), "u16")), b.input("v", ((3,), "u16"))
    b.ret(b.add(x, y), b.mul(x, y), b.less(p, q), b.maximum(u, v), b.div(p, q))
    xs = [np.array([1, 2**32 - 1, 70000], np.uint32), np.array([2**32 - 1, 2, 70000], np.uint32),
          np.array([2**63, 2**64 - 1, 5], np.uint64), np.array([2**63 - 1, 2**64 - 2, 6], np.uint64),
          np.array([0, 65535, 9], np.uint16), np.array([65535, 1, 8], np.uint16)]
    add, mul, less, most, div = interpret(b.build(), xs)
    wrap = 2**32
    assert add.tolist() == [(int(a) + int(c)) % wrap for a, c in zip(xs[0], xs[1])] and add.dtype == np.uint32
    assert mul.tolist() == [(int(a) * int(c)) % wrap for a, c in zip(xs[0], xs[1])]
    assert less.tolist() == [int(a) < int(c) for a, c in zip(xs[2], xs[3])]
    assert most.tolist() == [max(int(a), int(c)) for a, c in zip(xs[4], xs[5])] and most.dtype == np.uint16
    assert div.tolist() == [int(a) // int(c) for a, c in zip(xs[2], xs[3])] and div.dtype == np.uint64


@pytest.mark.parametrize("dtype", FLOAT8, ids=lambda d: d.value)
def test_cast_to_float8_rounds_to_nearest_even_and_does_not_saturate(dtype: DType) -> None:
    """kiln's cast is ONNX's `saturate=0`: "[x] > FLT_MAX -> NaN" for the fn/fnuz types, "Inf" for E5M2; ml_dtypes
    converts the same way."""
    x = np.array([0.3, -0.3, 6.5e4, -6.5e4, np.inf, np.nan, 449.0, 465.0, 2e-9], np.float32)  # 6.5e4: past every max
    for source in (x, x.astype(np.float16)):
        b = Builder("M")
        v = b.input("x", ((len(x),), "f32" if source.dtype == np.float32 else "f16"))
        b.ret(b.cast(v, dtype=dtype))
        (got,) = interpret(b.build(), [source])
        want = source.astype(np.float32).astype(ML[dtype])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    if dtype is DType.f8e5m2:
        assert np.isposinf(np.float32(got[2]))
    else:
        assert np.isnan(np.float32(got[2]))


def test_float8_arithmetic_runs_in_f32_rounded_back() -> None:
    a = np.array([1.5, 448.0, 0.0625], ml_dtypes.float8_e4m3fn)
    c = np.array([0.125, 448.0, 3.0], ml_dtypes.float8_e4m3fn)
    b = Builder("M")
    b.ret(b.add(b.input("a", ((3,), "f8e4m3fn")), b.input("c", ((3,), "f8e4m3fn"))))
    (got,) = interpret(b.build(), [a, c])
    want = (a.astype(np.float32) + c.astype(np.float32)).astype(ml_dtypes.float8_e4m3fn)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


def test_type_rules_stay_on_the_ops() -> None:
    """pow is declared floating: a u32 operand is refused naming it; the float8s are floating dtypes."""
    b = Builder("M")
    x = b.input("x", ((2,), "u32"))
    with pytest.raises(ShapeError, match="pow: operand 0 has dtype u32, expected a floating dtype"):
        b.pow(x, x)
    b.ret(b.pow(b.input("f", ((2,), "f8e5m2")), b.input("g", ((2,), "f8e5m2"))))
