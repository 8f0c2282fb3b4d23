"""Gradients by ParamId: what `Tensor.backward` returns, and the part of it a module's parameters take
(Burn's `Gradients` and `GradientsParams`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Protocol

import numpy as np

from kiln.passes.group import ParamGroup


class Visitable(Protocol):
    """A module, as Burn's `visit` sees it (named structurally: the module layer imports this file's users)."""

    def visit(self, visitor: Any) -> None: ...


class Gradients(Mapping[int, np.ndarray]):
    """d loss / d parameter as arrays, keyed by ParamId; frozen parameters have none."""

    def __init__(self, grads: Mapping[int, np.ndarray]):
        self._grads = MappingProxyType(dict(grads))

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
        """Keep the gradients of `module`'s parameters (reparameterization factors included; its flags, also
        visited, never have gradients)."""
        ids = ParamGroup.ids_from_module(module)
        return cls({pid: g for pid, g in grads.items() if ids.matches(pid, None)})
