"""load-record: apply a record's tensors to the parameter nodes at the same paths (Burn's `ModuleRecord` apply).

A hit takes the record's data (not copied: a file record's arrays stay memory-mapped) and ParamId and keeps
the node's gradient, device and autodiff state; flags are never recorded, so they are left alone. The base of
a derived parameter (node `w.base`) is recorded under the parameter's path `w`, its factors under their own
names (`w.lora.a`, `w.lora.b`). Problems are all collected and then reported in one RecordError, checked in
Burn's order: apply errors (when validating), missing tensors (unless partial), unused tensors (unless
allowed, names sorted). A record of another kind (float, int, bool) than its parameter is an apply error
unless the dtype policy casts.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kiln.ir import DType, Graph, ParamNode, RecordError, TensorType

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


def _kind(dtype: DType) -> str:
    return "float" if dtype.is_float else "bool" if dtype is DType.bool else "int"


def _mismatch(path: str, node: ParamNode, entry: RecordEntryLike, policy: DTypePolicy) -> str | None:
    """Why `entry` cannot replace `node`'s value, or None when it can."""
    if tuple(entry.shape) != node.type.shape:
        return f"{path}: shape mismatch, expected {list(node.type.shape)} but record has {list(entry.shape)}"
    if policy is DTypePolicy.FROM_RECORD and _kind(entry.dtype) != _kind(node.type.dtype):
        return f"{path}: dtype mismatch, expected {node.type.dtype.value} but record has {entry.dtype.value}"
    return None


def _take(node: ParamNode, entry: RecordEntryLike, policy: DTypePolicy) -> ParamNode:
    """`node` holding the entry's data and ParamId, in the dtype the policy picks; a lazy node stays unevaluated."""
    dtype = node.type.dtype if policy is DTypePolicy.CAST_TO_MODULE else entry.dtype
    data = entry.array()
    if data.dtype != dtype.numpy:
        data = data.astype(dtype.numpy)
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
        record_paths = {f"{path}.base": path for path in graph.reparams}  # a derived parameter's stored base
        params: dict[str, ParamNode] = {}
        errors: list[str] = []
        missing: list[str] = []
        used: set[str] = set()
        for name, node in graph.params.items():
            path = record_paths.get(name, name)
            entry = self.record.get(path)
            params[name] = node
            if entry is None:
                missing.append(path)
                continue
            used.add(path)
            problem = _mismatch(path, node, entry, policy)
            if problem is not None:
                errors.append(problem)
                continue
            params[name] = _take(node, entry, policy)
        _check(self.record.settings, errors, missing, [p for p in self.record.keys() if p not in used])
        return graph.replace(params=params)
