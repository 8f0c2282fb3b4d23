"""Convolution and pooling layers (NCL / NCHW), with Burn's defaults: stride 1, no padding, bias on."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kiln.frontend.device import Device
from kiln.frontend.module import Module
from kiln.frontend.param import Param
from kiln.frontend.tensor import Tensor, apply
from kiln.ir import Init

from . import sizes


def _pair(v: int | Sequence[int], n: int) -> tuple[int, ...]:
    return (v,) * n if isinstance(v, int) else tuple(v)


class _ConvNd(Module):
    op = ""
    rank = 0

    def __init__(self, channels_in: int, channels_out: int, kernel_size: int | Sequence[int],
                 stride: int | Sequence[int] = 1, padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1,
                 groups: int = 1, bias: bool = True, device: Device | str | None = None):
        sizes.positive(self, channels_in=channels_in, channels_out=channels_out, kernel_size=kernel_size, stride=stride,
                       dilation=dilation, groups=groups)
        sizes.non_negative(self, padding=padding)
        if channels_in % groups or channels_out % groups:
            raise ValueError(f"groups {groups} must divide channels in ({channels_in}) and out ({channels_out})")
        kernel = _pair(kernel_size, self.rank)
        fan_in = channels_in // groups * math.prod(kernel)
        init = Init("kaiming_uniform", (("gain", 1 / math.sqrt(3)), ("fan_in", fan_in)))
        self.weight = Param.lazy((channels_out, channels_in // groups, *kernel), init, device=device)
        self.bias = Param.lazy((channels_out,), init, device=device) if bias else None
        self.stride, self.padding = _pair(stride, self.rank), _pair(padding, self.rank)
        self.dilation, self.groups = _pair(dilation, self.rank), groups

    def forward(self, x: Tensor) -> Tensor:
        operands = [x, self.weight.val()] + ([self.bias.val()] if self.bias is not None else [])
        return apply(self.op, *operands, stride=self.stride, padding=self.padding, dilation=self.dilation,
                     groups=self.groups)


class Conv1d(_ConvNd):
    """1-D convolution over [batch, channels, length]; weight [out, in/groups, k]."""

    op, rank = "conv1d", 1


class Conv2d(_ConvNd):
    """2-D convolution over [batch, channels, height, width]; weight [out, in/groups, kh, kw]."""

    op, rank = "conv2d", 2


class MaxPool2d(Module):
    """Max over kernel windows; Burn's default stride is 1."""

    def __init__(self, kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1):
        sizes.positive(self, kernel_size=kernel_size, stride=stride, dilation=dilation)
        sizes.non_negative(self, padding=padding)
        self.kernel, self.stride = _pair(kernel_size, 2), _pair(stride, 2)
        self.padding, self.dilation = _pair(padding, 2), _pair(dilation, 2)

    def forward(self, x: Tensor) -> Tensor:
        return apply("max_pool2d", x, kernel=self.kernel, stride=self.stride, padding=self.padding,
                     dilation=self.dilation)


class AvgPool2d(Module):
    """Mean over kernel windows; padding counts toward the divisor unless count_include_pad is off."""

    def __init__(self, kernel_size: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, count_include_pad: bool = True):
        sizes.positive(self, kernel_size=kernel_size, stride=stride)
        sizes.non_negative(self, padding=padding)
        self.kernel, self.stride, self.padding = _pair(kernel_size, 2), _pair(stride, 2), _pair(padding, 2)
        self.count_include_pad = count_include_pad

    def forward(self, x: Tensor) -> Tensor:
        return apply("avg_pool2d", x, kernel=self.kernel, stride=self.stride, padding=self.padding,
                     count_include_pad=self.count_include_pad)


class AdaptiveAvgPool2d(Module):
    """Mean pooling to a fixed output size, whatever the input size."""

    def __init__(self, output_size: int | Sequence[int]):
        sizes.positive(self, output_size=output_size)
        self.output_size = _pair(output_size, 2)

    def forward(self, x: Tensor) -> Tensor:
        return apply("adaptive_avg_pool2d", x, output_size=self.output_size)
