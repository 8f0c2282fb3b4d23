"""Weight quantization in Burn's symmetric schemes and NF4: `quantize` (calibrate, scale, code) and `dequantize`.

A value kind `q{bits}{f|s}` codes into Burn's `QuantValue::range` ("s": the symmetric range); `nf4` (kiln's own,
not Burn's) codes the QLoRA paper's 16 normal-float levels as i4 indices c in [-8, 7] naming `NF4[c + 8]`, with
the block's absmax as its scale. Scales are f32, f16 or bf16 (Burn's ScaleDtype), computed in f32 and, when
narrower, rounded up to the next representable value (Burn's `ScaleDtype::round_up`). A block shape
aligns with the trailing dims (missing leading dims are 1, as cubecl's `BlockSize::to_dim_vec`) and must
divide them; an empty block is per-tensor, with one scale of shape [1]. Codes keep the weight's shape in i8
(8-bit values) or i4 (4- and 2-bit; i8 is also accepted). The math follows Burn's reference quantizer:
`scale = 2 * max(|min|, |max|) / (b - a)`, `q = clamp(round_half_away(x / scale), a, b)`, `x ~ scale * q`;
NF4 follows the paper: `scale = absmax`, `q = nearest level to x / scale`, `x ~ scale * NF4[q + 8]`.

Double quantization (QLoRA section 3, bitsandbytes' `compress_statistics`) stores f32 scales as i8 codes:
`offset = mean(scales)`, then per group of `SCALE_GROUP` consecutive scales (row-major block order)
`g = max|s - offset| / 127` and `q = clamp(round_half_away((s - offset) / g), -127, 127)`, so that
`s ~ q * g + offset`. The codes of x are computed against the exact scales, as bitsandbytes does; kiln codes
the second level linearly (q8s), where bitsandbytes uses its dynamic 8-bit map. `dequantize` takes the three
(`scales` i8, `scale_scales` f32 [groups], `scale_offset` f32 [1]) in place of float scales.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..attrs import DTYPE, INTS, Attr, one_of
from ..dtypes import DType
from ..errors import ShapeError
from ..types import Dim, TensorType
from .common import define, floating

VALUE_RANGES: dict[str, tuple[int, int]] = {"q8f": (-128, 127), "q8s": (-127, 127), "q4f": (-8, 7),
                                            "q4s": (-7, 7), "q2f": (-2, 1), "q2s": (-1, 1)}
# The NF4 levels of Dettmers et al. 2023 ("QLoRA", appendix E; bitsandbytes' `nf4` table): the normal quantiles
# Phi^-1 of 8 evenly spaced probabilities from 0.5 to delta = (1 - 1/30 + 1 - 1/32) / 2 for the positive half and
# 7 for the negative half, joined at an exact 0 and normalized by Phi^-1(delta) into [-1, 1] (test_ops_quant
# recomputes them with torch's Normal.icdf).
NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
LOOKUP_TABLES: dict[str, np.ndarray] = {"nf4": NF4}  # value kind -> levels, index = code - LOOKUP_BIAS
LOOKUP_BIAS = -8  # the i4 code of the first level


def midpoints(value: str) -> np.ndarray:
    """The f32 thresholds between consecutive levels of a lookup kind: a ratio's code is the number of them it
    exceeds (nearest level, ties to the lower one; bitsandbytes codes by the same midpoints)."""
    table = LOOKUP_TABLES[value]
    return ((table[:-1] + table[1:]) / np.float32(2)).astype(np.float32)

VALUE_KINDS = (*VALUE_RANGES, *LOOKUP_TABLES)
CALIBRATIONS = ("minmax", "absmean")
SCALE_DTYPES = (DType.f32, DType.f16, DType.bf16)  # Burn's ScaleDtype F32, F16, BF16
_CODE_DTYPES = (DType.i4, DType.i8)
SCALE_GROUP = 256  # scales per second-level scale under double quantization (the QLoRA paper's block of 256)


def value_bits(value: str) -> int:
    """Bits per code of a value kind (q8f: 8, q4s: 4, q2f: 2, nf4: 4)."""
    return int(value[-1] if value in LOOKUP_TABLES else value[1])


def code_dtype(value: str) -> DType:
    """The narrowest code dtype holding the value kind's codes: i8 for 8-bit values, i4 otherwise."""
    return DType.i8 if value_bits(value) > 4 else DType.i4


