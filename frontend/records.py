"""Module's record methods (Burn's `into_record`, `load_record`, `save_file`, `load_file`), mixed into Module.

A record holds each tensor parameter's stored value (a reparameterized parameter's base at its path, its
factors below it), never flags. Loading runs the load-record pass over the module's state and gives each
parameter the data, dtype and ParamId the pass chose; everything else about it is the destination's.

Records hold Burn's record form: a parameter with a file form (a `Layout`, or a Python save mapper) is written
in it (`into_record`, `into_record_group`, `save_file` and `state_dict` alike), and loading maps the file form
back (the load-record pass applies a `Layout`; a Python load mapper maps its entry here, before the pass checks
the result against the live shape). A lazy parameter with a Layout stays lazy; a Python save mapper needs the
value when the record is made, so it runs then (on the initial value, without initializing the parameter).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from typing import Protocol, Self, TypeVar

import numpy as np

from kiln.ir import DType, RecordError
from kiln.ir import init as initializers
from kiln.ir.naming import quant_scale_factors
from kiln.passes import Pass
from kiln.passes.group import ParamGroup
from kiln.passes.load_record import LoadRecord
from kiln.runtime.records.qfloat import QFloatScheme
from kiln.runtime.records.record import DTypePolicy, ModuleRecord, RecordEntry

from .param import ArrayMap, Flag, Param


class Stateful(Protocol):
    """What the record methods use of the Module they are mixed into (named structurally: module.py imports
    this file, so importing Module here would be a cycle)."""

    def leaves(self, factors: bool = True) -> Iterator[tuple[str, Param | Flag]]: ...
    def run_pass(self, p: Pass | str) -> Self: ...


M = TypeVar("M", bound=Stateful)


def _stored(param: Param, through: ArrayMap | None = None):
    """The stored value (mapped `through` a file form), or for a lazy parameter a provider computing it when the
    record is written (same seed, same value) without initializing or changing the parameter."""
    state = param.state
    if state.value is not None:
        return state.value if through is None else through(state.value)
    initial = functools.partial(initializers.evaluate, state.init, state.type, state.seed)
    return initial if through is None else lambda: through(initial())


def _scales(param: Param) -> list[Param]:
    """The scale factors of a quantized parameter (its first derivation dequantizes its codes): its scales, and
    under double quantization their group scales and offset; none for other parameters."""
    chain = param.reparam.chain() if param.reparam is not None else []
    return [f for _, f in chain[0].factors] if chain and chain[0].kind == "dequantize" else []


def _save_mapper(param: Param) -> ArrayMap | None:
    return param.mapper.save if param.mapper is not None else None


def _entry(path: str, param: Param) -> RecordEntry:
    """A parameter's stored value in its file form as a record entry; a quantized one is a single QFloat entry
    holding its codes and scales (Burn records a quantized tensor whole), its scales not recorded apart."""
    scales = _scales(param)
    layout, save = param.layout, _save_mapper(param)
    if scales and (layout is not None or save is not None):
        raise RecordError(f"{path}: a quantized parameter cannot be recorded in a file form "
                          f"({layout or 'a save mapper'}): its scale blocks follow the live axes")
    if layout is not None:
        return RecordEntry(param.id, param.type.dtype, layout.file_shape(param.lazy_shape()),
                           _stored(param, layout.save))
    if save is not None:
        stored = _stored(param)
        array = _array(path, save(stored() if callable(stored) else stored))
        return RecordEntry(param.id, DType.from_numpy(array.dtype), array.shape, array)
    if not scales:
        return RecordEntry(param.id, param.type.dtype, param.lazy_shape(), _stored(param))
    attrs = param.reparam.chain()[0].attrs
    double = len(scales) > 1
    scheme = QFloatScheme(attrs["value"], tuple(attrs["block"]), DType.f32 if double else scales[0].type.dtype,
                          double)
    stored = tuple(_stored(f) for f in scales) if double else _stored(scales[0])
    return RecordEntry(param.id, param.type.dtype, param.lazy_shape(), _stored(param), scheme, stored)


def _array(path: str, value: object) -> np.ndarray:
    """A mapper's result as an array of a kiln dtype; else a RecordError naming the path."""
    array = np.asarray(value)
    try:
        DType.from_numpy(array.dtype)
    except ValueError as error:
        raise RecordError(f"{path}: a mapper gave {error}") from None
    return array


