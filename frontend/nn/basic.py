"""Parameterless layers: Dropout (owns a training Flag), activations, and Sequential."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kiln.frontend.module import Module
from kiln.frontend.param import Flag
from kiln.frontend.tensor import Tensor

from . import functional as F


class Dropout(Module):
    """Zeroes elements with probability `prob` while its `training` flag is enabled."""

    def __init__(self, prob: float = 0.5):
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"dropout probability {prob} is outside [0, 1)")
        self.prob = prob
        self.training = Flag(True, True)

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.training, self.prob)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x)


class GELU(Module):
    def __init__(self, approximate: str = "none"):
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(x, self.approximate)


class SiLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.silu(x)


class Sequential(Module):
    """Applies its layers in order; `Sequential(a, b)` and `Sequential([a, b])` are the same; paths are
    `layers.0`, `layers.1`, …"""

    def __init__(self, *layers: Module | Sequence[Module]):
        items = layers[0] if len(layers) == 1 and isinstance(layers[0], list | tuple) else layers
        for i, layer in enumerate(items):
            if not isinstance(layer, Module):
                raise TypeError(f"Sequential: layer {i} is a {type(layer).__name__}, not a kiln.Module")
        self.layers = list(items)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return x
