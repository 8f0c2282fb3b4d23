"""ModuleRecord: a module's tensors by path with their ParamIds and load settings, stored as Burn burnpack files;
also read from safetensors and `torch.save` files (and written as safetensors), renamed by regex rules and
filtered by prefix.

Data stays lazy both ways: a record read from a file or bytes views the pack's bytes (memory-mapped for a
file) and reads nothing until a tensor is used, and a lazy parameter is recorded as a provider that runs only
while the pack is written, so its value is neither kept nor stored in the module. A QFloat tensor whose scheme
kiln does not know (a newer Burn's) is kept opaque: its dtype and bytes are saved back unchanged, and only
reading it as a value raises a RecordError naming the tensor and the scheme.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np

from kiln.ir import DType, ParamId, RecordError, new_param_id
from kiln.passes.load_record import DTypePolicy, LoadSettings

from . import qfloat
from .burnpack import BurnDType, PackTensor, TensorEntry
from .burnpack_io import BurnpackFile, to_bytes, write_burnpack
from .pytorch_io import PyTorchFile
from .qfloat import QFloatScheme
from .remap import remap_names, under_prefix
from .safetensors_io import SafetensorsFile, write_safetensors

__all__ = ["DTypePolicy", "LoadSettings", "ModuleRecord", "RecordEntry", "burn_dtype", "kiln_dtype"]

EXTENSION = ".bpk"

_TO_BURN: dict[DType, BurnDType] = {
    DType.f64: BurnDType("F64"),
    DType.f32: BurnDType("F32"),
    DType.f16: BurnDType("F16"),
    DType.bf16: BurnDType("BF16"),
    DType.i64: BurnDType("I64"),
    DType.i32: BurnDType("I32"),
    DType.i16: BurnDType("I16"),
    DType.i8: BurnDType("I8"),
    DType.u8: BurnDType("U8"),
    DType.u16: BurnDType("U16"),
    DType.u32: BurnDType("U32"),
    DType.u64: BurnDType("U64"),
    DType.bool: BurnDType("Bool", store="Native"),
}
_FROM_BURN: dict[BurnDType, DType] = {
    **{burn: kiln for kiln, burn in _TO_BURN.items()},
    BurnDType("Flex32"): DType.f32,
    BurnDType("Bool", store="U8"): DType.bool,
    BurnDType("Bool", store="U32"): DType.bool,
}


def burn_dtype(dtype: DType) -> BurnDType:
    """Burn's dtype for a kiln dtype (bool is stored natively, one byte each)."""
    try:
        return _TO_BURN[dtype]
    except KeyError:
        raise RecordError(f"kiln dtype {dtype.value} has no Burn dtype") from None


def kiln_dtype(dtype: BurnDType) -> DType:
    """kiln's dtype for a Burn dtype (Flex32 reads as f32, every Bool storage as bool)."""
    try:
        return _FROM_BURN[dtype]
    except KeyError:
        raise RecordError(f"Burn dtype {dtype} has no kiln dtype") from None


@dataclass(frozen=True, eq=False)
class Opaque:
    """A QFloat tensor kiln cannot decode, as it came: its Burn dtype (the scheme's CBOR bytes) and its bytes."""

    dtype: BurnDType
    data: Callable[[], memoryview]
    nbytes: int


