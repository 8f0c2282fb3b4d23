"""kiln tensors as ONNX tensors: the dtype mapping, and initializers named by module path carrying their ParamIds.

kiln's exporter stores each parameter's ParamId in the initializer's `metadata_props` (key `kiln.param_id`,
decimal), so reading a model back restores the ids; an initializer without one gets an id derived from its name and
content (its description and inline bytes, or where its external data lies), so two reads of one file agree.
External data is memory-mapped, never copied.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from onnx import TensorProto, numpy_helper

from kiln.ir import DType, KilnError, ParamId, RecordError
from kiln.runtime.records.record import ModuleRecord, RecordEntry

PARAM_ID_KEY = "kiln.param_id"

_TO_ONNX: dict[DType, int] = {
    DType.f64: TensorProto.DOUBLE, DType.f32: TensorProto.FLOAT, DType.f16: TensorProto.FLOAT16,
    DType.bf16: TensorProto.BFLOAT16, DType.i64: TensorProto.INT64, DType.i32: TensorProto.INT32,
    DType.i16: TensorProto.INT16, DType.i8: TensorProto.INT8, DType.u8: TensorProto.UINT8,
    DType.bool: TensorProto.BOOL, DType.i4: TensorProto.INT4, DType.u4: TensorProto.UINT4,
    DType.u64: TensorProto.UINT64, DType.u32: TensorProto.UINT32, DType.u16: TensorProto.UINT16,
    DType.f8e4m3fn: TensorProto.FLOAT8E4M3FN, DType.f8e4m3fnuz: TensorProto.FLOAT8E4M3FNUZ,
    DType.f8e5m2: TensorProto.FLOAT8E5M2, DType.f8e5m2fnuz: TensorProto.FLOAT8E5M2FNUZ,
    DType.f8e8m0fnu: TensorProto.FLOAT8E8M0, DType.f4e2m1fn: TensorProto.FLOAT4E2M1, DType.i2: TensorProto.INT2,
    DType.u2: TensorProto.UINT2,
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
    """A model's initializers by name, in file order; data (inline or external) is read only when used.

    Everything is checked when the file opens, so a bad file fails naming the file, the initializer and the field:
    names (present, unique), dims, the bytes inline data must have, and external data (a file inside the model's
    folder, whole integer offset and length that fit it)."""
    source = Path(path)
    return model_initializers(load_model(source), source)


def load_model(source: Path) -> onnx.ModelProto:
    """The model in the file, external data left where it lies; what is not an ONNX model is a RecordError."""
    raw = source.read_bytes()  # a model that cannot be read is an OSError (the command line's I/O exit)
    if not raw:
        raise RecordError(f"{source}: empty file, not an ONNX model")
    try:
        model = onnx.load_from_string(raw)
    except (DecodeError, ValueError, RuntimeError) as error:
        raise RecordError(f"{source}: not an ONNX model ({error})") from None
    if not model.HasField("graph"):
        raise RecordError(f"{source}: not an ONNX model (it has no graph)")
    check_text(model, source)
    return model


def _non_text(message: Message, path: str) -> str | None:
    """The path of the first string field under `message` that holds bytes which are not UTF-8 (ONNX's proto2
    strings are not validated when parsed: protobuf hands such a field back as bytes). Bytes fields (raw tensor
    data) are never read, so a large model is walked without copying its weights."""
    for field in message.DESCRIPTOR.fields:
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_STRING:
            values = getattr(message, field.name) if repeated else [getattr(message, field.name)]
            for i, value in enumerate(values):
                if isinstance(value, bytes):
                    return f"{path}{field.name}{f'[{i}]' if repeated else ''}"
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            children = getattr(message, field.name) if repeated else \
                [getattr(message, field.name)] if message.HasField(field.name) else []
            for i, child in enumerate(children):
                found = _non_text(child, f"{path}{field.name}{f'[{i}]' if repeated else ''}.")
                if found is not None:
                    return found
    return None


def check_text(model: onnx.ModelProto, source: Path) -> None:
    """A RecordError naming the file and the field where a name or other string of the model is not UTF-8 text."""
    found = _non_text(model, "")
    if found is not None:
        raise RecordError(f"{source}: {found} is not UTF-8 text")


def model_initializers(model: onnx.ModelProto, source: Path) -> dict[str, RecordEntry]:
    """`read_initializers` of a model already parsed; external data locations are relative to `source`'s folder."""
    entries: dict[str, RecordEntry] = {}
    owners: dict[int, str] = {}  # ParamId -> the initializer that has it
    for index, tensor in enumerate(model.graph.initializer):
        where = f"{source}: initializer {tensor.name!r}" if tensor.name else f"{source}: initializer {index}"
        if not tensor.name:
            raise RecordError(f"{where} has an empty name")
        if tensor.name in entries:
            raise RecordError(f"{where} appears twice")
        try:
            dtype = kiln_dtype(tensor.data_type)
            if any(d < 0 for d in tensor.dims):
                raise RecordError(f"dims {list(tensor.dims)} has a negative dim")
            check = _external if tensor.data_location == TensorProto.EXTERNAL else _inline
            check(tensor, dtype, source.parent)
            param_id = param_id_of(tensor)
        except RecordError as error:
            raise RecordError(f"{where}: {error}") from None
        if owners.setdefault(param_id, tensor.name) != tensor.name:
            raise RecordError(f"{where}: has ParamId {param_id}, as initializer {owners[param_id]!r} has")
        entries[tensor.name] = RecordEntry(param_id, dtype, tuple(tensor.dims),
                                           functools.partial(_load, tensor, source, where))
    return entries


