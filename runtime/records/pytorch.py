"""The pickle of a `torch.save` state dict, read without torch and without running code from the file.

`StateDictUnpickler.find_class` admits only the globals a state dict of tensors needs (the two tensor rebuilds, the
typed storage classes, `collections.OrderedDict`) and refuses every other one with a RecordError naming it, before
it is imported or called; the admitted names resolve to kiln's own stand-ins, which record the tensor's storage
key, offset, size and stride instead of building anything. So a hostile pickle (`os.system`, `builtins.eval`, a
REDUCE of anything but a rebuild) stops at the opcode that names it.
"""

from __future__ import annotations

import collections
import io
import math
import pickle
import pickletools
from collections.abc import Iterator
from dataclasses import dataclass

from kiln.ir import DType, RecordError

__all__ = ["StorageRef", "TensorRef", "load_state_dict"]

_STORAGES: dict[str, DType] = {
    "DoubleStorage": DType.f64, "FloatStorage": DType.f32, "HalfStorage": DType.f16, "BFloat16Storage": DType.bf16,
    "LongStorage": DType.i64, "IntStorage": DType.i32, "ShortStorage": DType.i16, "CharStorage": DType.i8,
    "ByteStorage": DType.u8, "BoolStorage": DType.bool,
}


@dataclass(frozen=True, slots=True)
class StorageType:
    """A typed storage class named by the pickle (`torch.FloatStorage`): only its dtype matters."""

    name: str
    dtype: DType

    def __call__(self, *args: object) -> object:
        raise RecordError(f"the pickle calls torch.{self.name}, which a state dict never does")


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A storage the pickle refers to by persistent id: its archive key, dtype and element count."""

    key: str
    dtype: DType
    numel: int


@dataclass(frozen=True, slots=True)
class TensorRef:
    """A tensor as the rebuild call describes it: a strided view of `storage` (nothing is read yet)."""

    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise RecordError(f"{what} {value!r} is not a tuple of non-negative integers"[:200])
    return value


def _rebuild_tensor(storage: object, offset: object, size: object, stride: object, *rest: object) -> TensorRef:
    """kiln's `torch._utils._rebuild_tensor_v2`: checks the view lies inside its storage."""
    if not isinstance(storage, StorageRef) or type(offset) is not int or offset < 0:
        raise RecordError(f"tensor rebuild got storage {type(storage).__name__} at offset {offset!r}, not a "
                          f"storage and an offset")
    shape, strides = _ints(size, "tensor size"), _ints(stride, "tensor stride")
    if len(shape) != len(strides):
        raise RecordError(f"tensor size {list(shape)} and stride {list(strides)} differ in rank")
    last = offset + sum((d - 1) * s for d, s in zip(shape, strides)) if math.prod(shape) else offset - 1
    if last >= storage.numel:
        raise RecordError(f"tensor size {list(shape)} stride {list(strides)} at offset {offset} reaches element "
                          f"{last} of storage {storage.key!r}, which has {storage.numel}")
    return TensorRef(storage, offset, shape, strides)


def _rebuild_parameter(data: object, *rest: object) -> TensorRef:
    """kiln's `torch._utils._rebuild_parameter`: a Parameter is its tensor."""
    if not isinstance(data, TensorRef):
        raise RecordError(f"parameter rebuild got {type(data).__name__}, not a tensor")
    return data


_GLOBALS: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    **{("torch", name): StorageType(name, dtype) for name, dtype in _STORAGES.items()},
}


class StateDictUnpickler(pickle.Unpickler):
    """An unpickler whose globals are kiln's stand-ins for the tensor-rebuild and storage names, and nothing else."""

    def find_class(self, module: str, name: str) -> object:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise RecordError(f"the pickle names the global {module}.{name}, which is not a tensor rebuild or "
                              f"storage: refused without running it")
        return found

    def persistent_load(self, pid: object) -> StorageRef:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage" or not isinstance(pid[1], StorageType)
                or not isinstance(pid[2], str) or type(pid[4]) is not int or pid[4] < 0):
            raise RecordError(f"persistent id {pid!r} is not a ('storage', type, key, location, numel) record"[:200])
        return StorageRef(pid[2], pid[1].dtype, pid[4])


_MEMO_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_BUFFER_OPS = frozenset({"BYTEARRAY8", "NEXT_BUFFER", "READONLY_BUFFER"})  # out-of-band data: never in a state dict


def _scan(data: bytes, source: str) -> None:
    """Parse the opcodes without running any, refusing out-of-band buffers and memo indices past the opcode count
    (the C unpickler sizes its memo by the largest index, so one huge index would allocate gigabytes)."""
    try:
        ops = list(pickletools.genops(data))
    except Exception as error:  # genops only parses
        raise RecordError(f"{source}: not a pickle ({error})"[:300]) from None
    for op, arg, at in ops:
        if op.name in _BUFFER_OPS:
            raise RecordError(f"{source}: pickle opcode {op.name} at byte {at} has no place in a state dict")
        if op.name in _MEMO_OPS and int(arg) > len(ops):
            raise RecordError(f"{source}: pickle memo index {arg} at byte {at} exceeds the {len(ops)} opcodes")


def load_state_dict(data: bytes, source: str) -> dict[str, TensorRef]:
    """The tensors of a pickled state dict by key, in pickle order; a RecordError for anything else."""
    _scan(data, source)
    try:
        loaded = StateDictUnpickler(io.BytesIO(data)).load()
    except RecordError as error:
        raise RecordError(f"{source}: {error}") from None
    except Exception as error:  # a malformed pickle fails inside pickle itself: no code of the file has run
        raise RecordError(f"{source}: not a torch state dict pickle ({type(error).__name__}: {error})"[:300]) from None
    if not isinstance(loaded, dict):
        raise RecordError(f"{source}: the pickle holds a {type(loaded).__name__}, not a state dict")
    return dict(_tensors(loaded, source))


def _tensors(loaded: dict, source: str) -> Iterator[tuple[str, TensorRef]]:
    for key, value in loaded.items():
        if not isinstance(key, str) or not isinstance(value, TensorRef):
            raise RecordError(f"{source}: state dict entry {key!r} is a {type(value).__name__}, not a tensor"[:300])
        yield key, value
