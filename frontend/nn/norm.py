"""Normalization layers over the last dimension."""

from __future__ import annotations

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.param import Flag, Param
from kiln.frontend.tensor import Tensor, apply
from kiln.ir import Init, ShapeError

from . import sizes


class LayerNorm(Module):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last dim; gamma ones, beta zeros."""

    def __init__(self, d_model: int, eps: float = 1e-5, device: Device | str | None = None):
        sizes.positive(self, d_model=d_model)
        self.gamma = Param.lazy((d_model,), Init("ones"), device=device)
        self.beta = Param.lazy((d_model,), Init("zeros"), device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return apply("layer_norm", x, self.gamma.val(), self.beta.val(), axes=(-1,), eps=self.eps)


class RMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * gamma over the last dim."""

    def __init__(self, d_model: int, eps: float = 1e-5, device: Device | str | None = None):
        sizes.positive(self, d_model=d_model)
        self.gamma = Param.lazy((d_model,), Init("ones"), device=device)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return apply("rms_norm", x, self.gamma.val(), axes=(-1,), eps=self.eps)


class BatchNorm(Module):
    """Normalizes over every axis but the channel axis (1). In training it uses batch statistics and updates
    its running statistics in place (Burn's RunningState); in validation it uses the running statistics."""

    rank: int | None = None

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 device: Device | str | None = None):
        sizes.positive(self, num_features=num_features)
        self.gamma = Param.lazy((num_features,), Init("ones"), device=device)
        self.beta = Param.lazy((num_features,), Init("zeros"), device=device)
        self.running_mean = Param.running((num_features,), Init("zeros"), device=device)
        self.running_var = Param.running((num_features,), Init("ones"), device=device)
        self.training = Flag(True, True)
        self.eps, self.momentum = eps, momentum

    def forward(self, x: Tensor) -> Tensor:
        if self.rank is not None and x.type.rank != self.rank:
            raise ShapeError(f"{type(self).__name__} expects rank-{self.rank} input, got {x.type}")
        y, mean, var = apply("batch_norm", x, self.gamma.val(), self.beta.val(), self.running_mean.val(),
                             self.running_var.val(), self.training.tensor(), eps=self.eps, momentum=self.momentum)
        if self.training.value:
            self.running_mean.update(mean)
            self.running_var.update(var)
        return y


class BatchNorm1d(BatchNorm):
    """Batch norm over [batch, channels, length]."""

    rank = 3


class BatchNorm2d(BatchNorm):
    """Batch norm over [batch, channels, height, width]."""

    rank = 4