def scale_ratio(value: str) -> tuple[float, float]:
    """(m, d) with scale = peak * m / d, in that order: (2, b - a) for a range kind (Burn's compute_q_params),
    (1, 1) for a lookup, whose scale is the absmax itself."""
    if value in LOOKUP_TABLES:
        return 1.0, 1.0
    a, b = VALUE_RANGES[value]
    return 2.0, float(b - a)


def levels(value: str, codes: np.ndarray) -> np.ndarray:
    """The f32 level each code stands for before scaling: the code itself, or its entry of the lookup table."""
    if value in LOOKUP_TABLES:
        return LOOKUP_TABLES[value][codes.astype(np.int32) - LOOKUP_BIAS]
    return codes.astype(np.float32)


def block_dims(op: str, shape: Sequence[Dim], block: Sequence[int]) -> tuple[Dim, ...]:
    """The block's extent along every dim (the whole shape when per-tensor); it must divide static dims."""
    if not block:
        return tuple(shape)
    if any(b < 1 for b in block):
        raise ShapeError(f"{op}: block {list(block)} has a dim below 1")
    if len(block) > len(shape):
        raise ShapeError(f"{op}: block {list(block)} has {len(block)} dims but the tensor has rank {len(shape)}")
    dims = (1,) * (len(shape) - len(block)) + tuple(block)
    for axis, (d, b) in enumerate(zip(shape, dims)):
        if d is not None and d % b:
            raise ShapeError(f"{op}: block {list(block)} does not divide dim {axis} ({d}) of shape {list(shape)}")
    return dims