@dataclass(frozen=True, eq=False, slots=True)
class RecordEntry:
    """One recorded tensor: ParamId, kiln dtype, shape, and its data or a zero-argument provider of it.

    A quantized tensor (Burn's QFloat) has a `scheme`: its data are the integer codes (dtype i8 or i4) and
    `scales` (data or provider) its scales; it is stored as one QFloat tensor holding both. An `opaque` entry
    (a QFloat scheme kiln does not know) has f32 as the dtype it stands for and a `data` provider that raises.
    """

    param_id: ParamId
    dtype: DType
    shape: tuple[int, ...]
    data: np.ndarray | Callable[[], np.ndarray]
    scheme: QFloatScheme | None = None
    scales: np.ndarray | Callable[[], np.ndarray] | tuple | None = None
    opaque: Opaque | None = None

    def __post_init__(self) -> None:
        """Normalise the shape so entries compare against TensorType shapes."""
        object.__setattr__(self, "shape", tuple(self.shape))

    def array(self) -> np.ndarray:
        """The data, running the provider if there is one; nothing is cached, so a provider's result isn't kept."""
        return self.data() if callable(self.data) else self.data

    def scale_array(self) -> np.ndarray | tuple[np.ndarray, ...]:
        """A quantized entry's scales (shaped as `quantize` returns them; double-quantized, the (i8 codes, f32
        group scales, f32 offset) triple); a RecordError for others."""
        if self.scheme is None or self.scales is None:
            raise RecordError("tensor is not quantized: it has no scales")
        if isinstance(self.scales, tuple):
            return tuple(a() if callable(a) else a for a in self.scales)
        return self.scales() if callable(self.scales) else self.scales

    def packed(self) -> np.ndarray:
        """A quantized entry's QFloat bytes: packed codes then scales (burn-notes §1.4)."""
        assert self.scheme is not None
        return qfloat.encode(self.array(), self.scale_array(), self.scheme)


