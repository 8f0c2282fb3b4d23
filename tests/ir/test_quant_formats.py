"""Issue 11's quantization formats in the op semantics: NF4 (the QLoRA paper's normal-float code) and f16/bf16
scales (Burn's ScaleDtype), against an element-by-element oracle written here and torch."""

from __future__ import annotations

import itertools
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

from kiln.ir import DType, ShapeError, TensorType, evaluate_op
from kiln.ir.ops.quant import NF4
from kiln.ir.registry import infer

RANGES = {"q8f": (-128, 127), "q8s": (-127, 127), "q4f": (-8, 7), "q4s": (-7, 7), "q2f": (-2, 1), "q2s": (-1, 1)}
SCALE_DTYPES = {DType.f32: torch.float32, DType.f16: torch.float16, DType.bf16: torch.bfloat16}
BLOCKS = [(), (4,)]


def run(kind: str, *arrays: np.ndarray, **attrs) -> tuple[np.ndarray, ...]:
    types = [TensorType(tuple(a.shape), DType.from_numpy(a.dtype)) for a in arrays]
    full, results = infer(kind, types, attrs)
    return evaluate_op(kind, arrays, full, results)


def nf4_levels() -> np.ndarray:
    """QLoRA (Dettmers et al. 2023) appendix E: delta = (1 - 1/(2*15) + 1 - 1/(2*16)) / 2; 8 quantiles of
    N(0, 1) at probabilities linspace(delta, 0.5, 9)[:-1] for the positive half, 7 at linspace(delta, 0.5, 8)[:-1]
    negated for the negative one, an exact 0 between, all divided by the largest."""
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    delta = (1 - 1 / 30 + 1 - 1 / 32) / 2
    pos = normal.icdf(torch.linspace(delta, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(delta, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.sort(torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])).values
    return (levels / levels.max()).numpy()


def test_nf4_levels_are_the_papers_normal_quantiles() -> None:
    """"NF4 ... 16 values ... exactly 0 and 1.0 included, asymmetric with 7 negative and 8 positive values"."""
    np.testing.assert_allclose(NF4, nf4_levels(), atol=1e-6)
    assert NF4[7] == 0.0 and NF4[-1] == 1.0 and NF4[0] == -1.0
    assert (NF4 < 0).sum() == 7 and (NF4 > 0).sum() == 8


def rounded_up(scale: float, dtype: DType) -> float:
    """Burn's ScaleDtype::round_up: the least value of `dtype` >= the f32 scale (torch's nextafter above it)."""
    t = torch.tensor([scale], dtype=torch.float32)
    narrow = t.to(SCALE_DTYPES[dtype])
    if narrow.float().item() < t.item():
        narrow = torch.nextafter(narrow, torch.tensor([math.inf], dtype=narrow.dtype))
    return narrow.float().item()


def oracle(x: np.ndarray, value: str, block: tuple[int, ...], dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales block by block: Burn's scale 2 max|x| / (b - a) and rounding half away from zero, or
    NF4's absmax scale and nearest level; the scale rounded up to its dtype before coding."""
    x32 = x.astype(np.float32)
    dims = (1,) * (x.ndim - len(block)) + block if block else x.shape
    grid = tuple(d // k for d, k in zip(x.shape, dims))
    codes, scales = np.zeros(x.shape, np.int64), np.zeros(grid, np.float64)
    for index in np.ndindex(*grid):
        where = tuple(slice(i * k, (i + 1) * k) for i, k in zip(index, dims))
        peak = np.float32(np.abs(x32[where]).max())
        if value == "nf4":
            scale = rounded_up(float(peak), dtype)
            codes[where] = np.abs(x32[where][..., None] / np.float32(scale) - NF4).argmin(-1) - 8
        else:
            a, b = RANGES[value]
            scale = rounded_up(float(peak * np.float32(2) / np.float32(b - a)), dtype)
            r = (x32[where] / np.float32(scale)).astype(np.float64)
            codes[where] = np.clip(np.sign(r) * np.floor(np.abs(r) + 0.5), a, b)
        scales[index] = scale
    return codes, scales.reshape(grid if block else (1,))


def decoded(codes: np.ndarray, scales: np.ndarray, value: str, block: tuple[int, ...]) -> np.ndarray:
    """scale * level(code) element by element, in f64."""
    dims = (1,) * (codes.ndim - len(block)) + block if block else codes.shape
    out = np.zeros(codes.shape)
    flat = scales.reshape(-1) if not block else scales
    for i in np.ndindex(*codes.shape):
        level = NF4[int(codes[i]) + 8] if value == "nf4" else int(codes[i])
        scale = flat[0] if not block else flat[tuple(j // k for j, k in zip(i, dims))]
        out[i] = float(level) * float(scale)
    return out


@pytest.mark.parametrize("dtype", list(SCALE_DTYPES), ids=lambda d: d.value)
@pytest.mark.parametrize("block", BLOCKS, ids=str)
@pytest.mark.parametrize("value", [*RANGES, "nf4"])
def test_quantize_and_dequantize_every_value_block_and_scale_dtype(value: str, block: tuple[int, ...],
                                                                   dtype: DType) -> None:
    """Burn's QuantParam: "Scales stored narrower than f32 are rounded UP (ScaleDtype::round_up)"; NF4: "absmax per
    block, normalize to [-1, 1], nearest code"."""
    x = np.random.default_rng(zlib.crc32(f"{value}{block}{dtype}".encode())).standard_normal((3, 8)).astype(np.float32)
    codes, scales = run("quantize", x, value=value, block=block, scale_dtype=dtype)
    want_codes, want_scales = oracle(x, value, block, dtype)
    assert scales.dtype == dtype.numpy
    np.testing.assert_array_equal(scales.astype(np.float64), want_scales)
    np.testing.assert_array_equal(codes.astype(np.int64), want_codes)
    (values,) = run("dequantize", codes, scales, value=value, block=block, dtype=DType.f32)
    np.testing.assert_allclose(values, decoded(codes, scales.astype(np.float64), value, block), rtol=1e-6)


def test_round_up_is_at_least_the_f32_scale_for_many_scales() -> None:
    """"scales stored narrower than f32 are rounded UP": never below the f32 scale, and the least such value."""
    x = np.random.default_rng(3).uniform(1e-3, 10.0, (64, 4)).astype(np.float32)
    for dtype in (DType.f16, DType.bf16):
        _, scales = run("quantize", x, value="q8s", block=(4,), scale_dtype=dtype)
        f32 = np.abs(x).max(axis=1) * np.float32(2) / np.float32(254)
        wide = scales.astype(np.float32).reshape(-1)
        assert (wide >= f32).all()
        np.testing.assert_array_equal(wide, [rounded_up(float(s), dtype) for s in f32])


def test_nf4_codes_are_i4_and_a_zero_block_codes_as_the_zero_level() -> None:
    """A zero block has scale 0; its codes name NF4's exact 0 (index 7), so it dequantizes to 0."""
    x = np.zeros((2, 4), np.float32)
    x[1] = [0.5, -1.0, 0.25, 1.0]
    codes, scales = run("quantize", x, value="nf4", block=(4,))
    assert codes.dtype == ml_dtypes.int4
    np.testing.assert_array_equal(codes[0].astype(int), [-1] * 4)
    (values,) = run("dequantize", codes, scales, value="nf4", block=(4,), dtype=DType.f32)
    np.testing.assert_array_equal(values[0], 0.0)
    np.testing.assert_array_equal(values[1, [1, 3]], [-1.0, 1.0])


def test_quantize_refuses_a_scale_dtype_burn_lacks() -> None:
    with pytest.raises(ShapeError, match="scale_dtype.*f64"):
        infer("quantize", [TensorType((4,), DType.f32)], {"value": "q8s", "scale_dtype": DType.f64})


def test_nf4_grid_of_every_combination_is_distinct() -> None:
    """Each (value, scale dtype) gives its own scale bytes for the same weights (nothing silently ignored)."""
    x = np.random.default_rng(5).standard_normal((2, 8)).astype(np.float32)
    seen = set()
    for value, dtype in itertools.product(("q8s", "nf4"), SCALE_DTYPES):
        _, scales = run("quantize", x, value=value, block=(8,), scale_dtype=dtype)
        seen.add((value, scales.tobytes()))
    assert len(seen) == 6


def paper_double_quant(absmax: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """QLoRA section 3 / bitsandbytes' compress_statistics, with a linear 8-bit second level: subtract the mean,
    then per 256 consecutive scales an absmax/127 scale and codes rounded half away from zero (torch)."""
    t = torch.tensor(absmax.reshape(-1), dtype=torch.float32)
    offset = t.mean()
    centered = t - offset
    groups = list(torch.split(centered, 256))
    g = torch.stack([c.abs().max() / 127 for c in groups])
    q = torch.cat([torch.clamp(torch.sign(c) * torch.floor(c.abs() / s + 0.5), -127, 127) for c, s in zip(groups, g)])
    return q.to(torch.int8).numpy().reshape(absmax.shape), g.numpy(), offset.reshape(1).numpy()


def test_double_quantization_follows_the_papers_algorithm() -> None:
    """"double quantization of the absmax scales: subtract their mean, quantize to 8-bit in blocks of 256 with one
    f32 scale per block (plus the f32 mean)"; a partial last group gets its own scale."""
    from kiln.ir.ops.quant import double_quantize

    x = np.random.default_rng(11).standard_normal((300, 128)).astype(np.float32)
    _, absmax = run("quantize", x, value="nf4", block=(64,))
    q, g, offset = double_quantize(absmax)
    want_q, want_g, want_offset = paper_double_quant(absmax)
    assert q.dtype == np.int8 and q.shape == absmax.shape and g.shape == (3,) and offset.shape == (1,)
    np.testing.assert_allclose(offset, want_offset, rtol=1e-6)
    np.testing.assert_allclose(g, want_g, rtol=1e-6)
    assert np.abs(q.astype(int) - want_q.astype(int)).max() <= 1  # a rounding tie may fall either way in f32
    # dequantize takes the three in place of the scales: NF4[c + 8] * (q * g[group] + offset)
    codes = run("quantize", x, value="nf4", block=(64,))[0]
    (values,) = run("dequantize", codes, q, g, offset, value="nf4", block=(64,), dtype=DType.f32)
    scales = q.reshape(-1).astype(np.float64) * np.repeat(g, 256)[:600] + offset[0]
    want = NF4[codes.astype(int) + 8].reshape(300, 2, 64) * scales.reshape(300, 2, 1)
    np.testing.assert_allclose(values, want.reshape(300, 128), rtol=1e-5, atol=1e-7)
    # the second level adds at most half a step of its group to each scale
    err = np.abs(scales - absmax.reshape(-1))
    assert (err <= np.repeat(g, 256)[:600] * 0.5 + 1e-6).all()


@pytest.mark.parametrize(("types", "message"), [
    ([(4, 8), DType.i4, (4, 1), DType.f32, (1,), DType.f32], r"operand 2 \(scale_scales\) needs operand 3"),
    ([(4, 8), DType.i4, (4, 1), DType.f32, (1,), DType.f32, (1,), DType.f32], r"scales\) has dtype f32.*are i8"),
    ([(4, 8), DType.i4, (4, 1), DType.i8, (2,), DType.f32, (1,), DType.f32], r"operand 2 \(scale_scales\).*\[1\]"),
    ([(4, 8), DType.i4, (4, 1), DType.i8, (1,), DType.f32, (2,), DType.f32], r"operand 3 \(scale_offset\)"),
])
def test_double_quantized_operands_are_checked(types: list, message: str) -> None:
    ts = [TensorType(types[i], types[i + 1]) for i in range(0, len(types), 2)]
    with pytest.raises(ShapeError, match=message):
        infer("dequantize", ts, {"value": "nf4", "block": (8,)})
