"""PyTorch's state-dict conventions and kiln's records, both ways, by the layers of the module they load into
(Burn's PyTorchToBurnAdapter / BurnToPyTorchAdapter, which also decide by container type).

What differs, per kiln layer: a `Linear` weight is PyTorch's `[out, in]` (`Layout.transpose()` of kiln's
`[in, out]`; a Linear declaring that layout already records it so); norms name `gamma`/`beta` `weight`/`bias`;
`BatchNorm` has `num_batches_tracked` (dropped, written back as 0); `MultiHeadAttention` packs its query, key and
value projections in `in_proj_weight`/`in_proj_bias` and calls `output` `out_proj`; `TransformerEncoderLayer` calls
`attention`, `ff_in`, `ff_out` `self_attn`, `linear1`, `linear2`; `Sequential` has no `layers` segment. Tensors
no parameter maps stay as they are, so the load's own checks (`allow_unused`, `allow_partial`, one error listing
every problem) see them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.ir import DType, Layout, RecordError, new_param_id
from kiln.runtime.records.record import ModuleRecord, RecordEntry

from .module import Module, ModuleVisitor
from .param import Param

__all__ = ["PyTorchAdapter"]

_NORMS = ("LayerNorm", "RMSNorm", "BatchNorm", "BatchNorm1d", "BatchNorm2d")
_RENAMES: dict[str, dict[str, str]] = {  # container type -> {kiln field: PyTorch field}
    **{norm: {"gamma": "weight", "beta": "bias"} for norm in _NORMS},
    "MultiHeadAttention": {"output": "out_proj"},
    "TransformerEncoderLayer": {"attention": "self_attn", "ff_in": "linear1", "ff_out": "linear2"},
    "Sequential": {"layers": ""},  # PyTorch's Sequential indexes its layers directly: `0.weight`
}
_PACKED = ("query", "key", "value")  # the order of MultiHeadAttention's projections in PyTorch's in_proj
_DROPPED = "num_batches_tracked"
_TORCH_LINEAR = Layout.transpose()  # PyTorch's file form of a Linear weight


@dataclass(frozen=True)
class _Site:
    """A kiln parameter and where PyTorch keeps it: its key, or a chunk of a packed in_proj tensor."""

    path: str
    param: Param
    torch_key: str
    linear_weight: bool
    batch_norm: bool  # PyTorch keeps num_batches_tracked beside it
    chunk: tuple[str, int] | None  # (packed key, index of the chunk) for an attention projection


class _Sites(ModuleVisitor):
    """Collects each parameter's _Site from the container types on its way (factors of derivations are skipped)."""

    def __init__(self) -> None:
        self.stack: list[tuple[str, str]] = []
        self.sites: list[_Site] = []

    def enter_module(self, name: str, container: str) -> None:
        self.stack.append((name, container.removeprefix("Struct:")))

    def exit_module(self, name: str, container: str) -> None:
        self.stack.pop()

    def visit_param(self, path: str, param: Param) -> None:
        if any(kind == "Reparameterization" for _, kind in self.stack):
            return
        segments = path.split(".")
        kinds = [kind for _, kind in self.stack]  # kinds[i] owns segments[i]
        torch = [_RENAMES.get(kind, {}).get(seg, seg) for seg, kind in zip(segments, kinds)]
        chunk = None
        if len(segments) >= 2 and kinds[-2:-1] == ["MultiHeadAttention"] and segments[-2] in _PACKED:
            owner = _key(torch[:-2] + [f"in_proj_{segments[-1]}"])
            chunk = (owner, _PACKED.index(segments[-2]))
        self.sites.append(_Site(path, param, _key(torch), kinds[-1] == "Linear" and segments[-1] == "weight",
                                kinds[-1].startswith("BatchNorm"), chunk))


def _key(segments: list[str]) -> str:
    """A PyTorch key from its segments (a segment renamed to "" is dropped)."""
    return ".".join(s for s in segments if s)


def _sites(module: Module) -> list[_Site]:
    visitor = _Sites()
    module.visit(visitor)
    return visitor.sites


def _record_form(param: Param, torch_form: np.ndarray) -> np.ndarray:
    """A Linear weight in PyTorch's form as the parameter records it (its own layout, or kiln's [in, out])."""
    if param.layout == _TORCH_LINEAR:
        return torch_form
    live = _TORCH_LINEAR.load(torch_form, (torch_form.shape[1], torch_form.shape[0]))
    return live if param.layout is None else param.layout.save(live)


