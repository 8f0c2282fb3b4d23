"""Linear and Embedding layers, with Burn's layouts and default initializers."""

from __future__ import annotations

import math

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.param import Param
from kiln.frontend.tensor import Tensor, apply
from kiln.ir import Init


def _kaiming(fan_in: int) -> Init:
    """Burn's Linear default: KaimingUniform(gain = 1/sqrt(3)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return Init("kaiming_uniform", (("gain", 1 / math.sqrt(3)), ("fan_in", fan_in)))


class Linear(Module):
    """y = x @ weight + bias, weight stored [in, out] as Burn stores it."""

    def __init__(self, d_input: int, d_output: int, bias: bool = True, device: Device | str | None = None):
        self.weight = Param.lazy((d_input, d_output), _kaiming(d_input), device=device)
        self.bias = Param.lazy((d_output,), _kaiming(d_input), device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return apply("linear", x, self.weight.val())
        return apply("linear", x, self.weight.val(), self.bias.val())


class Embedding(Module):
    """Rows of `weight` [n_embedding, d_model] looked up by integer indices; initialized N(0, 1)."""

    def __init__(self, n_embedding: int, d_model: int, device: Device | str | None = None):
        self.weight = Param.lazy((n_embedding, d_model), Init("normal"), device=device)

    def forward(self, indices: Tensor) -> Tensor:
        return apply("take", self.weight.val(), indices, axis=0)
