"""Gradients by ParamId: what `Tensor.backward` returns, and the part of it a module's parameters take
(Burn's `Gradients` and `GradientsParams`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from .param import Param

if TYPE_CHECKING:
    from .module import Module


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
    def from_grads(cls, grads: Mapping[int, np.ndarray], module: Module) -> GradientsParams:
        """Keep the gradients of `module`'s parameters (reparameterization factors included)."""
        ids = {leaf.id for _, leaf in module.leaves() if isinstance(leaf, Param)}
        return cls({pid: g for pid, g in grads.items() if pid in ids})
