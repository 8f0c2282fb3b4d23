"""Normalization layers over the last dimension."""

from __future__ import annotations

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.param import Param
from kiln.frontend.tensor import Tensor, apply
from kiln.ir import Init


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last dim; gamma ones, beta zeros."""

    def __init__(self, d_model: int, eps: float = 1e-5, device: Device | str | None = None):
        self.gamma = Param.lazy((d_model,), Init("ones"), device=device)
        self.beta = Param.lazy((d_model,), Init("zeros"), device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return apply("layer_norm", x, self.gamma.val(), self.beta.val(), axes=(-1,), eps=self.eps)


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * gamma over the last dim."""

    def __init__(self, d_model: int, eps: float = 1e-5, device: Device | str | None = None):
        self.gamma = Param.lazy((d_model,), Init("ones"), device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return apply("rms_norm", x, self.gamma.val(), axes=(-1,), eps=self.eps)
