"""Gradients by ParamId: what `Tensor.backward` returns, and the part of it a module's parameters take
(Burn's `Gradients` and `GradientsParams`). Each gradient remembers the autodiff leaf it was taken for, so a
module and its fork, which share ParamIds as in Burn, take only their own."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np


class Visitable(Protocol):
    """A module, as Burn's `visit` sees it (named structurally: the module layer imports this file's users)."""

    def visit(self, visitor: Any) -> None: ...


class Gradients(Mapping[int, np.ndarray]):
    """d loss / d parameter as arrays, keyed by ParamId; frozen parameters have none. `leaves` maps a ParamId to
    the autodiff node (`Param.autodiff_node`) its gradient was taken for; an id without one matches any."""

    def __init__(self, grads: Mapping[int, np.ndarray], leaves: Mapping[int, int | None] | None = None):
        self._grads = MappingProxyType(dict(grads))
        self.leaves = MappingProxyType(dict(leaves or {}))

    def __getitem__(self, param_id: int) -> np.ndarray:
        return self._grads[param_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._grads)

    def __len__(self) -> int:
        return len(self._grads)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self)} parameters)"


class GradientsParams(Gradients):
    """The gradients of one module's parameters: what an optimizer step takes."""

    @classmethod
    def from_grads(cls, grads: Mapping[int, np.ndarray], module: Visitable) -> GradientsParams:
        """Keep the gradients taken for `module`'s own parameter leaves (reparameterization factors included; its
        flags, also visited, never have gradients): none of a fork's gradients reach its source, nor the reverse."""
        nodes = _autodiff_nodes(module)
        leaves = grads.leaves if isinstance(grads, Gradients) else {}
        kept = {pid: g for pid, g in grads.items() if pid in nodes and leaves.get(pid) in (None, nodes[pid])}
        return cls(kept, {pid: leaves[pid] for pid in kept if pid in leaves})


def _autodiff_nodes(module: Visitable) -> dict[int, int]:
    """ParamId to autodiff node for every parameter `module` visits."""
    nodes: dict[int, int] = {}

    class _Collect:
        def __getattr__(self, name: str) -> Any:
            if name == "visit_param":
                return lambda path, param: nodes.setdefault(param.id, param.autodiff_node)
            return lambda *args: None

    module.visit(_Collect())
    return nodes
