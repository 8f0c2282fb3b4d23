"""load-record: apply a record's tensors to the parameter nodes at the same paths (Burn's `ModuleRecord` apply).

A hit takes the record's data (not copied: a file record's arrays stay memory-mapped) and ParamId and keeps
the node's gradient, device and autodiff state; flags are never recorded, so they are left alone. The base of
a derived parameter (node `w.base`) is recorded under the parameter's path `w`, its factors under their own
names (`w.lora.a`, `w.lora.b`). Problems are all collected and then reported in one RecordError, checked in
Burn's order: apply errors (when validating), missing tensors (unless partial), unused tensors (unless
allowed, names sorted). A record of another kind (float, int, bool) than its parameter is an apply error
unless the dtype policy casts.

A quantized tensor (Burn's QFloat; entries with a `scheme`) holds codes and scales together: loaded into a
quantized parameter (codes node `w.codes`, scales `w.scales`, recorded at `w`) it replaces both and the
dequantize's value kind and block take the record's; loaded into a plain float parameter it is dequantized.

A parameter with a `layout` is recorded in its file form: the entry's shape is checked against the file shape
(the error names both shapes and the layout) and the data is mapped to the live form, a view where numpy can
give one (a file record stays memory-mapped). A QFloat entry cannot load into a quantized parameter with a
layout: its blocks of scales follow the file's axes, which the live codes do not share.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kiln.ir import DType, Graph, ParamId, ParamNode, RecordError, TensorType
from kiln.ir.graph import untied_id_claims
from kiln.ir.naming import user_paths
from kiln.ir.ops.quant import dequantize

from .param_state import StatePass


class DTypePolicy(enum.Enum):
    """Which dtype a loaded parameter gets: the record's (Burn's default) or the module's (cast on load)."""

    FROM_RECORD = "from-record"
    CAST_TO_MODULE = "cast-to-module"


@dataclass(frozen=True)
class LoadSettings:
    """How a record loads: dtype policy and which problems are tolerated (Burn's defaults)."""

    dtype_policy: DTypePolicy = DTypePolicy.FROM_RECORD
    allow_partial: bool = False
    allow_unused: bool = False
    validate: bool = True


class RecordEntryLike(Protocol):
    """One recorded tensor as load-record reads it."""

    @property
    def param_id(self) -> int: ...
    @property
    def dtype(self) -> DType: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    def array(self) -> np.ndarray:
        """The data in `dtype`'s numpy type, read only when a parameter takes it."""
        ...


class RecordLike(Protocol):
    """A record as load-record reads it: entries by path (a Mapping does) and its load settings."""

    @property
    def settings(self) -> LoadSettings: ...
    def keys(self) -> Iterable[str]: ...
    def get(self, path: str) -> RecordEntryLike | None: ...


@dataclass(frozen=True)
class _Dequantized:
    """A quantized entry read as the f32 values it stands for (for a plain float parameter)."""

    entry: RecordEntryLike

    @property
    def param_id(self) -> int:
        return self.entry.param_id

    @property
    def dtype(self) -> DType:
        return DType.f32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry.shape)

    def array(self) -> np.ndarray:
        scheme = self.entry.scheme  # type: ignore[attr-defined]
        scales = self.entry.scale_array()  # type: ignore[attr-defined]
        scales = scales if isinstance(scales, tuple) else (scales,)
        return dequantize(self.entry.array(), scales[0], scheme.value, scheme.block, DType.f32, *scales[1:])


def _scheme(entry: RecordEntryLike | None) -> object | None:
    """The QFloat scheme of a quantized entry (value, block), else None."""
    return getattr(entry, "scheme", None)


def _mismatch(path: str, node: ParamNode, entry: RecordEntryLike, policy: DTypePolicy) -> str | None:
    """Why `entry` cannot replace `node`'s value, or None when it can."""
    if node.layout is not None and tuple(entry.shape) != node.layout.file_shape(node.type.shape):
        return (f"{path}: shape mismatch, expected {list(node.layout.file_shape(node.type.shape))} (the file form "
                f"of live shape {list(node.type.shape)} under layout {node.layout}) but record has "
                f"{list(entry.shape)}")
    if node.layout is None and tuple(entry.shape) != node.type.shape:
        return f"{path}: shape mismatch, expected {list(node.type.shape)} but record has {list(entry.shape)}"
    if policy is DTypePolicy.FROM_RECORD and entry.dtype.kind != node.type.dtype.kind:
        return f"{path}: dtype mismatch, expected {node.type.dtype.value} but record has {entry.dtype.value}"
    return None


def _take(node: ParamNode, entry: RecordEntryLike, policy: DTypePolicy) -> ParamNode:
    """`node` holding the entry's data and ParamId, in the dtype the policy picks; a lazy node stays unevaluated."""
    dtype = node.type.dtype if policy is DTypePolicy.CAST_TO_MODULE else entry.dtype
    data = entry.array()
    if data.dtype != dtype.numpy:
        data = data.astype(dtype.numpy)
    if node.layout is not None:
        data = node.layout.load(data, node.type.shape)
    return node.replace(id=entry.param_id, type=TensorType(node.type.shape, dtype), init=None, data=data)


