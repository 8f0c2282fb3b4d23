"""Element types of kiln tensors and their numpy storage types (ml_dtypes for bf16, float8, float4 and sub-byte
codes)."""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    """An element type; the value is its spelling in `.kir` text."""

    f64 = "f64"
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    f8e4m3fn = "f8e4m3fn"
    f8e4m3fnuz = "f8e4m3fnuz"
    f8e5m2 = "f8e5m2"
    f8e5m2fnuz = "f8e5m2fnuz"
    f8e8m0fnu = "f8e8m0fnu"
    f4e2m1fn = "f4e2m1fn"
    i64 = "i64"
    i32 = "i32"
    i16 = "i16"
    i8 = "i8"
    u64 = "u64"
    u32 = "u32"
    u16 = "u16"
    u8 = "u8"
    bool = "bool"
    i4 = "i4"
    u4 = "u4"
    i2 = "i2"
    u2 = "u2"
    nf4 = "nf4"

    # Members are singletons, so identity hashing is exact, and C-level: Enum's own `__hash__` is Python code, a
    # cost on every dtype-keyed lookup (types in cse's table, `DType.numpy`, `is_float`) of every op of a pass.
    __hash__ = object.__hash__

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_float8(self) -> bool:
        """The 8-bit floats (ONNX's FLOAT8E4M3FN ... FLOAT8E5M2FNUZ): storage types, computed on in f32."""
        return self in _FLOAT8

    @property
    def finite_max(self) -> float:
        """The greatest finite value of a floating dtype (what a saturating cast clamps to)."""
        return float(ml_dtypes.finfo(self.numpy).max)

    @property
    def kind(self) -> str:
        """"float", "bool" or "int" (codes included): what a record entry or a Python initializer's result must
        agree with, whatever its width."""
        return "float" if self.is_float else "bool" if self is DType.bool else "int"

    @property
    def is_packed(self) -> bool:
        """Sub-byte integer codes (quantized weights' storage, ONNX's INT4/UINT4/INT2/UINT2): held one per byte,
        cast to and from, never computed on directly."""
        return self in _PACKED

    @property
    def is_int_code(self) -> bool:
        """i4, u4, i2 and u2: packed integer codes, written as integers (nf4 codes index a float table instead)."""
        return self in _INT_CODES

    @property
    def holds_values(self) -> bool:
        """Whether an element is a number itself, so that cast converts it: every dtype but nf4.

        i4/u4/i2/u2 hold their integer values unpacked (one per byte, as the interpreter and ONNX's int4 tensors
        hold them): a cast to one truncates toward zero and wraps modulo 2**bits (`to_code`), a cast from one is
        exact. Packing belongs to records (burnpack, QFloat) only, so quantized weights are unchanged;
        an nf4 code is an index into a float table, converted only by `dequantize`."""
        return self is not DType.nf4

    @property
    def int_range(self) -> tuple[int, int]:
        """The least and greatest value of an integer or integer-code dtype."""
        info = ml_dtypes.iinfo(self.numpy)
        return int(info.min), int(info.max)

    def to_code(self, x: np.ndarray) -> np.ndarray:
        """x cast to this integer code (i4/u4/i2/u2), kiln's rule in one place: truncation toward zero, then
        modulo 2**bits into the code's range (what ONNX's Cast node tests store: their inputs -9..15 to INT4 wrap);
        NaN and +-inf give 0. Reduced here in float64/int64 so that ml_dtypes only ever converts in-range values:
        its out-of-range conversion is version-dependent (0.6 wraps up to 2**31 and gives 0 beyond, 0.7 gives 0)."""
        low, high = self.int_range
        span = high - low + 1
        if DType.from_numpy(x.dtype).is_float:
            wide = np.fmod(np.trunc(x.astype(np.float64)), span)  # exact, so any magnitude wraps
            wide = np.where(np.isfinite(wide), wide, 0.0).astype(np.int64)
        else:
            wide = x.astype(np.int64)  # a u64 above 2**63 wraps modulo 2**64, which keeps it modulo 2**bits
        return ((wide - low) % span + low).astype(np.int8).astype(self.numpy)

    @property
    def compute(self) -> DType:
        """The dtype arithmetic on this one runs in: f32 for f16, bf16 and the float8s (as torch computes on CPU,
        rounding results back), the dtype itself otherwise. The interpreter, Relax and ONNX lowerings widen by it."""
        return DType.f32 if self in _NARROW_FLOATS else self

    @property
    def bits(self) -> int:
        return _BITS[self]

    @property
    def numpy(self) -> np.dtype:
        """The numpy dtype holding one element (sub-byte codes unpacked, one per byte)."""
        return _NUMPY[self]

    @staticmethod
    def from_numpy(dtype: np.dtype) -> DType:
        try:
            return _FROM_NUMPY[np.dtype(dtype)]
        except KeyError:
            raise ValueError(f"numpy dtype {np.dtype(dtype)} has no kiln DType") from None

    def __repr__(self) -> str:
        return f"DType.{self.value}"


