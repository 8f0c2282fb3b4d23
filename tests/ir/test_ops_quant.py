"""quantize / dequantize against an independent re-derivation of Burn's reference quantizer and against torch."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.ir import DType, ShapeError, TensorType, evaluate_op
from kiln.ir.registry import infer

# Burn's QuantValue::range, written out again here rather than imported
RANGES = {"q8f": (-128, 127), "q8s": (-127, 127), "q4f": (-8, 7), "q4s": (-7, 7), "q2f": (-2, 1), "q2s": (-1, 1)}
CODES = {"q8f": np.int8, "q8s": np.int8, "q4f": ml_dtypes.int4, "q4s": ml_dtypes.int4, "q2f": ml_dtypes.int4,
         "q2s": ml_dtypes.int4}
BLOCKS = [(), (3,), (1, 3), (2, 6), (4, 6)]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(7)


def kiln_type(a: np.ndarray) -> TensorType:
    return TensorType(tuple(a.shape), DType.from_numpy(a.dtype))


def run(kind: str, *arrays: np.ndarray, **attrs: Any) -> tuple[np.ndarray, ...]:
    """Infer the op's types from the arrays and evaluate its reference semantics."""
    full, types = infer(kind, [kiln_type(a) for a in arrays], attrs)
    outs = evaluate_op(kind, arrays, full, types)
    assert [kiln_type(o) for o in outs] == list(types)
    return outs


def rust_round(v: float) -> int:
    """Rust's f32::round for an f32 value: |v| + 0.5 is exact in f64, so the floor is the away-from-zero round."""
    return int(math.copysign(math.floor(abs(v) + 0.5), v))