def _nbytes(tensor: TensorProto, dtype: DType) -> int:
    """The bytes raw data of the tensor's dims and dtype holds (sub-byte values two per byte)."""
    numel = math.prod(tensor.dims)
    return (numel * dtype.bits + 7) // 8


def _inline(tensor: TensorProto, dtype: DType, folder: Path) -> None:
    """Inline raw data has exactly the bytes the dims need (typed fields are counted by onnx when read)."""
    if tensor.HasField("raw_data") and len(tensor.raw_data) != _nbytes(tensor, dtype):
        raise RecordError(f"raw_data has {len(tensor.raw_data):,} bytes, but dims {list(tensor.dims)} of "
                          f"{dtype.value} need {_nbytes(tensor, dtype):,}")


def _external(tensor: TensorProto, dtype: DType, folder: Path) -> None:
    """External data names a regular file inside the model's folder, with whole offset and length that fit it
    and match the dims."""
    fields = {entry.key: entry.value for entry in tensor.external_data}
    location = fields.get("location", "")
    target = (folder / location).resolve()
    if not location or Path(location).is_absolute() or not target.is_relative_to(folder.resolve()):
        raise RecordError(f"external_data location {location!r} is not a file inside the model's folder")
    if not target.is_file():
        raise RecordError(f"external_data location {location!r}: no such file beside the model")
    numbers = {}
    for key in ("offset", "length"):
        text = fields.get(key, "0" if key == "offset" else str(_nbytes(tensor, dtype)))
        if not text.isdigit():
            raise RecordError(f"external_data {key} {text!r} is not a non-negative integer")
        numbers[key] = int(text)
    size = target.stat().st_size
    if numbers["length"] != _nbytes(tensor, dtype):
        raise RecordError(f"external_data length {numbers['length']:,} does not match dims {list(tensor.dims)} of "
                          f"{dtype.value} ({_nbytes(tensor, dtype):,} bytes)")
    if numbers["offset"] + numbers["length"] > size:
        raise RecordError(f"external_data offset {numbers['offset']:,} + length {numbers['length']:,} is past the "
                          f"end of {location!r} ({size:,} bytes)")


def _load(tensor: TensorProto, source: Path, where: str) -> np.ndarray:
    """The tensor's values, external data as a read-only memory map; what onnx still refuses (typed fields of
    the wrong count) is a RecordError."""
    dtype = kiln_dtype(tensor.data_type)
    if tensor.data_location == TensorProto.EXTERNAL and dtype.bits >= 8:  # (sub-byte: onnx unpacks)
        fields = {entry.key: entry.value for entry in tensor.external_data}
        return np.memmap(source.parent / fields["location"], dtype.numpy, "r",
                         int(fields.get("offset", "0")), tuple(tensor.dims))
    try:
        return numpy_helper.to_array(tensor, str(source.parent))
    except (ValueError, OSError, TypeError) as error:
        raise RecordError(f"{where}: cannot read its data ({error})") from None


def param_id_of(tensor: TensorProto) -> ParamId:
    """The ParamId kiln's exporter stored on the initializer (in decimal), else one derived from the tensor as
    stored (name, type, dims, inline data or external location), which reads no external data."""
    stored = {p.key: p.value for p in tensor.metadata_props}.get(PARAM_ID_KEY)
    if stored is None:
        bare = TensorProto()
        bare.CopyFrom(tensor)
        bare.ClearField("metadata_props")
        bare.ClearField("doc_string")
        return ParamId(int.from_bytes(hashlib.blake2b(bare.SerializeToString(deterministic=True), digest_size=8,
                                                      person=b"kiln.onnx").digest(), "little"))
    try:
        return ParamId(int(stored))
    except ValueError:
        raise RecordError(f"{PARAM_ID_KEY} {stored!r} is not a u64 in decimal") from None