@dataclass(frozen=True, eq=False)
class ModuleRecord(Mapping[str, RecordEntry]):
    """Tensors by module path, in visit order, with how to load them; builders return new records."""

    entries: Mapping[str, RecordEntry]
    settings: LoadSettings = LoadSettings()

    def __post_init__(self) -> None:
        """Freeze the entries so records sharing them cannot change each other."""
        object.__setattr__(self, "entries", MappingProxyType(dict(self.entries)))

    def __getitem__(self, path: str) -> RecordEntry:
        return self.entries[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"ModuleRecord({len(self)} tensors, {self.settings})"

    # load settings ------------------------------------------------------------------------------------
    def with_dtype_policy(self, policy: DTypePolicy) -> ModuleRecord:
        """Keep the record's dtypes (FROM_RECORD, the default) or cast to the module's (CAST_TO_MODULE)."""
        return self._with(dtype_policy=policy)

    def allow_partial(self, allow: bool) -> ModuleRecord:
        """Whether parameters the record lacks keep their values instead of failing the load."""
        return self._with(allow_partial=allow)

    def allow_unused(self, allow: bool) -> ModuleRecord:
        """Whether tensors no parameter takes are ignored instead of failing the load."""
        return self._with(allow_unused=allow)

    def validate(self, validate: bool) -> ModuleRecord:
        """Whether shape and dtype mismatches fail the load (else those parameters are silently kept)."""
        return self._with(validate=validate)

    def _with(self, **settings: object) -> ModuleRecord:
        return dataclasses.replace(self, settings=dataclasses.replace(self.settings, **settings))

    # burnpack ---------------------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a burnpack atomically (`.bpk` added when the path has no extension, as Burn does)."""
        destination = Path(path)
        if not destination.suffix:
            destination = destination.with_suffix(EXTENSION)
        write_burnpack(destination, self._pack_tensors())

    def to_bytes(self) -> bytes:
        """The burnpack `save` would write, in memory."""
        return to_bytes(self._pack_tensors())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ModuleRecord:
        """Read a burnpack's header and metadata; tensor data stays in the memory-mapped file until used.

        As in Burn, `.bpk` is tried when the path has no extension and does not exist.
        """
        source = Path(path)
        if not source.suffix and not source.exists():
            source = source.with_suffix(EXTENSION)
        return cls._from_pack(BurnpackFile.open(source))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> ModuleRecord:
        """A record viewing an in-memory burnpack (which must stay unchanged while the record is used)."""
        return cls._from_pack(BurnpackFile.from_bytes(data))

    @classmethod
    def _from_pack(cls, pack: BurnpackFile) -> ModuleRecord:
        """Entries in the pack's data order (the writer's visit order); a tensor without an id gets a new one."""
        named = {e.dtype: e.name for e in pack.entries.values()}  # a tensor of each dtype, to name in errors
        schemes = {dtype: _scheme_of(pack, name, dtype) for dtype, name in named.items() if dtype.kind == "QFloat"}
        dtypes = {dtype: _kiln_dtype_of(pack, name, dtype) for dtype, name in named.items() if dtype not in schemes}
        entries = {}
        for entry in sorted(pack.entries.values(), key=_data_start):
            param_id = new_param_id() if entry.param_id is None else entry.param_id
            scheme = schemes.get(entry.dtype)
            if isinstance(scheme, RecordError):
                entries[entry.name] = _opaque_entry(pack, entry, param_id, scheme)
                continue
            if scheme is not None:
                _check_qfloat_length(pack, entry, scheme)
                entries[entry.name] = RecordEntry(
                    param_id, scheme.code_dtype, entry.shape,
                    functools.partial(_read_qfloat, qfloat.decode_codes, pack, entry.name, entry.shape, scheme),
                    scheme, functools.partial(_read_qfloat, qfloat.decode_scales, pack, entry.name, entry.shape,
                                              scheme))
                continue
            dtype = dtypes[entry.dtype]
            entries[entry.name] = RecordEntry(param_id, dtype, entry.shape, functools.partial(_read, pack, entry.name,
                                                                                              dtype.numpy))
        return cls(entries)

    # foreign checkpoints ----------------------------------------------------------------------------------------
    @classmethod
    def from_safetensors(cls, path: str | os.PathLike[str]) -> ModuleRecord:
        """A safetensors file's tensors by name in data order, with fresh ParamIds; data stays in the memory-mapped
        file until used."""
        file = SafetensorsFile.open(path)
        return cls({name: RecordEntry(new_param_id(), e.dtype, e.shape, functools.partial(file.array, name))
                    for name, e in file.entries.items()})

    @classmethod
    def from_pytorch(cls, path: str | os.PathLike[str]) -> ModuleRecord:
        """A `torch.save(state_dict)` file's tensors by key in pickle order, with fresh ParamIds, read without
        torch and without running code from the file (any global but a tensor rebuild or storage is a
        RecordError); data stays in the memory-mapped file until used."""
        file = PyTorchFile.open(path)
        return cls({name: RecordEntry(new_param_id(), t.storage.dtype, t.shape, functools.partial(file.array, name))
                    for name, t in file.tensors.items()})

    def to_safetensors(self, path: str | os.PathLike[str]) -> None:
        """Write the tensors as a safetensors file, atomically (ParamIds are not kept: the format has no place
        for them; a quantized tensor is refused, as the format has no QFloat)."""
        for name, entry in self.items():
            if entry.scheme is not None or entry.opaque is not None:
                raise RecordError(f"tensor {name!r} is quantized; safetensors has no quantized dtype "
                                  f"(materialize or dequantize first)")
        write_safetensors(path, [(name, e.dtype, e.shape, e.data) for name, e in self.items()])

    # keys ---------------------------------------------------------------------------------------------------------
    def remap(self, rules: Sequence[tuple[str, str]]) -> ModuleRecord:
        """Rename tensors by (regex, replacement) rules applied in order, as Burn's KeyRemapper does
        (replacements write groups `$1`/`${name}`); two tensors sent to one name are a RecordError."""
        names = remap_names(self.entries, rules)
        return dataclasses.replace(self, entries={names[path]: entry for path, entry in self.items()})

    def filter_prefix(self, *prefixes: str, exclude: bool = False) -> ModuleRecord:
        """Only the tensors at or below one of `prefixes` (with `exclude`, only the others)."""
        return dataclasses.replace(self, entries={path: e for path, e in self.items()
                                                  if under_prefix(path, prefixes) != exclude})

    def _pack_tensors(self) -> list[PackTensor]:
        """The entries as burnpack tensors; providers stay deferred until the writer reaches them."""
        return [_pack_tensor(path, e) for path, e in self.items()]


def _pack_tensor(path: str, entry: RecordEntry) -> PackTensor:
    """A burnpack tensor; a quantized entry is one QFloat tensor packed when the writer reaches it, an opaque one
    its dtype and bytes as read."""
    if entry.opaque is not None:
        return PackTensor(path, entry.opaque.dtype, entry.shape, entry.param_id, entry.opaque.data,
                          entry.opaque.nbytes)
    if entry.scheme is None:
        return PackTensor(path, _burn_dtype_of(path, entry), entry.shape, entry.param_id, entry.data)
    return PackTensor(path, BurnDType.qfloat(entry.scheme.to_burn()), entry.shape, entry.param_id, entry.packed,
                      qfloat.nbytes(entry.shape, entry.scheme))


def _scheme_of(pack: BurnpackFile, name: str, dtype: BurnDType) -> QFloatScheme | RecordError:
    """kiln's scheme for a pack's QFloat dtype, or the RecordError saying why kiln cannot represent it."""
    try:
        return QFloatScheme.from_burn(dtype.scheme_value)
    except RecordError as error:
        return error


def _opaque_entry(pack: BurnpackFile, entry: TensorEntry, param_id: ParamId, why: RecordError) -> RecordEntry:
    """An entry keeping a QFloat tensor of an unknown scheme as it came; reading its value raises."""
    start, end = entry.data_offsets
    message = (f"{pack.path}: tensor {entry.name!r} has QFloat scheme {entry.dtype.scheme_value!r}, which kiln "
               f"does not know ({why}); it is kept as stored and saved back unchanged, but cannot be used as a value")
    return RecordEntry(param_id, DType.f32, entry.shape, functools.partial(_refuse, message), None, None,
                       Opaque(entry.dtype, functools.partial(pack.tensor_bytes, entry.name), end - start))


def _refuse(message: str) -> np.ndarray:
    raise RecordError(message)


def _check_qfloat_length(pack: BurnpackFile, entry: TensorEntry, scheme: QFloatScheme) -> None:
    """Refuse a QFloat tensor whose byte length does not match its shape and scheme when the record is read."""
    start, end = entry.data_offsets
    try:
        expected = qfloat.nbytes(entry.shape, scheme)
    except Exception as error:  # a block that does not divide the shape
        raise RecordError(f"{pack.path}: tensor {entry.name!r}: {error}") from None
    if end - start != expected:
        raise RecordError(f"{pack.path}: tensor {entry.name!r} has {end - start} bytes; QFloat {scheme.value} "
                          f"{list(entry.shape)} with block {list(scheme.block)} needs {expected}")


def _read_qfloat(decode: Callable, pack: BurnpackFile, name: str, shape: tuple[int, ...],
                 scheme: QFloatScheme) -> np.ndarray:
    """Codes or scales of a QFloat tensor, decoded from the pack's bytes."""
    return decode(pack.tensor_bytes(name), shape, scheme)


def _burn_dtype_of(path: str, entry: RecordEntry) -> BurnDType:
    """The entry's Burn dtype, or a RecordError naming the tensor."""
    try:
        return burn_dtype(entry.dtype)
    except RecordError as error:
        raise RecordError(f"tensor {path!r}: {error}") from None


def _data_start(entry: TensorEntry) -> int:
    return entry.data_offsets[0]


def _kiln_dtype_of(pack: BurnpackFile, name: str, dtype: BurnDType) -> DType:
    """The kiln dtype of a pack's tensor, or a RecordError naming the file and tensor."""
    try:
        return kiln_dtype(dtype)
    except RecordError as error:
        raise RecordError(f"{pack.path}: tensor {name!r}: {error}") from None


def _read(pack: BurnpackFile, name: str, dtype: np.dtype) -> np.ndarray:
    """One tensor viewing the pack's bytes; only Bool stored as U32 needs converting (a copy)."""
    array = pack.array(name)
    return array if array.dtype == dtype else array.astype(dtype)
