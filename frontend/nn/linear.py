"""Linear and Embedding layers, with Burn's layouts and default initializers."""

from __future__ import annotations

import math

import numpy as np

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.param import Param
from kiln.frontend.tensor import Tensor, apply
from kiln.frontend.tracing import current_trace
from kiln.ir import Init, Layout, ShapeError

from . import sizes


def _kaiming(fan_in: int) -> Init:
    """Burn's Linear default: KaimingUniform(gain = 1/sqrt(3)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return Init("kaiming_uniform", (("gain", 1 / math.sqrt(3)), ("fan_in", fan_in)))


class Linear(Module):
    """y = x @ weight + bias, weight stored [in, out] as Burn stores it; `weight_layout` is its file form in
    records (`Layout.transpose()`: PyTorch's [out, in])."""

    def __init__(self, d_input: int, d_output: int, bias: bool = True, device: Device | str | None = None,
                 weight_layout: Layout | None = None):
        sizes.positive(self, d_input=d_input, d_output=d_output)
        self.weight = Param.lazy((d_input, d_output), _kaiming(d_input), device=device, layout=weight_layout)
        self.bias = Param.lazy((d_output,), _kaiming(d_input), device=device) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return apply("linear", x, self.weight.val())
        return apply("linear", x, self.weight.val(), self.bias.val())


class Embedding(Module):
    """Rows of `weight` [n_embedding, d_model] looked up by integer indices in [0, n_embedding); initialized N(0, 1).

    Eagerly an index outside that range is a ShapeError naming it (as torch's Embedding refuses it), where the
    `take` op alone would count a negative one from the end. A traced or compiled lookup cannot see index values:
    there TVM's kernel clamps them into range and ONNX Runtime's Gather counts negatives from the end.
    """

    def __init__(self, n_embedding: int, d_model: int, device: Device | str | None = None):
        sizes.positive(self, n_embedding=n_embedding, d_model=d_model)
        self.weight = Param.lazy((n_embedding, d_model), Init("normal"), device=device)

    def forward(self, indices: Tensor | np.ndarray) -> Tensor:
        if current_trace() is None:
            n = self.weight.lazy_shape()[0]
            index = indices.numpy() if isinstance(indices, Tensor) else np.asarray(indices)
            bad = index[(index < 0) | (index >= n)]
            if bad.size:
                raise ShapeError(f"Embedding: index {bad.flat[0]} is out of range for a table of {n} embeddings")
        return apply("take", self.weight.val(), indices, axis=0)