def scales_shape(op: str, shape: Sequence[Dim], block: Sequence[int]) -> tuple[Dim, ...]:
    """One scale per block (a dynamic dim gives a dynamic count); [1] when per-tensor."""
    dims = block_dims(op, shape, block)
    return tuple(None if d is None else d // b for d, b in zip(shape, dims)) if block else (1,)


def _check_codes(t: TensorType, value: str) -> None:
    """Codes are i4 or i8, wide enough for the value kind."""
    fits = [d for d in _CODE_DTYPES if d.bits >= code_dtype(value).bits]
    if t.dtype not in fits:
        raise ShapeError(f"dequantize: operand 0 (codes) has dtype {t.dtype.value}, but {value} codes are "
                         f"{' or '.join(d.value for d in fits)}")


def _compatible(a: Sequence[Dim], b: Sequence[Dim]) -> bool:
    """Same rank and equal dims wherever both are static."""
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


def scale_groups(n_scales: Dim) -> Dim:
    """Second-level scales of `n_scales` double-quantized scales: one per SCALE_GROUP, the last maybe partial."""
    return None if n_scales is None else -(-n_scales // SCALE_GROUP)


def _check_double(ts: Sequence[TensorType]) -> None:
    """Double-quantized scales: i8 codes, f32 second-level scales (one per group) and one f32 offset."""
    if len(ts) == 3:
        raise ShapeError("dequantize: operand 2 (scale_scales) needs operand 3 (scale_offset)")
    scales, groups, offset = ts[1:]
    if scales.dtype is not DType.i8:
        raise ShapeError(f"dequantize: operand 1 (scales) has dtype {scales.dtype.value}, but double-quantized "
                         "scales are i8")
    n = None if any(d is None for d in scales.shape) else int(np.prod(scales.shape))
    for i, (t, shape) in enumerate(((groups, (scale_groups(n),)), (offset, (1,))), 2):
        if t.dtype is not DType.f32 or not _compatible(t.shape, shape):
            raise ShapeError(f"dequantize: operand {i} ({'scale_scales' if i == 2 else 'scale_offset'}) is "
                             f"{t}, but {n} double-quantized scales need f32 {list(shape)}")


def _dequantize_infer(ts: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
    codes, scales = ts[:2]
    _check_codes(codes, attrs["value"])
    if len(ts) > 2:
        _check_double(ts)
    else:
        floating("dequantize", 1, scales)
    want = scales_shape("dequantize", codes.shape, attrs["block"])
    if not _compatible(scales.shape, want):
        raise ShapeError(f"dequantize: operand 1 (scales) has shape {list(scales.shape)}, but codes of shape "
                         f"{list(codes.shape)} with block {list(attrs['block'])} need {list(want)}")
    if not attrs["dtype"].is_float:
        raise ShapeError(f"dequantize: attribute 'dtype' = {attrs['dtype'].value} is not a floating dtype")
    return (codes.with_dtype(attrs["dtype"]),)


def _quantize_infer(ts: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
    x = ts[0]
    floating("quantize", 0, x)
    scales = scales_shape("quantize", x.shape, attrs["block"])
    if attrs["scale_dtype"] not in SCALE_DTYPES:
        raise ShapeError(f"quantize: attribute 'scale_dtype' = {attrs['scale_dtype'].value} is not one of "
                         f"{', '.join(d.value for d in SCALE_DTYPES)}")
    return x.with_dtype(code_dtype(attrs["value"])), TensorType(scales, attrs["scale_dtype"])


def _counts(shape: Sequence[int], dims: Sequence[int]) -> list[int]:
    """Blocks per dim (an empty dim of a per-tensor block still counts its one block)."""
    return [d // b if b else 1 for d, b in zip(shape, dims)]


def _blocked(x: np.ndarray, dims: Sequence[int]) -> np.ndarray:
    """x viewed as [n0, b0, n1, b1, ...]: block index and offset within the block, per dim."""
    return x.reshape([s for n, b in zip(_counts(x.shape, dims), dims) for s in (n, b)])


def _block_axes(rank: int) -> tuple[int, ...]:
    """The within-block axes of a `_blocked` view."""
    return tuple(range(1, 2 * rank, 2))


def _per_block(x: np.ndarray, dims: Sequence[int], reduce) -> np.ndarray:
    """`reduce` over each block, kept as [n0, 1, n1, 1, ...] to broadcast against `_blocked` views."""
    return reduce(_blocked(x, dims), axis=_block_axes(x.ndim), keepdims=True)


def round_half_away(v: np.ndarray) -> np.ndarray:
    """Rust's `f32::round`: ties round away from zero (numpy and torch round them to even)."""
    t = np.trunc(v)
    return np.where(np.abs(v - t) >= 0.5, t + np.sign(v), t)


def round_up(scales: np.ndarray, dtype: DType) -> np.ndarray:
    """Non-negative f32 scales in `dtype`, each the least representable value >= it (Burn's
    `ScaleDtype::round_up`, so that no |x| / scale exceeds the range)."""
    if dtype is DType.f32:
        return scales.astype(np.float32)
    narrow = scales.astype(dtype.numpy)
    bits = narrow.view(np.uint16) + (narrow.astype(np.float32) < scales).astype(np.uint16)
    return bits.view(dtype.numpy)


def _scales(x: np.ndarray, dims: Sequence[int], value: str, calibration: str) -> np.ndarray:
    """Burn's `compute_q_params` per block: 2 * max(|min|, |max|) / (b - a) (absmax for a lookup), in f32.

    max(|min|, |max|) is max|x| exactly; `absmean` (BitNet) calibrates the range [-mean|x|, mean|x|] instead.
    """
    if calibration == "absmean":
        peak = _per_block(np.abs(x), dims, np.mean)
    else:
        peak = _per_block(np.abs(x), dims, functools.partial(np.max, initial=0))
    m, d = scale_ratio(value)
    return (peak * np.float32(m) / np.float32(d)).astype(np.float32)


def _code(ratio: np.ndarray, value: str) -> np.ndarray:
    """The code of x / scale: the nearest table level's index for a lookup, else Burn's clamped rounding."""
    if value in LOOKUP_TABLES:
        above = np.nan_to_num(ratio, nan=0.0)[..., None] > midpoints(value)
        return above.sum(axis=-1) + LOOKUP_BIAS
    a, b = VALUE_RANGES[value]
    return np.nan_to_num(np.clip(round_half_away(ratio), a, b), nan=0.0)


def quantize(x: np.ndarray, value: str, block: Sequence[int], calibration: str,
             scale_dtype: DType = DType.f32) -> tuple[np.ndarray, np.ndarray]:
    """Codes and scales of x; a NaN quotient (a zero block) codes as 0, as Rust's saturating `as` cast."""
    x = x.astype(np.float32)
    dims = block_dims("quantize", x.shape, block)
    scales = round_up(_scales(x, dims, value, calibration), scale_dtype)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = _blocked(x, dims) / scales.astype(np.float32)
    codes = _code(ratio, value).astype(code_dtype(value).numpy).reshape(x.shape)
    return codes, scales.reshape(scales_shape("quantize", x.shape, block))


def check_double_quant(value: str) -> None:
    """Double quantization is kiln's own (NF4's) form, so Burn's schemes stay Burn's."""
    if value not in LOOKUP_TABLES:
        raise ShapeError(f"double quantization is defined for {', '.join(LOOKUP_TABLES)} only, not {value}")


def double_quantize(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(i8 codes, f32 group scales, f32 [1] offset) of f32 scales: the module docstring's double quantization."""
    flat = scales.astype(np.float32).reshape(-1)
    offset = np.float32(flat.mean()) if flat.size else np.float32(0)
    centered = flat - offset
    groups = scale_groups(flat.size)
    padded = np.zeros(groups * SCALE_GROUP, np.float32)
    padded[:flat.size] = centered
    peak = np.abs(padded.reshape(groups, SCALE_GROUP)).max(axis=1)
    group_scales = (peak / np.float32(127)).astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = centered / np.repeat(group_scales, SCALE_GROUP)[:flat.size]
    q = np.nan_to_num(np.clip(round_half_away(ratio), -127, 127), nan=0.0).astype(np.int8)
    return q.reshape(scales.shape), group_scales, np.array([offset], np.float32)


def double_scales(codes: np.ndarray, group_scales: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The f32 scales double-quantized codes stand for: q * g(group) + offset."""
    flat = codes.reshape(-1).astype(np.float32)
    groups = np.repeat(group_scales.astype(np.float32), SCALE_GROUP)[:flat.size]
    return (flat * groups + offset.astype(np.float32)[0]).reshape(codes.shape)


def dequantize(codes: np.ndarray, scales: np.ndarray, value: str, block: Sequence[int], dtype: DType,
               scale_scales: np.ndarray | None = None, scale_offset: np.ndarray | None = None) -> np.ndarray:
    """scale(block of each element) * level(code), computed in the scales' compute dtype (f32 for f16/bf16
    scales, as Burn widens them, and for double-quantized ones), as `dtype`."""
    if scale_scales is not None and scale_offset is not None:
        scales = double_scales(scales, scale_scales, scale_offset)
    dims = block_dims("dequantize", codes.shape, block)
    compute = DType.from_numpy(scales.dtype).compute.numpy
    grid = np.expand_dims(scales.astype(compute).reshape(_counts(codes.shape, dims)), _block_axes(codes.ndim))
    return (_blocked(levels(value, codes).astype(compute), dims) * grid).reshape(codes.shape).astype(dtype.numpy)


_SCHEME = {"value": Attr(one_of(*VALUE_KINDS), doc="Burn's QuantValue (q8f, q8s, q4f, q4s, q2f, q2s) or kiln's nf4"),
           "block": Attr(INTS, (), "block shape over the trailing dims; empty is per-tensor")}

define("quantize", ("x",), _quantize_infer,
       lambda xs, attrs: quantize(xs[0], attrs["value"], attrs["block"], attrs["calibration"], attrs["scale_dtype"]),
       {**_SCHEME, "calibration": Attr(one_of(*CALIBRATIONS), "minmax"),
        "scale_dtype": Attr(DTYPE, DType.f32, "Burn's ScaleDtype of the scales: f32, f16 or bf16")},
       doc="(codes, scales): Burn's symmetric quantization of x, calibrated by min/max or mean |x|")
define("dequantize", ("codes", "scales", "scale_scales?", "scale_offset?"), _dequantize_infer,
       lambda xs, attrs: (dequantize(*xs[:2], attrs["value"], attrs["block"], attrs["dtype"], *xs[2:]),),
       {**_SCHEME, "dtype": Attr(DTYPE, DType.f32),
        "calibration": Attr(one_of(*CALIBRATIONS), "minmax", "how the codes were calibrated: not read here, kept so "
                                                             "materialize{requantize} re-quantizes alike")},
       doc="scale * level(code) per block: the float value of quantized codes (double-quantized scales: "
           "scale = scales * scale_scales[group] + scale_offset)")
