"""How kiln dtypes are stored in TVM tensors: sub-byte codes (i4, u4, i2, u2, nf4) travel one per byte as
int8/uint8.

The float8 dtypes have no TVM lowering: TVM 0.27's LLVM backend fails to build a vectorized f32 -> float8 cast
(`if_then_else can only take scalar condition`), decodes float8 NaN and inf as finite numbers, and folds a
f32 -> float8 -> f32 round trip away; so the lowering refuses them, naming the op (the interpreter computes them).
float4 (f4e2m1fn) and f8e8m0fnu are refused the same way.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, KilnError

_TVM = {DType.f64: "float64", DType.f32: "float32", DType.f16: "float16", DType.bf16: "bfloat16",
        DType.i64: "int64", DType.i32: "int32", DType.i16: "int16", DType.i8: "int8", DType.u8: "uint8",
        DType.bool: "bool", DType.i4: "int8", DType.u4: "uint8", DType.nf4: "uint8",
        DType.u64: "uint64", DType.u32: "uint32", DType.u16: "uint16", DType.i2: "int8", DType.u2: "uint8"}


def check_lowerable(what: str, dtype: DType) -> None:
    """Refuse a dtype TVM cannot compute (the float8s and float4), naming `what` holds it."""
    if dtype not in _TVM:
        raise KilnError(f"{what} has dtype {dtype.value}, which kiln does not lower to TVM (TVM 0.27's LLVM "
                        "backend miscompiles float8; kiln lowers no float4 either); run it on the interpreter")


def tvm_dtype(dtype: DType) -> str:
    """The TVM dtype string holding one element of `dtype`."""
    check_lowerable("a value", dtype)
    return _TVM[dtype]


def storage_numpy(dtype: DType) -> np.dtype:
    """The numpy dtype of the array TVM reads and writes for `dtype`."""
    if not dtype.is_packed:
        return dtype.numpy
    return np.dtype(np.int8) if dtype.is_int_code and dtype.int_range[0] < 0 else np.dtype(np.uint8)


def to_storage(array: np.ndarray, dtype: DType) -> np.ndarray:
    """A C-contiguous array in TVM's storage dtype for `dtype` (sub-byte codes widened to a byte each)."""
    return np.array(array, dtype=storage_numpy(dtype), order="C", copy=None)


def from_storage(array: np.ndarray, dtype: DType) -> np.ndarray:
    """The kiln-typed view of an array read back from TVM."""
    return array if array.dtype == dtype.numpy else array.astype(dtype.numpy)