def _check(settings: LoadSettings, errors: list[str], missing: list[str], unused: list[str]) -> None:
    """Raise one RecordError naming every problem the settings do not tolerate, in Burn's check order."""
    problems = []
    if settings.validate and errors:
        problems.append(f"Apply errors: {errors}")
    if not settings.allow_partial and missing:
        problems.append(f"Missing tensors: {missing}")
    if not settings.allow_unused and unused:
        problems.append(f"Unused tensors: {sorted(unused)}")
    if problems:
        raise RecordError("; ".join(problems))


@dataclass(frozen=True)
class LoadRecord(StatePass):
    """Replace the data and ParamId of every parameter node the record has a tensor for."""

    name = "load-record"
    record: RecordLike

    def apply(self, graph: Graph) -> Graph:
        policy = self.record.settings.dtype_policy
        record_paths = user_paths(graph)  # a derived parameter's stored base is recorded at its path
        params: dict[str, ParamNode] = {}
        errors: list[str] = []
        missing: list[str] = []
        used: set[str] = set()
        quantized = {r.operands[0]: r for r in graph.reparams.values() if r.kind == "dequantize"}  # codes: dequantize
        inside = {o: codes for codes, r in quantized.items()  # scales taken from a QFloat entry
                  if _scheme(self.record.get(record_paths[codes])) is not None for o in r.operands[1:]}
        reparams = dict(graph.reparams)
        for name, node in graph.params.items():
            params.setdefault(name, node)
            if name in inside:
                continue
            path = record_paths.get(name, name)
            entry = self.record.get(path)
            if entry is None:
                missing.append(path)
                continue
            used.add(path)
            if _scheme(entry) is not None and name not in quantized:
                entry = _Dequantized(entry)
            problem = _mismatch(path, node, entry, policy)
            if problem is not None:
                errors.append(problem)
                continue
            if name in quantized and _scheme(entry) is not None:
                if node.layout is not None:
                    errors.append(f"{path}: a quantized entry cannot load into a quantized parameter with layout "
                                  f"{node.layout} (its scale blocks follow the file's axes)")
                    continue
                r = quantized[name]
                scheme = entry.scheme  # type: ignore[attr-defined]
                if scheme.double_quant != (len(r.operands) > 2):
                    form = {True: "double-quantized", False: "not double-quantized"}
                    errors.append(f"{path}: the record's scales are {form[scheme.double_quant]} but the module's "
                                  f"are {form[len(r.operands) > 2]}")
                    continue
                params[name] = _take(node, entry, DTypePolicy.FROM_RECORD)  # codes stay in their code dtype
                params.update(_take_scales([graph.params[o] for o in r.operands[1:]], entry, policy))
                reparams[r.name] = r.replace(attrs={**r.attrs, "value": scheme.value, "block": scheme.block})
                continue
            params[name] = _take(node, entry, policy)
        errors += _shared_ids([params[n] for n in graph.params if record_paths.get(n, n) in used], record_paths)
        _check(self.record.settings, errors, missing, [p for p in self.record.keys() if p not in used])
        return graph.replace(params=params, reparams=reparams)


def _shared_ids(loaded: list[ParamNode], record_paths: dict[str, str]) -> list[str]:
    """Parameters the record gave one ParamId without their being one tied parameter (a module's id is its
    parameter's: optimizer state and gradients are keyed by it, so two would fail far from the file)."""
    problems = []
    for first, node in untied_id_claims(loaded):
        how = f"{first.type} and {node.type}" if first.type != node.type else "their values or state"
        path, other = record_paths.get(node.name, node.name), record_paths.get(first.name, first.name)
        problems.append(f"{path}: the record gives it ParamId {ParamId(node.id)}, as it gives {other}, but the "
                        f"two differ ({how})")
    return problems


def _take_scales(nodes: list[ParamNode], entry: RecordEntryLike, policy: DTypePolicy) -> dict[str, ParamNode]:
    """The scale nodes holding a QFloat entry's scales (at the scheme's scale dtype, or the module's float dtype
    when casting; double-quantized ones keep theirs)."""
    data = entry.scale_array()  # type: ignore[attr-defined]
    if isinstance(data, tuple):
        return {n.name: n.replace(type=TensorType(tuple(a.shape), DType.from_numpy(a.dtype)), init=None, data=a)
                for n, a in zip(nodes, data)}
    (node,) = nodes
    dtype = node.type.dtype if policy is DTypePolicy.CAST_TO_MODULE else DType.from_numpy(data.dtype)
    return {node.name: node.replace(type=TensorType(tuple(data.shape), dtype), init=None,
                                    data=data.astype(dtype.numpy))}