_FLOAT8 = {DType.f8e4m3fn, DType.f8e4m3fnuz, DType.f8e5m2, DType.f8e5m2fnuz}
# ONNX's FLOAT8E8M0 (a power of two, no sign, no zero) and FLOAT4E2M1: floats stored narrow, computed on in f32
_NARROW_FLOATS = {DType.f16, DType.bf16, *_FLOAT8, DType.f8e8m0fnu, DType.f4e2m1fn}
_FLOATS = {DType.f64, DType.f32, *_NARROW_FLOATS}
_INTS = {DType.i64, DType.i32, DType.i16, DType.i8, DType.u64, DType.u32, DType.u16, DType.u8}
_INT_CODES = {DType.i4, DType.u4, DType.i2, DType.u2}
_PACKED = {*_INT_CODES, DType.nf4}
_BITS = {DType.f64: 64, DType.f32: 32, DType.f16: 16, DType.bf16: 16, DType.i64: 64, DType.i32: 32,
         DType.i16: 16, DType.i8: 8, DType.u64: 64, DType.u32: 32, DType.u16: 16, DType.u8: 8,
         DType.f8e4m3fn: 8, DType.f8e4m3fnuz: 8, DType.f8e5m2: 8, DType.f8e5m2fnuz: 8, DType.bool: 8, DType.i4: 4,
         DType.u4: 4, DType.nf4: 4, DType.f8e8m0fnu: 8, DType.f4e2m1fn: 4, DType.i2: 2, DType.u2: 2}
_NUMPY = {DType.f64: np.dtype(np.float64), DType.f32: np.dtype(np.float32), DType.f16: np.dtype(np.float16),
          DType.bf16: np.dtype(ml_dtypes.bfloat16), DType.i64: np.dtype(np.int64),
          DType.i32: np.dtype(np.int32), DType.i16: np.dtype(np.int16), DType.i8: np.dtype(np.int8),
          DType.u64: np.dtype(np.uint64), DType.u32: np.dtype(np.uint32), DType.u16: np.dtype(np.uint16),
          DType.f8e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn), DType.f8e4m3fnuz: np.dtype(ml_dtypes.float8_e4m3fnuz),
          DType.f8e5m2: np.dtype(ml_dtypes.float8_e5m2), DType.f8e5m2fnuz: np.dtype(ml_dtypes.float8_e5m2fnuz),
          DType.u8: np.dtype(np.uint8), DType.bool: np.dtype(np.bool_), DType.i4: np.dtype(ml_dtypes.int4),
          DType.u4: np.dtype(ml_dtypes.uint4), DType.nf4: np.dtype(ml_dtypes.uint4),
          DType.f8e8m0fnu: np.dtype(ml_dtypes.float8_e8m0fnu), DType.f4e2m1fn: np.dtype(ml_dtypes.float4_e2m1fn),
          DType.i2: np.dtype(ml_dtypes.int2), DType.u2: np.dtype(ml_dtypes.uint2)}
_FROM_NUMPY = {v: k for k, v in _NUMPY.items() if k is not DType.nf4}