def full_block(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """cubecl's BlockSize::to_dim_vec: the block right-aligned, leading dims 1; per-tensor is the whole shape."""
    return (1,) * (len(shape) - len(block)) + block if block else shape


def burn_quantize(x: np.ndarray, value: str, block: tuple[int, ...], calibration: str = "minmax"
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Burn's reference quantizer, block by block and element by element."""
    a, b = RANGES[value]
    x = x.astype(np.float32)
    dims = full_block(x.shape, block)
    grid = tuple(d // k for d, k in zip(x.shape, dims))
    codes, scales = np.zeros(x.shape, np.int64), np.zeros(grid, np.float32)
    for index in np.ndindex(*grid):
        where = tuple(slice(i * k, (i + 1) * k) for i, k in zip(index, dims))
        values = x[where]
        if calibration == "minmax":
            low, high = values.min(), values.max()
        else:
            gamma = np.abs(values).mean(dtype=np.float32)
            low, high = -gamma, gamma
        scales[index] = np.float32(max(abs(low), abs(high)) * np.float32(2)) / np.float32(b - a)
        for offset in np.ndindex(*values.shape):
            q = values[offset] / scales[index]
            codes[where][offset] = 0 if np.isnan(q) else min(max(rust_round(float(q)), a), b)
    return codes.astype(CODES[value]), scales.reshape(grid if block else (1,))


def per_element(scales: np.ndarray, shape: tuple[int, ...], block: tuple[int, ...]) -> np.ndarray:
    """Each element's block scale, by repeating the scale grid."""
    out = scales.reshape(()) if not block else scales
    for axis, k in enumerate(full_block(shape, block) if block else ()):
        out = np.repeat(out, k, axis)
    return np.broadcast_to(out, shape)


# -- quantize: the math ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("value", list(RANGES))
@pytest.mark.parametrize("calibration", ["minmax", "absmean"])
def test_quantize_matches_burns_formulas(rng: np.random.Generator, value: str, block: tuple[int, ...],
                                         calibration: str) -> None:
    x = rng.standard_normal((4, 6)).astype(np.float32)
    codes, scales = run("quantize", x, value=value, block=block, calibration=calibration)
    want_codes, want_scales = burn_quantize(x, value, block, calibration)
    assert codes.dtype == want_codes.dtype and scales.dtype == np.float32
    np.testing.assert_allclose(scales, want_scales, rtol=1e-6 if calibration == "absmean" else 0)
    np.testing.assert_array_equal(codes.astype(np.int64), want_codes.astype(np.int64))


@pytest.mark.parametrize("value", ["q8s", "q8f", "q4s", "q2f"])
@pytest.mark.parametrize("block", [(), (6,), (2, 3)], ids=str)
def test_quantize_matches_torch(rng: np.random.Generator, value: str, block: tuple[int, ...]) -> None:
    """torch.round agrees away from ties, which random inputs do not hit."""
    a, b = RANGES[value]
    x = rng.standard_normal((4, 6)).astype(np.float32)
    codes, scales = run("quantize", x, value=value, block=block)
    k0, k1 = full_block(x.shape, block)
    blocks = torch.from_numpy(x).reshape(4 // k0, k0, 6 // k1, k1)
    scale = 2 * blocks.abs().amax(dim=(1, 3), keepdim=True) / (b - a)
    want = torch.clamp(torch.round(blocks / scale), a, b).reshape(4, 6)
    np.testing.assert_array_equal(codes.astype(np.int64), want.numpy().astype(np.int64))
    np.testing.assert_array_equal(scales, scale.reshape(scales.shape).numpy())


def test_ties_round_away_from_zero_unlike_torch() -> None:
    """With scale = 0.0625 exactly, x = (k + 0.5) * scale is a tie: Burn rounds it away from zero."""
    halves = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5], np.float32)
    x = np.concatenate([halves, [127.0]]).astype(np.float32) * np.float32(0.0625)
    codes, scales = run("quantize", x, value="q8s")
    assert scales.tolist() == [0.0625]
    assert codes.tolist() == [1, 2, 3, -1, -3, 127, -127, 127]
    even = torch.round(torch.from_numpy(halves)).tolist()
    assert even == [0, 2, 2, -0.0, -2, 126, -126]  # torch (and numpy) break ties to even


@pytest.mark.parametrize("value", list(RANGES))
def test_every_value_kind_rounds_ties_away_from_zero(value: str) -> None:
    """Scale 1 exactly (max |x| = (b - a) / 2): every half-integer in the range is a tie."""
    a, b = RANGES[value]
    m = (b - a) / 2
    halves = [h for h in np.arange(a, b) + 0.5 if abs(h) <= m]
    x = np.array([m, *halves], np.float32)
    codes, scales = run("quantize", x, value=value)
    want, _ = burn_quantize(x, value, ())
    assert scales.tolist() == [1.0]
    assert codes.astype(np.int64).tolist() == want.astype(np.int64).tolist()
    assert codes[1:].astype(np.int64).tolist() == [int(np.sign(h) * np.ceil(abs(h))) for h in halves]


@pytest.mark.parametrize("value", ["q8f", "q4f", "q2f"])
def test_codes_clamp_to_the_value_range(value: str) -> None:
    """A full range [a, b] has scale 2 * max / (b - a): the maximum maps to b + 0.5, rounds up and clamps to b."""
    a, b = RANGES[value]
    x = np.array([-(b - a) / 2, (b - a) / 2, 0.0], np.float32)  # scale 1 exactly
    codes, scales = run("quantize", x, value=value)
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [a, b, 0]


def test_absmean_clamps_values_beyond_the_mean() -> None:
    x = np.array([4.0, -1.0, 1.0, -2.0], np.float32)  # mean |x| = 2, so the range is [-2, 2]
    codes, scales = run("quantize", x, value="q2s", calibration="absmean")
    assert scales.tolist() == [2.0]
    assert codes.tolist() == [1, -1, 1, -1]  # 4 / 2 = 2 clamps to 1; the ties -0.5 and 0.5 round away from 0


def test_zero_block_has_zero_scale_and_codes() -> None:
    x = np.array([[0.0, 0.0], [1.0, -0.5]], np.float32)
    codes, scales = run("quantize", x, value="q8s", block=(1, 2))
    assert scales.ravel().tolist() == [0.0, np.float32(1.0) / np.float32(127)]
    assert codes.tolist() == [[0, 0], [127, -64]]
    (deq,) = run("dequantize", codes, scales, value="q8s", block=(1, 2))
    assert deq[0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("value", list(RANGES))
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_round_trip_error_is_at_most_half_a_scale(rng: np.random.Generator, value: str,
                                                  block: tuple[int, ...]) -> None:
    x = (rng.standard_normal((4, 6)) * 3).astype(np.float32)
    codes, scales = run("quantize", x, value=value, block=block)
    (deq,) = run("dequantize", codes, scales, value=value, block=block)
    half = per_element(scales, x.shape, block) / 2
    assert np.all(np.abs(x - deq) <= half + 4 * np.spacing(np.abs(x)))  # up to f32 rounding of x / scale


def test_per_block_is_tighter_than_per_tensor(rng: np.random.Generator) -> None:
    x = rng.standard_normal((4, 6)).astype(np.float32) * np.array([1, 1, 1, 100, 100, 100], np.float32)
    errors = {}
    for block in [(), (3,)]:
        codes, scales = run("quantize", x, value="q4s", block=block)
        (deq,) = run("dequantize", codes, scales, value="q4s", block=block)
        errors[block] = np.abs(x - deq)[:, :3].max()
    assert errors[(3,)] < errors[()] / 10


# -- dequantize -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", list(RANGES))
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_dequantize_is_scale_times_code(rng: np.random.Generator, value: str, block: tuple[int, ...]) -> None:
    a, b = RANGES[value]
    codes = rng.integers(a, b + 1, (4, 6)).astype(CODES[value])
    grid = tuple(d // k for d, k in zip((4, 6), full_block((4, 6), block))) if block else (1,)
    scales = rng.uniform(0.01, 1.0, grid).astype(np.float32)
    (deq,) = run("dequantize", codes, scales, value=value, block=block)
    want = torch.from_numpy(per_element(scales, (4, 6), block).copy()) * torch.from_numpy(codes.astype(np.int8))
    np.testing.assert_array_equal(deq, want.numpy())


@pytest.mark.parametrize("dtype", ["f64", "f16", "bf16"])
def test_dequantize_result_dtype(dtype: str) -> None:
    codes = np.array([-3, 0, 7], ml_dtypes.int4)
    (deq,) = run("dequantize", codes, np.array([0.5], np.float32), value="q4f", dtype=dtype)
    assert deq.dtype == DType(dtype).numpy and deq.astype(np.float64).tolist() == [-1.5, 0.0, 3.5]


def test_i8_codes_hold_narrow_values() -> None:
    (deq,) = run("dequantize", np.array([-2, 1], np.int8), np.array([0.25], np.float32), value="q2f")
    assert deq.tolist() == [-0.5, 0.25]


def test_scalar_and_dynamic_shapes() -> None:
    codes, scales = run("quantize", np.array(-3.0, np.float32), value="q8s")
    assert codes.shape == () and codes == -127 and scales.shape == (1,)
    _, types = infer("quantize", [TensorType((None, 6), DType.f32)], {"value": "q4s", "block": (3,)})
    assert types == (TensorType((None, 6), DType.i4), TensorType((None, 2), DType.f32))
    _, (deq,) = infer("dequantize", list(types), {"value": "q4s", "block": (3,)})
    assert deq == TensorType((None, 6), DType.f32)


# -- errors ----------------------------------------------------------------------------------------------------

F46, I46 = TensorType((4, 6), DType.f32), TensorType((4, 6), DType.i8)
ONE = TensorType((1,), DType.f32)

ERRORS = [
    ("quantize", [F46], {"value": "q8s", "block": (4,)}, r"block \[4\] does not divide dim 1 \(6\) of shape \[4, 6\]"),
    ("quantize", [F46], {"value": "q8s", "block": (3, 3)}, r"block \[3, 3\] does not divide dim 0 \(4\)"),
    ("quantize", [F46], {"value": "q8s", "block": (1, 1, 2)},
     r"block \[1, 1, 2\] has 3 dims but the tensor has rank 2"),
    ("quantize", [F46], {"value": "q8s", "block": (0,)}, r"block \[0\] has a dim below 1"),
    ("quantize", [I46], {"value": "q8s"}, r"operand 0 has dtype i8, expected a floating dtype"),
    ("quantize", [F46], {"value": "q3s"}, r"attribute 'value' = 'q3s': expected one of 'q8f'"),
    ("quantize", [F46], {"value": "q8s", "calibration": "mse"}, r"attribute 'calibration' = 'mse'"),
    ("dequantize", [I46, TensorType((4, 3), DType.f32)], {"value": "q8s", "block": (4,)},
     r"block \[4\] does not divide"),
    ("dequantize", [I46, TensorType((4, 3), DType.f32)], {"value": "q8s", "block": (3,)},
     r"operand 1 \(scales\) has shape \[4, 3\], but codes of shape \[4, 6\] with block \[3\] need \[4, 2\]"),
    ("dequantize", [I46, TensorType((), DType.f32)], {"value": "q8s"}, r"operand 1 \(scales\) has shape \[\]"),
    ("dequantize", [TensorType((4, 6), DType.i4), ONE], {"value": "q8f"},
     r"operand 0 \(codes\) has dtype i4, but q8f codes are i8"),
    ("dequantize", [F46, ONE], {"value": "q4s"}, r"operand 0 \(codes\) has dtype f32, but q4s codes are i4 or i8"),
    ("dequantize", [TensorType((4, 6), DType.u4), ONE], {"value": "q4s"}, r"operand 0 \(codes\) has dtype u4"),
    ("dequantize", [I46, TensorType((1,), DType.i32)], {"value": "q8s"}, r"operand 1 has dtype i32, expected a float"),
    ("dequantize", [I46, ONE], {"value": "q8s", "dtype": "i32"}, r"attribute 'dtype' = i32 is not a floating dtype"),
    ("dequantize", [I46, ONE], {"value": "q8s", "scale": 1.0}, r"unknown attribute 'scale'"),
    ("dequantize", [I46], {"value": "q8s"},
     r"takes operands \(codes, scales, scale_scales\?, scale_offset\?\) but got 1"),
]


@pytest.mark.parametrize("kind, types, attrs, message", ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_shape_errors(kind: str, types: list[TensorType], attrs: dict[str, Any], message: str) -> None:
    with pytest.raises(ShapeError, match=rf"^{kind}: {message}"):
        infer(kind, types, attrs)
