"""Weight quantization in Burn's symmetric schemes: `quantize` (calibrate, scale, round) and `dequantize`.

A value kind `q{bits}{f|s}` codes into Burn's `QuantValue::range` ("s": the symmetric range). A block shape
aligns with the trailing dims (missing leading dims are 1, as cubecl's `BlockSize::to_dim_vec`) and must
divide them; an empty block is per-tensor, with one scale of shape [1]. Codes keep the weight's shape in i8
(8-bit values) or i4 (4- and 2-bit; i8 is also accepted). The math follows Burn's reference quantizer:
`scale = 2 * max(|min|, |max|) / (b - a)`, `q = clamp(round_half_away(x / scale), a, b)`, `x ~ scale * q`.
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
CALIBRATIONS = ("minmax", "absmean")
_CODE_DTYPES = (DType.i4, DType.i8)


def code_dtype(value: str) -> DType:
    """The narrowest code dtype holding the value kind's range: i8 for 8-bit values, i4 otherwise."""
    return DType.i8 if int(value[1]) > 4 else DType.i4


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


def _dequantize_infer(ts: Sequence[TensorType], attrs: Mapping[str, Any]) -> tuple[TensorType, ...]:
    codes, scales = ts
    _check_codes(codes, attrs["value"])
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
    return x.with_dtype(code_dtype(attrs["value"])), TensorType(scales, DType.f32)


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


def _scales(x: np.ndarray, dims: Sequence[int], value: str, calibration: str) -> np.ndarray:
    """Burn's `compute_q_params` per block: 2 * max(|min|, |max|) / (b - a), in f32.

    max(|min|, |max|) is max|x| exactly; `absmean` (BitNet) calibrates the range [-mean|x|, mean|x|] instead.
    """
    a, b = VALUE_RANGES[value]
    if calibration == "absmean":
        peak = _per_block(np.abs(x), dims, np.mean)
    else:
        peak = _per_block(np.abs(x), dims, functools.partial(np.max, initial=0))
    return (peak * np.float32(2) / np.float32(b - a)).astype(np.float32)


def quantize(x: np.ndarray, value: str, block: Sequence[int], calibration: str) -> tuple[np.ndarray, np.ndarray]:
    """Codes and f32 scales of x; a NaN quotient (a zero block) codes as 0, as Rust's saturating `as` cast."""
    x = x.astype(np.float32)
    dims = block_dims("quantize", x.shape, block)
    scales = _scales(x, dims, value, calibration)
    a, b = VALUE_RANGES[value]
    with np.errstate(invalid="ignore", divide="ignore"):
        q = np.clip(round_half_away(_blocked(x, dims) / scales), a, b)
    codes = np.nan_to_num(q, nan=0.0).astype(code_dtype(value).numpy).reshape(x.shape)
    return codes, scales.reshape(scales_shape("quantize", x.shape, block))


def dequantize(codes: np.ndarray, scales: np.ndarray, value: str, block: Sequence[int], dtype: DType) -> np.ndarray:
    """scale(block of each element) * code, computed at the scales' precision, as `dtype`."""
    dims = block_dims("dequantize", codes.shape, block)
    grid = np.expand_dims(scales.reshape(_counts(codes.shape, dims)), _block_axes(codes.ndim))
    return (_blocked(codes.astype(scales.dtype), dims) * grid).reshape(codes.shape).astype(dtype.numpy)


_SCHEME = {"value": Attr(one_of(*VALUE_RANGES), doc="Burn's QuantValue: q8f, q8s, q4f, q4s, q2f or q2s"),
           "block": Attr(INTS, (), "block shape over the trailing dims; empty is per-tensor")}

define("quantize", ("x",), _quantize_infer,
       lambda xs, attrs: quantize(xs[0], attrs["value"], attrs["block"], attrs["calibration"]),
       {**_SCHEME, "calibration": Attr(one_of(*CALIBRATIONS), "minmax")},
       doc="(codes, scales): Burn's symmetric quantization of x, calibrated by min/max or mean |x|")
define("dequantize", ("codes", "scales"), _dequantize_infer,
       lambda xs, attrs: (dequantize(*xs, attrs["value"], attrs["block"], attrs["dtype"]),),
       {**_SCHEME, "dtype": Attr(DTYPE, DType.f32)},
       doc="scale * code per block: the float value of quantized codes")