def _torch_form(param: Param, record_form: np.ndarray) -> np.ndarray:
    """A Linear weight as the parameter records it, in PyTorch's `[out, in]`."""
    if param.layout == _TORCH_LINEAR:
        return record_form
    live = record_form if param.layout is None else param.layout.load(record_form, tuple(param.lazy_shape()))
    return _TORCH_LINEAR.save(live)


def _chunk(entry: RecordEntry, index: int, key: str) -> np.ndarray:
    """One of the three equal row blocks of a packed in_proj tensor."""
    array = entry.array()
    if not array.shape or array.shape[0] % 3:
        raise RecordError(f"{key}: shape {list(array.shape)} does not split into query, key and value rows")
    rows = array.shape[0] // 3
    return array[index * rows : (index + 1) * rows]


class PyTorchAdapter:
    """Maps a PyTorch state-dict record onto a kiln module's record paths and forms (`to_kiln`), or a kiln record
    to PyTorch's (`to_pytorch`); the data stays lazy both ways."""

    def to_kiln(self, record: ModuleRecord, module: Module) -> ModuleRecord:
        """`record` (PyTorch's keys and forms) as `module` records its parameters; other tensors unchanged."""
        entries = dict(record.items())
        out: dict[str, RecordEntry] = {}
        used: set[str] = set()
        for site in _sites(module):
            source_key, index = (site.chunk if site.chunk and site.chunk[0] in entries else (site.torch_key, None))
            source = entries.get(source_key)
            if source is None:
                continue
            used.add(source_key)
            read: Callable[[], np.ndarray] = source.array
            shape = source.shape
            if index is not None:
                read = functools.partial(_chunk, source, index, source_key)
                shape = (shape[0] // 3, *shape[1:]) if shape else shape
            if site.linear_weight and len(shape) == 2:
                read = functools.partial(lambda p, r: _record_form(p, r()), site.param, read)
                shape = _record_shape(site.param, shape)
            param_id = source.param_id if index is None else new_param_id()
            out[site.path] = RecordEntry(param_id, source.dtype, shape, read)
        for key, entry in entries.items():
            if key not in used and not key.endswith(f".{_DROPPED}") and key != _DROPPED:
                out.setdefault(key, entry)
        return ModuleRecord(out, record.settings)

    def to_pytorch(self, record: ModuleRecord, module: Module) -> ModuleRecord:
        """`record` (as `module` records its parameters) in PyTorch's keys and forms: packed attention
        projections, `[out, in]` Linear weights, `num_batches_tracked` as 0 beside each BatchNorm."""
        out: dict[str, RecordEntry] = {}
        packed: dict[str, list[RecordEntry | None]] = {}
        taken: set[str] = set()
        for site in _sites(module):
            entry = record.get(site.path)
            if entry is None:
                continue
            if entry.scheme is not None or entry.opaque is not None:
                raise RecordError(f"{site.path}: a quantized tensor has no PyTorch form (materialize first)")
            taken.add(site.path)
            read: Callable[[], np.ndarray] = entry.array
            shape = entry.shape
            if site.linear_weight and len(shape) == 2:
                read = functools.partial(lambda p, r: _torch_form(p, r()), site.param, read)
                shape = _torch_shape(site.param, shape)
            adapted = RecordEntry(entry.param_id, entry.dtype, shape, read)
            if site.chunk is not None:
                packed.setdefault(site.chunk[0], [None, None, None])[site.chunk[1]] = adapted
                continue
            out[site.torch_key] = adapted
            if site.batch_norm and site.torch_key.endswith(".running_var"):
                key = site.torch_key.removesuffix("running_var") + _DROPPED
                out[key] = RecordEntry(new_param_id(), DType.i64, (), functools.partial(np.zeros, (), np.int64))
        for key, parts in packed.items():
            if any(p is None for p in parts):
                raise RecordError(f"{key}: the record lacks one of the query, key and value projections")
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            out[key] = RecordEntry(new_param_id(), parts[0].dtype, shape,
                                   functools.partial(lambda ps: np.concatenate([p.array() for p in ps]), parts))
        for key, entry in record.items():
            if key not in taken:
                out.setdefault(key, entry)
        return ModuleRecord(out, record.settings)


def _record_shape(param: Param, torch_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The record shape of a Linear weight of PyTorch shape `torch_shape` (a wrong one stays wrong, for the load
    to report)."""
    if param.layout == _TORCH_LINEAR:
        return torch_shape
    live = (torch_shape[1], torch_shape[0])
    return live if param.layout is None else param.layout.file_shape(live)


def _torch_shape(param: Param, record_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The PyTorch shape of a Linear weight recorded in `record_shape`."""
    if param.layout == _TORCH_LINEAR:
        return record_shape
    live = record_shape if param.layout is None else tuple(param.lazy_shape())
    return (live[1], live[0])
