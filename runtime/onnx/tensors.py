"""kiln tensors as ONNX tensors: the dtype mapping, and initializers named by module path carrying their ParamIds.

kiln's exporter stores each parameter's ParamId in the initializer's `metadata_props` (key `kiln.param_id`,
decimal), so reading a model back restores the ids; initializers without one get fresh ids.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from kiln.ir import DType, KilnError, ParamId, RecordError, new_param_id
from kiln.runtime.records.record import ModuleRecord, RecordEntry

PARAM_ID_KEY = "kiln.param_id"

_TO_ONNX: dict[DType, int] = {
    DType.f64: TensorProto.DOUBLE, DType.f32: TensorProto.FLOAT, DType.f16: TensorProto.FLOAT16,
    DType.bf16: TensorProto.BFLOAT16, DType.i64: TensorProto.INT64, DType.i32: TensorProto.INT32,
    DType.i16: TensorProto.INT16, DType.i8: TensorProto.INT8, DType.u8: TensorProto.UINT8,
    DType.bool: TensorProto.BOOL, DType.i4: TensorProto.INT4, DType.u4: TensorProto.UINT4,
}
_FROM_ONNX: dict[int, DType] = {onnx_type: dtype for dtype, onnx_type in _TO_ONNX.items()}


def onnx_dtype(dtype: DType) -> int:
    """The ONNX element type of a kiln dtype (nf4 codes index a float table ONNX lacks, so they have none)."""
    try:
        return _TO_ONNX[dtype]
    except KeyError:
        raise KilnError(f"kiln dtype {dtype.value} has no ONNX element type") from None


def kiln_dtype(onnx_type: int) -> DType:
    """The kiln dtype of an ONNX element type."""
    try:
        return _FROM_ONNX[onnx_type]
    except KeyError:
        name = TensorProto.DataType.Name(onnx_type) if onnx_type in TensorProto.DataType.values() else onnx_type
        raise RecordError(f"ONNX element type {name} has no kiln dtype") from None


def initializer(name: str, array: np.ndarray, dtype: DType, param_id: int) -> TensorProto:
    """A named initializer holding `array` as `dtype`, tagged with its ParamId."""
    onnx_dtype(dtype)  # refuse nf4, whose codes from_array would mislabel as plain uint4
    tensor = numpy_helper.from_array(np.asarray(array, dtype.numpy), name)
    tensor.metadata_props.add(key=PARAM_ID_KEY, value=str(int(param_id)))
    return tensor


def read_record(path: str | os.PathLike[str]) -> ModuleRecord:
    """An ONNX model's initializers as a record by name, with the ParamIds kiln's exporter stored on them (else new
    ones); data, inline or external, is read only when used."""
    return ModuleRecord(read_initializers(path))


def read_initializers(path: str | os.PathLike[str]) -> dict[str, RecordEntry]:
    """A model's initializers by name, in file order; data (inline or external) is read only when used."""
    source = Path(path)
    try:
        model = onnx.load(source, load_external_data=False)
    except DecodeError as error:
        raise RecordError(f"{source}: not an ONNX model ({error})") from None
    entries = {}
    for tensor in model.graph.initializer:
        try:
            dtype = kiln_dtype(tensor.data_type)
        except RecordError as error:
            raise RecordError(f"{source}: initializer {tensor.name!r}: {error}") from None
        entries[tensor.name] = RecordEntry(_param_id(tensor), dtype, tuple(tensor.dims),
                                           functools.partial(numpy_helper.to_array, tensor, str(source.parent)))
    return entries


def _param_id(tensor: TensorProto) -> ParamId:
    """The ParamId kiln's exporter stored on the initializer (in decimal), else a fresh one."""
    stored = {p.key: p.value for p in tensor.metadata_props}.get(PARAM_ID_KEY)
    if stored is None:
        return new_param_id()
    try:
        return ParamId(int(stored))
    except ValueError:
        raise RecordError(f"initializer {tensor.name!r}: {PARAM_ID_KEY} {stored!r} is not a u64 in decimal") from None

