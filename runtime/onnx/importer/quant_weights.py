"""A QDQ model's constant int8 weight (`DequantizeLinear` of an initializer) as a kiln quantized parameter.

ONNX decodes `(q - zero_point) * scale`; with a zero point of 0 that is kiln's `dequantize` of `q8f` codes
(`scale * q`, Burn's symmetric QFloat), so the codes stay i8 in the module, its records and the TVM build. The
scale maps to a kiln block: per tensor (one scale), per axis (a block spanning every dim but `axis`) or ONNX's
blocks along `axis` (a block of `block_size` there, 1 elsewhere, which must divide the dim). Anything else (a
zero point other than 0, u8 codes above 127, i16 codes, a block that does not divide) keeps the float folding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.ir import DType


@dataclass(frozen=True)
class QuantizedWeight:
    """The i8 codes, the scales (shaped as kiln's `scales_shape`) and the `dequantize` attributes."""

    codes: np.ndarray
    scales: np.ndarray
    attrs: dict


def kiln_scheme(codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, axis: int, block_size: int,
                dtype: DType) -> QuantizedWeight | None:
    """The kiln form of `DequantizeLinear(codes, scale, zero_point)` giving `dtype`, or None where kiln has none."""
    if zero_point is not None and np.any(zero_point):
        return None
    if codes.dtype == np.uint8 and (codes.size == 0 or codes.max() <= 127):
        codes = codes.astype(np.int8)  # u8 codes with a zero point of 0 that fit i8 are the same integers
    if codes.dtype != np.int8 or codes.ndim == 0:
        return None
    if scale.dtype != np.float32 or not dtype.is_float:  # f32 scales: kiln's product is ONNX's exactly
        return None
    axis %= codes.ndim
    if scale.size == 1 and not block_size:
        block, shape = (), (1,)
    elif not block_size and scale.ndim == 1 and scale.size == codes.shape[axis]:
        block = tuple(1 if a == axis else d for a, d in enumerate(codes.shape))
        shape = tuple(d if a == axis else 1 for a, d in enumerate(codes.shape))
    elif block_size and scale.ndim == codes.ndim and codes.shape[axis] % block_size == 0:
        block = tuple(block_size if a == axis else 1 for a in range(codes.ndim))
        shape = tuple(d // block_size if a == axis else d for a, d in enumerate(codes.shape))
        if scale.shape != shape:
            return None
    else:
        return None
    return QuantizedWeight(codes, np.ascontiguousarray(scale.reshape(shape)),
                           {"value": "q8f", "block": block, "dtype": dtype})