def _load_mapped(module: Stateful, record: ModuleRecord) -> ModuleRecord:
    """`record` with each entry a Python load mapper reads replaced by the mapper's result (settings kept)."""
    mapped = {}
    for path, leaf in module.leaves():
        load = leaf.mapper.load if isinstance(leaf, Param) and leaf.mapper is not None else None
        entry = record.get(path) if load is not None else None
        if entry is None or load is None:
            continue
        if entry.scheme is not None:
            raise RecordError(f"{path}: a Python load mapper cannot read a quantized (QFloat) entry")
        array = _array(path, load(entry.array()))
        mapped[path] = RecordEntry(entry.param_id, DType.from_numpy(array.dtype), array.shape, array)
    return record if not mapped else ModuleRecord({**record, **mapped}, record.settings)


class RecordMethods:
    """The record half of Burn's Module trait; every method leaves the receiver unchanged."""

    def into_record(self: Stateful) -> ModuleRecord:
        """Collect this module's tensor parameters into a ModuleRecord; flags are runtime state, never recorded."""
        return self.into_record_group(ParamGroup.all())

    def into_record_group(self: Stateful, group: ParamGroup) -> ModuleRecord:
        """Collect the tensor parameters `group` matches; the others are skipped before their data is read.
        A quantized parameter's scales travel inside its QFloat entry, so they are not entries of their own."""
        leaves = [(path, leaf) for path, leaf in self.leaves() if isinstance(leaf, Param)]
        inside = {id(s) for _, leaf in leaves for s in _scales(leaf)}
        return ModuleRecord({path: _entry(path, leaf) for path, leaf in leaves
                             if id(leaf) not in inside and group.matches(leaf.id, path, leaf)})

    def state_dict(self: Stateful) -> dict[str, np.ndarray]:
        """`{path: array}` of `into_record`'s entries, for PyTorch users: each parameter's stored value in its
        file form (Burn's record form; a lazy one computed as `into_record` would write it, and left lazy), a
        quantized one's codes with its scales at `<path>.scales`."""
        out = {}
        record = self.into_record()
        for path, entry in record.items():
            out[path] = entry.array()
            if entry.scheme is not None:
                scales = entry.scale_array()
                names = quant_scale_factors(path, entry.scheme.double_quant)
                out.update(zip(names, scales if isinstance(scales, tuple) else (scales,)))
        return out

    def load_state_dict(self: M, state: Mapping[str, np.typing.ArrayLike], strict: bool = True) -> M:
        """The module with `state`'s arrays loaded through `try_load_record` (a new module: modules are values);
        each parameter keeps its ParamId and dtype (values are cast, as torch copies into its parameters).
        Missing or unexpected keys raise one RecordError listing them all, unless `strict=False`."""
        ids = {path: leaf.id for path, leaf in self.leaves() if isinstance(leaf, Param)}
        entries = {}
        for path, value in state.items():
            array = np.asarray(value)
            try:
                dtype = DType.from_numpy(array.dtype)
            except ValueError as error:
                raise RecordError(f"{path}: {error}") from None
            # an unexpected key's id is never read: the pass reports the key as unused before applying anything
            entries[path] = RecordEntry(ids.get(path, 0), dtype, array.shape, array)
        record = ModuleRecord(entries).allow_partial(not strict).allow_unused(not strict)
        return self.try_load_record(record.with_dtype_policy(DTypePolicy.CAST_TO_MODULE))

    def try_load_record(self: M, record: ModuleRecord) -> M:
        """The module with `record` applied, honoring its dtype policy and settings; raises RecordError."""
        return self.run_pass(LoadRecord(_load_mapped(self, record)))

    def load_record(self: M, record: ModuleRecord) -> M:
        """try_load_record, failing with RuntimeError as Burn's `load_record` panics."""
        try:
            return self.try_load_record(record)
        except RecordError as error:
            raise RuntimeError(f"Failed to load record: {error}") from error

    def save_file(self: Stateful, path: str | os.PathLike[str]) -> None:
        """Save the parameters to a burnpack file, atomically; raises RecordError."""
        self.into_record().save(path)

    def load_file(self: M, path: str | os.PathLike[str]) -> M:
        """try_load_file, failing with RuntimeError as Burn's `load_file` panics."""
        try:
            return self.try_load_file(path)
        except RecordError as error:
            raise RuntimeError(f"Failed to load module from file: {error}") from error

    def try_load_file(self: M, path: str | os.PathLike[str]) -> M:
        """The module with a burnpack file's parameters applied with the default settings; raises RecordError,
        naming the file."""
        record = ModuleRecord.load(path)  # its errors name the file already
        try:
            return self.try_load_record(record)
        except RecordError as error:
            raise RecordError(f"{os.fspath(path)}: {error}") from None
