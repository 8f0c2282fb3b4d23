"""Every op kind's gradient rule, through the autodiff pass, against central finite differences (float64) and
against torch 2.13 autograd.

Each case builds a one-op graph whose float operands are float64 parameters (grad = true, data given), integer
and bool operands are function inputs and flags are graph flags, with loss = sum over the op's float results of
sum(result * W) for fixed random W. `forward_backward` gives d loss / d param; finite differences perturb the
parameter data one element at a time; torch computes the same loss with autograd.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.ir import (
    Builder,
    DType,
    FunctionBuilder,
    Graph,
    Interpreter,
    PassError,
    TensorType,
    parse,
    print_graph,
    registered,
    verify,
)
from kiln.ir.grad_rules import rule_for
from kiln.ir.gradients import BIG, GradContext
from kiln.ir.ops.quant import NF4
from kiln.passes.autodiff import Autodiff, gradient_name

DATA = np.random.default_rng(20240917)


def r(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return DATA.uniform(lo, hi, shape)


def pos(*shape: int) -> np.ndarray:
    return r(*shape, lo=0.3, hi=2.5)


def ints(*shape: int, lo: int = 0, hi: int = 3) -> np.ndarray:
    return DATA.integers(lo, hi, shape).astype(np.int64)


@dataclass(frozen=True)
class Flag:
    value: bool


@dataclass(frozen=True)
class Frozen:
    """A float64 parameter with grad = false."""

    value: np.ndarray


@dataclass
class Case:
    kind: str
    name: str
    operands: list[Any]
    oracle: Callable[..., Any] | None  # torch: (*operands) -> tensor or tuple of tensors
    attrs: dict[str, Any] = field(default_factory=dict)
    fd: bool = True
    fd_eps: float = 1e-6
    fd_tol: tuple[float, float] = (1e-5, 1e-6)
    results: tuple[int, ...] | None = None  # the results the loss sums (all when None)

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.name}"


CASES: list[Case] = []


def case(kind: str, name: str, operands: Sequence[Any], oracle: Callable[..., Any] | None, *, fd: bool = True,
         fd_eps: float = 1e-6, fd_tol: tuple[float, float] = (1e-5, 1e-6), results: tuple[int, ...] | None = None,
         **attrs: Any) -> None:
    CASES.append(Case(kind, name, list(operands), oracle, attrs, fd, fd_eps, fd_tol, results))


# -- elementwise ---------------------------------------------------------------------------------------------------

UNARY = {"neg": (torch.neg, r), "abs": (torch.abs, r), "relu": (torch.relu, r), "exp": (torch.exp, r),
         "log": (torch.log, pos), "sqrt": (torch.sqrt, pos), "rsqrt": (torch.rsqrt, pos), "tanh": (torch.tanh, r),
         "sigmoid": (torch.sigmoid, r), "silu": (F.silu, r), "erf": (torch.erf, r)}
for _kind, (_fn, _data) in UNARY.items():
    case(_kind, "3x4", [_data(3, 4)], _fn)
case("gelu", "exact", [r(3, 4)], lambda x: F.gelu(x))
case("gelu", "tanh", [r(3, 4)], lambda x: F.gelu(x, approximate="tanh"), approximate="tanh")
case("leaky_relu", "alpha", [r(3, 4)], lambda x: F.leaky_relu(x, 0.2), alpha=0.2)
case("relu", "scalar", [np.array(0.7)], torch.relu)

case("add", "broadcast", [r(3, 1, 4), r(2, 4)], torch.add)
case("sub", "broadcast", [r(4), r(3, 4)], torch.sub)
case("mul", "broadcast", [r(2, 3, 1), r(1, 3, 4)], torch.mul)
case("mul", "scalar", [r(3, 4), np.array(1.5)], torch.mul)
case("div", "broadcast", [r(3, 4), pos(4)], torch.div)
case("pow", "broadcast", [pos(3, 4), r(4)], torch.pow)
case("maximum", "broadcast", [r(3, 4), r(3, 1)], torch.maximum)
case("minimum", "broadcast", [r(2, 3), r(3)], torch.minimum)
_tie = r(2, 3)
case("maximum", "ties", [_tie, _tie.copy()], torch.maximum, fd=False)
case("minimum", "ties", [_tie, _tie.copy()], torch.minimum, fd=False)
case("where", "broadcast", [DATA.random((3, 4)) < 0.5, r(3, 1), r(4)], torch.where)
case("cast", "f64-to-f32", [r(3, 4)], lambda x: x.to(torch.float32), fd_eps=1e-2, fd_tol=(1e-3, 1e-4),
     dtype=DType.f32)
case("cast", "f64-to-f64", [r(3)], lambda x: x.to(torch.float64), dtype=DType.f64)
for _kind in ("equal", "less", "greater"):
    case(_kind, "floats", [r(3, 4), r(4)], None)  # bool results: zero gradient

# -- reductions ------------------------------------------------------------------------------------------------

for _kind, _fn in {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}.items():
    case(_kind, "axes-0-2", [r(2, 3, 4)], lambda x, f=_fn: f(x, dim=(0, 2)), axes=(0, 2))
    case(_kind, "keepdims", [r(2, 3, 4)], lambda x, f=_fn: f(x, dim=(1, -1), keepdim=True), axes=(1, -1),
         keepdims=True)
    case(_kind, "all", [r(3, 4)], lambda x, f=_fn: f(x, dim=(0, 1)))
case("max", "ties", [np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 0.5]])], lambda x: torch.amax(x, dim=1), fd=False,
     axes=(1,))
case("min", "ties-all", [np.array([[1.0, 0.5], [0.5, 0.5]])], lambda x: torch.amin(x), fd=False)
case("softmax", "axis-1", [r(3, 4, 2)], lambda x: torch.softmax(x, 1), axis=1)
case("log_softmax", "axis-0", [r(3, 4, 2)], lambda x: torch.log_softmax(x, 0), axis=0)

# piecewise constant: torch's gradient is zero, and so are finite differences away from the steps
for _kind, _fn in {"floor": torch.floor, "ceil": torch.ceil, "round": torch.round, "sign": torch.sign}.items():
    case(_kind, "3x4", [r(3, 4) + 0.25], _fn)
case("prod", "axes-0-2", [r(2, 3, 4)], lambda x: x.prod(2).prod(0), axes=(0, 2))
case("prod", "keepdims", [r(2, 3)], lambda x: x.prod(1, keepdim=True), axes=(1,), keepdims=True)
case("prod", "all", [r(3, 4)], lambda x: x.prod())
# torch's prod_backward at zeros: the product of the others for a lone zero, 0 where a slice holds two
case("prod", "zeros", [np.array([[0.0, 2.0, 3.0], [0.0, 0.0, 1.5], [1.0, -2.0, 0.5]])], lambda x: x.prod(1),
     axes=(1,))
case("cumsum", "forward", [r(3, 4)], lambda x: x.cumsum(1), axis=1)
case("cumsum", "exclusive-reverse", [r(4, 3)], lambda x: x.flip(0).cumsum(0).flip(0) - x, axis=0, exclusive=True,
     reverse=True)
case("topk", "values", [r(3, 5)], lambda x: torch.topk(x, 2)[0], k=2, results=(0,))
case("topk", "smallest-a0", [r(4, 3)], lambda x: torch.topk(x, 3, 0, largest=False)[0], k=3, axis=0, largest=False,
     results=(0,))
case("tile", "2d", [r(2, 3)], lambda x: x.repeat(2, 3), repeats=(2, 3))
case("tile", "rank3-ones", [r(2, 1, 3)], lambda x: x.repeat(1, 4, 1), repeats=(1, 4, 1))
case("scatter_nd", "rows", [r(5, 3), np.array([[1], [-1]]), r(2, 3)], lambda d, i, u: d.index_put((i[:, 0],), u))
# scatter_nd_reduce add against torch's index_put(accumulate=True): repeated rows sum their updates' gradients.
case("scatter_nd_reduce", "add-repeated", [r(4, 3), np.array([[1], [-3], [2]]), r(3, 3)],
     lambda d, i, u: d.index_put((i[:, 0] % 4,), u, accumulate=True), reduction="add")
case("scatter_nd", "elements", [r(3, 4), np.array([[0, 1], [2, 3], [1, -4]]), r(3)],
     lambda d, i, u: d.index_put((i[:, 0], i[:, 1]), u))


def _scatter_rows(reduce: str):
    """torch's scatter_reduce with include_self=True (ONNX ScatterND combines data too) over whole rows of a
    [n, c] data: index i[:, 0] (negatives from the end) repeated along the columns."""
    def fn(d, i, u):
        return d.scatter_reduce(0, (i[:, 0] % d.shape[0])[:, None].expand(-1, d.shape[1]), u, reduce,
                                include_self=True)
    return fn


def _scatter_elements(reduce: str):
    """The same over single elements of a [n, c] data (index pairs), through the flattened data."""
    def fn(d, i, u):
        flat = (i[:, 0] % d.shape[0]) * d.shape[1] + i[:, 1] % d.shape[1]
        return d.reshape(-1).scatter_reduce(0, flat, u, reduce, include_self=True).reshape(d.shape)
    return fn


# mul: repeated rows multiply; zeros: a slot with one zero factor passes the product of the others to it, a slot
# with two passes 0 (torch's scatter_reduce prod gradient); the product is multilinear, so finite differences hold
_ROWS = np.array([[1], [-3], [2]])
case("scatter_nd_reduce", "mul-repeated", [r(4, 3), _ROWS, r(3, 3)], _scatter_rows("prod"), reduction="mul")
case("scatter_nd_reduce", "mul-zeros",
     [np.array([[0.0, 1.5, 2.0], [0.0, 0.0, 1.0], [3.0, -1.0, 0.5], [1.0, 2.0, -2.0]]), _ROWS,
      np.array([[2.0, 0.0, 1.5], [-0.5, 4.0, 0.0], [0.0, 0.0, 2.0]])], _scatter_rows("prod"), reduction="mul")
case("scatter_nd_reduce", "mul-elements", [r(3, 4), np.array([[0, 1], [2, 3], [0, -3]]), r(3)],
     _scatter_elements("prod"), reduction="mul")
# max and min without ties (finite differences hold), and with ties: g split evenly over the data element and the
# updates equal to the result, as torch's scatter_reduce amax/amin does
case("scatter_nd_reduce", "max-repeated", [r(4, 3), _ROWS, r(3, 3)], _scatter_rows("amax"), reduction="max")
case("scatter_nd_reduce", "min-elements", [r(3, 4), np.array([[0, 1], [2, 3], [0, -3]]), r(3)],
     _scatter_elements("amin"), reduction="min")
case("scatter_nd_reduce", "max-ties",
     [np.array([[1.0, 5.0], [2.0, 2.0], [0.0, 0.0]]), np.array([[0], [0], [1]]),
      np.array([[1.0, 5.0], [2.0, 5.0], [2.0, -1.0]])], _scatter_rows("amax"), fd=False, reduction="max")
case("scatter_nd_reduce", "min-ties",
     [np.array([[1.0, -5.0], [2.0, 2.0]]), np.array([[1], [1], [0]]), np.array([[2.0, 2.0], [2.0, 3.0], [1.0, -5.0]])],
     _scatter_rows("amin"), fd=False, reduction="min")
for _kind in ("argmax", "argmin"):
    case(_kind, "i64-result", [r(3, 4)], None, axis=1)  # an integer result: no gradient

# -- linalg ----------------------------------------------------------------------------------------------------

case("matmul", "3d-2d", [r(2, 3, 4), r(4, 5)], torch.matmul)
case("matmul", "2d-2d", [r(3, 4), r(4, 5)], torch.matmul)
case("matmul", "vec-3d", [r(4), r(2, 4, 5)], torch.matmul)
case("matmul", "3d-vec", [r(2, 3, 4), r(4)], torch.matmul)
case("matmul", "vec-vec", [r(4), r(4)], torch.matmul)
case("matmul", "batch-broadcast", [r(2, 1, 3, 4), r(5, 4, 2)], torch.matmul)
case("linear", "bias", [r(2, 3, 4), r(4, 5), r(5)], lambda x, w, b: x @ w + b)
case("linear", "no-bias", [r(3, 4), r(4, 5)], lambda x, w: x @ w)
case("linear", "vector", [r(4), r(4, 5), r(5)], lambda x, w, b: x @ w + b)
case("lora", "scale", [r(4, 5), r(4, 2), r(2, 5)], lambda base, a, b: base + 0.5 * (a @ b), scale=0.5)


def _dora(base, a, b, m, scale=0.5):
    """DoRA (Liu et al. 2024) in torch for [in, out] weights: m * V / ||V|| over axis 0, the norm not detached."""
    v = base + scale * (a @ b)
    return m * v / torch.linalg.vector_norm(v, dim=0)


case("dora", "scale", [r(4, 5), r(4, 2), r(2, 5), pos(5)], _dora, scale=0.5)
case("dora", "frozen-base", [Frozen(r(3, 4)), r(3, 1), r(1, 4), pos(4)], lambda w, a, b, m: _dora(w, a, b, m, -2.0),
     scale=-2.0)
case("dora", "magnitude-only", [Frozen(r(3, 4)), Frozen(r(3, 2)), Frozen(r(2, 4)), r(4)], _dora, scale=0.5)

# -- nn ----------------------------------------------------------------------------------------------------------

case("conv1d", "plain", [r(2, 3, 6), r(4, 3, 3)], F.conv1d)
case("conv1d", "strided-grouped", [r(2, 4, 9), r(6, 2, 3), r(6)],
     lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1, dilation=2, groups=2),
     stride=(2,), padding=(1,), dilation=(2,), groups=2)
case("conv2d", "padded", [r(1, 2, 5, 5), r(3, 2, 3, 3), r(3)], lambda x, w, b: F.conv2d(x, w, b, padding=1),
     padding=(1, 1))
case("conv2d", "strided-grouped", [r(2, 4, 6, 5), r(4, 2, 3, 2), r(4)],
     lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2),
     stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)
case("conv2d", "stride-3", [r(1, 1, 8, 7), r(2, 1, 2, 3)], lambda x, w: F.conv2d(x, w, stride=3), stride=(3, 3))
case("max_pool2d", "padded", [r(2, 2, 6, 7)],
     lambda x: F.max_pool2d(x, (3, 2), stride=(2, 2), padding=(1, 1)), kernel=(3, 2), stride=(2, 2), padding=(1, 1))
case("max_pool2d", "dilated", [r(1, 2, 7, 6)], lambda x: F.max_pool2d(x, (2, 2), dilation=(2, 1)),
     kernel=(2, 2), dilation=(2, 1))
case("max_pool2d", "overlapping", [r(1, 1, 5, 5)], lambda x: F.max_pool2d(x, 3, stride=1), kernel=(3, 3),
     stride=(1, 1))
case("max_pool2d", "ties", [np.ones((1, 1, 4, 4))], lambda x: F.max_pool2d(x, 2, stride=1), fd=False,
     kernel=(2, 2), stride=(1, 1))
# Transposed convolution, pad and resize against torch's autograd through conv_transpose{1,2}d, F.pad and
# F.interpolate (and finite differences).
case("conv_transpose1d", "strided-grouped", [r(2, 4, 5), r(4, 3, 3), r(6)],
     lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2, padding=1, output_padding=1, dilation=2, groups=2),
     stride=(2,), padding=(1,), output_padding=(1,), dilation=(2,), groups=2)
case("conv_transpose2d", "padded", [r(1, 2, 4, 3), r(2, 3, 3, 2), r(3)],
     lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 1), padding=(1, 0), output_padding=(1, 0)),
     stride=(2, 1), padding=(1, 0), output_padding=(1, 0))
case("conv_transpose2d", "dilated-groups", [r(2, 4, 3, 3), r(4, 1, 2, 2)],
     lambda x, w: F.conv_transpose2d(x, w, stride=3, dilation=(1, 2), groups=4), stride=(3, 3), dilation=(1, 2),
     groups=4)
case("pad", "constant-crop", [r(2, 5, 4)], lambda x: F.pad(x, [2, -1], value=0.5),
     before=(0, 0, 2), after=(0, 0, -1), value=0.5)
case("pad", "reflect", [r(2, 5, 6)], lambda x: F.pad(x, [3, 2], "reflect"), before=(0, 0, 3), after=(0, 0, 2),
     mode="reflect")
case("pad", "reflect-2d-cropped", [r(1, 2, 5, 6)], lambda x: F.pad(x[..., :-1, 1:], [0, 1, 2, 0], "reflect"),
     before=(0, 0, 2, -1), after=(0, 0, -1, 1), mode="reflect")
case("pad", "edge", [r(1, 2, 4, 5)], lambda x: F.pad(x, [1, 3, 2, 2], "replicate"), before=(0, 0, 2, 1),
     after=(0, 0, 2, 3), mode="edge")
case("resize", "bilinear", [r(1, 2, 3, 4)], lambda x: F.interpolate(x, [5, 7], mode="bilinear"), size=(5, 7),
     mode="linear", coordinate_mode="pytorch_half_pixel")
case("resize", "nearest-down", [r(1, 1, 5, 6)], lambda x: F.interpolate(x, [2, 4], mode="nearest"), size=(2, 4),
     coordinate_mode="asymmetric", nearest_mode="floor")
# tf_crop_and_resize against grid_sample at the same points (rows -2, 0, 2, 4, 6: two a pixel outside, whose
# extrapolated outputs take no gradient; cols 0.3 ... 2.7), as in test_ops_reference.
case("resize", "tf-crop-and-resize", [r(1, 2, 5, 4)],
     lambda x: F.grid_sample(x, torch.stack(torch.meshgrid(torch.tensor([0.3, 1.1, 1.9, 2.7], dtype=x.dtype) / 1.5 - 1,
                                                           torch.tensor([-2.0, 0, 2, 4, 6], dtype=x.dtype) / 2 - 1,
                                                           indexing="xy"), -1)[None],
                             align_corners=True),
     size=(5, 4), mode="linear", coordinate_mode="tf_crop_and_resize", roi=(-0.5, 0.1, 1.5, 0.9), extrapolation=2.5)
case("resize", "bicubic-antialias", [r(1, 2, 7, 6)], lambda x: F.interpolate(x, [3, 8], mode="bicubic", antialias=True),
     size=(3, 8), mode="cubic", cubic_coeff_a=-0.5, exclude_outside=True, antialias=True)
case("avg_pool2d", "with-pad", [r(2, 2, 6, 5)], lambda x: F.avg_pool2d(x, 3, stride=2, padding=1),
     kernel=(3, 3), stride=(2, 2), padding=(1, 1))
case("avg_pool2d", "without-pad", [r(1, 2, 6, 5)],
     lambda x: F.avg_pool2d(x, (3, 2), stride=(2, 1), padding=(1, 1), count_include_pad=False),
     kernel=(3, 2), stride=(2, 1), padding=(1, 1), count_include_pad=False)
# 3-D convolution and pooling against torch's autograd through conv3d, conv_transpose3d, max_pool3d, avg_pool3d.
case("conv3d", "strided-grouped", [r(1, 4, 4, 5, 4), r(4, 2, 2, 3, 2), r(4)],
     lambda x, w, b: F.conv3d(x, w, b, stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2),
     stride=(1, 2, 1), padding=(1, 0, 1), dilation=(2, 1, 1), groups=2)
case("conv_transpose3d", "padded", [r(1, 2, 3, 2, 3), r(2, 2, 2, 2, 3), r(2)],
     lambda x, w, b: F.conv_transpose3d(x, w, b, stride=(2, 1, 1), padding=(1, 0, 1), output_padding=(1, 0, 0)),
     stride=(2, 1, 1), padding=(1, 0, 1), output_padding=(1, 0, 0))
case("max_pool3d", "padded-dilated", [r(1, 2, 5, 4, 5)],
     lambda x: F.max_pool3d(x, (2, 3, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 1, 2)),
     kernel=(2, 3, 2), stride=(2, 1, 2), padding=(1, 1, 0), dilation=(1, 1, 2))
case("avg_pool3d", "without-pad", [r(1, 2, 4, 5, 4)],
     lambda x: F.avg_pool3d(x, (2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0), count_include_pad=False),
     kernel=(2, 3, 2), stride=(1, 2, 2), padding=(1, 1, 0), count_include_pad=False)
case("avg_pool2d", "dilated-without-pad", [r(1, 2, 7, 6)],
     lambda x: F.conv2d(x, torch.ones(2, 1, 2, 2, dtype=x.dtype), padding=1, dilation=(2, 1), groups=2)
     / F.conv2d(torch.ones_like(x), torch.ones(2, 1, 2, 2, dtype=x.dtype), padding=1, dilation=(2, 1), groups=2),
     kernel=(2, 2), stride=(1, 1), padding=(1, 1), dilation=(2, 1), count_include_pad=False)
case("adaptive_avg_pool2d", "uneven", [r(2, 3, 7, 5)], lambda x: F.adaptive_avg_pool2d(x, (3, 2)),
     output_size=(3, 2))


def _torch_layer_norm(x, gamma=None, beta=None, axes=(-1,), eps=1e-5):
    mu = x.mean(dim=axes, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=axes, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps)
    shape = [d if i in [a % x.dim() for a in axes] else 1 for i, d in enumerate(x.shape)]
    if gamma is not None:
        y = y * gamma.reshape(shape)
    return y if beta is None else y + beta.reshape(shape)


case("layer_norm", "last", [r(2, 3, 4), r(4), r(4)], lambda x, g, b: F.layer_norm(x, (4,), g, b))
case("layer_norm", "axes-0-2", [r(2, 3, 4), r(2, 4), r(2, 4)],
     lambda x, g, b: _torch_layer_norm(x, g, b, axes=(0, 2)), axes=(0, 2))
case("layer_norm", "no-affine", [r(3, 5)], lambda x: F.layer_norm(x, (5,)))
case("rms_norm", "last", [r(2, 3, 4), r(4)], lambda x, g: F.rms_norm(x, (4,), g, eps=1e-5))
case("rms_norm", "axes-1-2", [r(2, 3, 4), r(3, 4)], lambda x, g: F.rms_norm(x, (3, 4), g, eps=1e-5), axes=(1, 2))
case("rms_norm", "no-gamma", [r(3, 5)], lambda x: F.rms_norm(x, (5,), eps=1e-5))


def _torch_batch_norm(x, gamma, beta, rm, rv, training, momentum=0.1, eps=1e-5):
    """y, new running mean, new running var, as kiln's batch_norm returns them (differentiable throughout)."""
    axes = (0, *range(2, x.dim()))
    shape = (-1, *(1,) * (x.dim() - 2))
    if not training:
        y = (x - rm.reshape(shape)) / torch.sqrt(rv.reshape(shape) + eps) * gamma.reshape(shape) + beta.reshape(shape)
        return y, rm, rv
    y = F.batch_norm(x, None, None, gamma, beta, training=True, eps=eps)
    n = x.numel() // x.shape[1]
    mean, var = x.mean(dim=axes), x.var(dim=axes, unbiased=False)
    return y, (1 - momentum) * rm + momentum * mean, (1 - momentum) * rv + momentum * var * n / (n - 1)


for _train in (True, False):
    _mode = "train" if _train else "eval"
    case("batch_norm", f"{_mode}-4d", [r(4, 3, 2, 2), r(3), r(3), r(3), pos(3), Flag(_train)],
         lambda *a, t=_train: _torch_batch_norm(*a[:5], t, momentum=0.2), momentum=0.2)
    case("batch_norm", f"{_mode}-2d", [r(5, 3), r(3), r(3), Frozen(r(3)), Frozen(pos(3)), Flag(_train)],
         lambda *a, t=_train: _torch_batch_norm(*a[:5], t))
case("batch_norm", "runtime-flag", [r(4, 2, 3), r(2), r(2), r(2), pos(2), np.array(True)],
     lambda *a: _torch_batch_norm(*a[:5], True))


def _dropout_mask(shape: tuple[int, ...], p: float, seed: int) -> np.ndarray:
    """The mask kiln's dropout draws for the interpreter's run seed 0."""
    return np.random.default_rng([seed, 0]).random(shape) >= p


case("dropout", "training", [r(4, 5), Flag(True)],
     lambda x, t: x * torch.from_numpy(_dropout_mask((4, 5), 0.3, 7)) / 0.7, p=0.3, seed=7)
case("dropout", "off", [r(4, 5), Flag(False)], lambda x, t: x, p=0.3, seed=7)

# -- collectives: on one process all_reduce is the identity, so its gradient is too (the rule emits all_reduce(g);
# across ranks it averages the ranks' gradients, checked in tests/runtime/test_distributed.py) --------------------

case("all_reduce", "bucket", [r(2, 3), r(4)], lambda a, b: (a, b))
case("all_reduce", "sum-second-only", [r(3), r(2, 2)], lambda a, b: (a, b), op="sum", results=(1,))

# -- shape -----------------------------------------------------------------------------------------------------


def _torch_slice(x, starts, ends, axes, steps):
    for a, s, e, st in zip(axes, starts, ends, steps):
        idx = np.arange(x.shape[a])[slice(s, e, st)]
        x = x.index_select(a, torch.from_numpy(idx.copy()))
    return x


case("transpose", "perm", [r(2, 3, 4)], lambda x: x.permute(2, 0, 1), perm=(2, 0, 1))
case("transpose", "reverse", [r(2, 3, 4)], lambda x: x.permute(2, 1, 0))
case("reshape", "infer", [r(2, 3, 4)], lambda x: x.reshape(4, -1), shape=(4, -1))
case("broadcast_to", "expand", [r(3, 1)], lambda x: x.broadcast_to(2, 3, 4), shape=(2, 3, 4))
case("concat", "three", [r(2, 1, 3), r(2, 2, 3), r(2, 3, 3)], lambda *xs: torch.cat(xs, 1), axis=1)
case("slice", "strided", [r(5, 6, 7)], lambda x: _torch_slice(x, (1, 0), (4, 7), (0, 2), (2, 3)),
     starts=(1, 0), ends=(4, 7), axes=(0, 2), steps=(2, 3))
case("slice", "negative-step", [r(3, 7)], lambda x: _torch_slice(x, (-1,), (-BIG,), (1,), (-2,)),
     starts=(-1,), ends=(-BIG,), axes=(1,), steps=(-2,))
case("slice", "contiguous", [r(3, 4, 5)], lambda x: x[:, :, 1:3], starts=(1,), ends=(3,), axes=(2,))
case("slice", "negative-bounds", [r(6, 2)], lambda x: x[-4:-1], starts=(-4,), ends=(-1,))
_take_idx = np.array([[0, -1, 2, 2], [4, 1, -5, 0]])
case("take", "axis-0", [r(5, 3), _take_idx],
     lambda x, i: x.index_select(0, (i % 5).reshape(-1)).reshape(2, 4, 3))
case("take", "axis-1", [r(3, 5, 2), np.array([4, 0, 0, 2])], lambda x, i: x.index_select(1, i), axis=1)
case("take", "scalar-index", [r(3, 5), np.array(3)], lambda x, i: x[:, 3], axis=1)
case("gather", "axis-1", [r(3, 4), ints(3, 2, hi=4)], lambda x, i: torch.gather(x, 1, i), axis=1)
case("gather", "axis-0-negative", [r(4, 3, 2), ints(2, 3, 2, lo=-4, hi=4)],
     lambda x, i: torch.gather(x, 0, i % 4))

# -- quantization ----------------------------------------------------------------------------------------------


def _blocks(t, block):
    """A [4, 6] tensor as [2, 2, 2, 3] blocks of [2, 3]."""
    return t.reshape(t.shape[0] // block[0], block[0], t.shape[1] // block[1], block[1])


_codes = DATA.integers(-127, 128, (4, 6)).astype(np.int8)
case("dequantize", "blocks", [_codes, pos(2, 2)],
     lambda c, s: c.double() * s.repeat_interleave(2, 0).repeat_interleave(3, 1), value="q8s", block=(2, 3),
     dtype=DType.f64)
case("dequantize", "per-tensor", [DATA.integers(-7, 8, (3, 4)).astype(np.int8), pos(1)],
     lambda c, s: c.double() * s, value="q4s", dtype=DType.f64)
# QLoRA appendix E's NF4 levels (test_ops_quant checks the table against the normal quantiles)
_nf4 = torch.tensor(NF4, dtype=torch.float64)
case("dequantize", "nf4-blocks", [DATA.integers(-8, 8, (4, 6)).astype(np.int8), pos(4, 2)],
     lambda c, s: _nf4[c.long() + 8] * s.repeat_interleave(3, 1), value="nf4", block=(3,), dtype=DType.f64)
case("quantize", "minmax-blocks", [r(4, 6)],
     lambda x: (None, _blocks(x.float(), (2, 3)).abs().amax(dim=(1, 3)) * (2 / 254)), results=(1,),
     fd_eps=1e-3, fd_tol=(1e-3, 1e-5), value="q8s", block=(2, 3))
case("quantize", "absmean-per-tensor", [r(3, 4)], lambda x: (None, x.float().abs().mean().reshape(1) * (2 / 15)),
     results=(1,), fd_eps=1e-3, fd_tol=(1e-3, 1e-5), value="q4f", calibration="absmean")

# kinds with float operands whose gradient the cases above do not reach through a parameter
NO_FLOAT_OPERANDS = {"constant", "zeros", "ones", "full"}
BOOL_OPERANDS = {"logical_not", "logical_and", "logical_or", "logical_xor"}  # no float operand to differentiate
NO_GRADIENT = {"broadcast", "all_reduce_start", "all_reduce_wait"}  # refused with a PassError (test_*_no_gradient)


# ---------------------------------------------------------------------------------------------------------------
# harness


@dataclass
class Built:
    graph: Graph
    inputs: list[np.ndarray]
    params: list[tuple[str, np.ndarray]]  # trainable, in graph order
    weights: list[np.ndarray | None]  # one per result, None for those the loss leaves out


def _seed(text: str) -> int:
    return zlib.crc32(text.encode())


def build(c: Case) -> Built:
    rng = np.random.default_rng(_seed(c.id))
    b = Builder("M")
    operands, inputs, params = [], [], []
    for i, o in enumerate(c.operands):
        if isinstance(o, Flag):
            operands.append(b.flag(f"f{i}", o.value))
        elif isinstance(o, Frozen):
            operands.append(b.param(f"p{i}", o.value.shape, DType.f64, data=o.value, grad=False))
        elif o.dtype.kind == "f":
            operands.append(b.param(f"p{i}", o.shape, DType.from_numpy(o.dtype), data=o, grad=True))
            params.append((f"p{i}", o))
        else:
            operands.append(b.input(f"x{i}", TensorType(o.shape, DType.from_numpy(o.dtype))))
            inputs.append(o)
    outs = b.op(c.kind, *operands, **c.attrs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss, weights = None, []
    for j, out in enumerate(outs):
        if c.results is not None and j not in c.results:
            weights.append(None)
            continue
        if not out.type.dtype.is_float:
            out = b.cast(out, dtype=DType.f64)
        w = rng.standard_normal(out.type.shape).astype(out.type.dtype.numpy)
        weights.append(w)
        term = b.sum(b.mul(out, b.constant(w)))
        loss = term if loss is None else b.add(loss, term)
    b.ret(loss)
    return Built(b.build(), inputs, params, weights)


def autodiff_grads(built: Built) -> tuple[float, dict[str, np.ndarray]]:
    graph = verify(Autodiff().apply(built.graph))
    assert print_graph(parse(print_graph(graph))) == print_graph(graph)  # the gradient IR round-trips as text
    fn = graph.functions["forward_backward"]
    names = [r.name for r in fn.results[1:]]
    assert names == [gradient_name(p) for p, _ in built.params]
    outs = Interpreter(graph).run(built.inputs, "forward_backward")
    return float(outs[0]), {p: g for (p, _), g in zip(built.params, outs[1:])}


def loss_at(built: Built, overrides: dict[str, np.ndarray]) -> float:
    return float(Interpreter(built.graph, overrides).run(built.inputs)[0])


def finite_differences(built: Built, eps: float) -> dict[str, np.ndarray]:
    grads = {}
    for name, value in built.params:
        g = np.zeros(value.shape)
        for idx in np.ndindex(*value.shape):
            plus, minus = value.copy(), value.copy()
            plus[idx] += eps
            minus[idx] -= eps
            g[idx] = (loss_at(built, {name: plus}) - loss_at(built, {name: minus})) / (2 * eps)
        grads[name] = g
    return grads


def torch_grads(c: Case, built: Built) -> dict[str, np.ndarray]:
    ts, leaves = [], {}
    for i, o in enumerate(c.operands):
        if isinstance(o, Flag):
            ts.append(o.value)
        elif isinstance(o, Frozen):
            ts.append(torch.from_numpy(o.value.copy()))
        else:
            t = torch.from_numpy(np.array(o, copy=True))
            if o.dtype.kind == "f":
                t.requires_grad_(True)
                leaves[f"p{i}"] = t
            ts.append(t)
    outs = c.oracle(*ts)  # type: ignore[misc]
    outs = outs if isinstance(outs, tuple) else (outs,)
    loss = sum((o * torch.from_numpy(w)).sum() for o, w in zip(outs, built.weights) if w is not None)
    loss.backward()
    return {p: (leaves[p].grad.numpy() if leaves[p].grad is not None else np.zeros(leaves[p].shape))
            for p, _ in built.params}


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_gradient_matches_finite_differences_and_torch(c: Case) -> None:
    built = build(c)
    loss, got = autodiff_grads(built)
    assert np.isclose(loss, loss_at(built, {}))
    for name, g in got.items():
        assert g.shape == dict(built.params)[name].shape and g.dtype == dict(built.params)[name].dtype
    if c.oracle is None:  # piecewise-constant ops: the gradient is zero
        for name, g in got.items():
            np.testing.assert_array_equal(g, 0.0, err_msg=name)
        return
    want = torch_grads(c, built)
    for name in got:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-10, err_msg=f"{name} vs torch")
    if c.fd:
        rtol, atol = c.fd_tol
        fd = finite_differences(built, c.fd_eps)
        for name in got:
            np.testing.assert_allclose(got[name], fd[name], rtol=rtol, atol=atol, err_msg=f"{name} vs differences")


# ---------------------------------------------------------------------------------------------------------------
# coverage


def test_every_op_kind_has_a_gradient_rule() -> None:
    """A new op kind must come with a gradient rule (returning None for operands without gradients)."""
    missing = sorted(kind for kind in registered() if rule_for(kind) is None)
    assert not missing, f"op kinds without a gradient rule: {missing}"


def test_every_op_kind_with_float_operands_has_a_gradient_test() -> None:
    tested = {c.kind for c in CASES}
    untested = sorted(set(registered()) - tested - NO_FLOAT_OPERANDS - BOOL_OPERANDS - NO_GRADIENT)
    assert not untested, f"op kinds without a gradient test in this file: {untested}"


def test_bool_ops_take_only_bool_operands_and_give_no_gradient() -> None:
    for kind in sorted(BOOL_OPERANDS):
        b = Builder("M")
        xs = [b.input(f"x{i}", ((2,), DType.bool)) for i, _ in enumerate(registered()[kind].operands)]
        op = b.op(kind, *xs).owner
        assert rule_for(kind)(GradContext(b.fn, (True,) * len(xs)), op, (None,)) == (None,) * len(xs)


def test_source_ops_have_no_operand_gradients() -> None:
    for kind in sorted(NO_FLOAT_OPERANDS):
        assert registered()[kind].operands == ()


# ---------------------------------------------------------------------------------------------------------------
# integer operands, reuse, dynamic dims, random shapes


def test_integer_operands_get_no_gradient() -> None:
    """Indices, integer tensors and casts from integers carry no gradient; only the float param gets one."""
    b = Builder("M")
    idx = b.input("idx", ((3,), "i64"))
    n = b.param("n", (3,), DType.i64, data=np.array([1, 2, 3]), grad=False)
    w = b.param("w", (4, 2), DType.f64, data=r(4, 2), grad=True)
    picked = b.take(w, idx)  # [3, 2]
    scaled = b.mul(picked, b.reshape(b.cast(n, dtype=DType.f64), shape=(3, 1)))
    b.ret(b.sum(scaled))
    graph = verify(Autodiff().apply(b.build()))
    fn = graph.functions["forward_backward"]
    assert [v.name for v in fn.results[1:]] == ["grad.w"]
    (loss, gw) = Interpreter(graph).run([np.array([0, 3, 0])], "forward_backward")
    want = np.zeros((4, 2))
    want[0] += 1 + 3
    want[3] += 2
    np.testing.assert_allclose(gw, want)


def test_rules_return_none_for_integer_and_flag_operands() -> None:
    for c in CASES:
        if any(isinstance(o, Flag) or (isinstance(o, np.ndarray) and o.dtype.kind != "f") for o in c.operands):
            built = build(c)
            fn = built.graph.functions["forward"]
            op = next(o for o in fn.ops if o.kind == c.kind)
            fb = FunctionBuilder("t", built.graph.symbol)
            seeds = tuple(fb.emit("zeros", shape=tuple(res.type.shape), dtype=res.type.dtype)
                          if res.type.dtype.is_float else None for res in op.results)
            got = rule_for(c.kind)(GradContext(fb, (True,) * len(op.operands)), op, seeds)
            assert len(got) == len(op.operands)
            for o, g in zip(op.operands, got):
                if not o.type.dtype.is_float:
                    assert g is None, f"{c.id}: a gradient for a {o.type.dtype.value} operand"


def _torch_check(graph: Graph, inputs: list[np.ndarray], fn: Callable[..., torch.Tensor], **params: np.ndarray
                 ) -> None:
    """Autodiff gradients of `graph` against torch autograd of fn(*inputs, **params)."""
    out = verify(Autodiff().apply(graph))
    results = Interpreter(out).run(inputs, "forward_backward")
    leaves = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in params.items()}
    loss = fn(*(torch.from_numpy(np.array(x, copy=True)) for x in inputs), **leaves)
    loss.backward()
    np.testing.assert_allclose(results[0], loss.detach().numpy(), rtol=1e-10)
    names = [v.name for v in out.functions["forward_backward"].results[1:]]
    assert names == [gradient_name(k) for k in params]
    for k, g in zip(params, results[1:]):
        np.testing.assert_allclose(g, leaves[k].grad.numpy(), rtol=1e-8, atol=1e-10, err_msg=k)


def test_a_value_used_twice_accumulates() -> None:
    """w feeds mul(w, w) (twice in one op), a matmul and a sum: all contributions are summed."""
    wv, xv = r(3, 3), r(2, 3)
    b = Builder("M")
    x = b.input("x", ((2, 3), "f64"))
    w = b.param("w", (3, 3), DType.f64, data=wv)
    h = b.add(b.matmul(x, w), b.sum(b.mul(w, w), axes=(0,)))
    b.ret(b.add(b.sum(b.tanh(h)), b.sum(w)))
    _torch_check(b.build(), [xv], lambda x, w: torch.tanh(x @ w + (w * w).sum(0)).sum() + w.sum(), w=wv)


@pytest.mark.parametrize("batch", [1, 5])
def test_dynamic_batch_dims(batch: int) -> None:
    """A `?` batch through broadcasting, reductions over it (mean's count at run time), max, softmax, take,
    concat, slicing and norms; gradients reach the parameters through the dynamic dims."""
    wv, sv, gv, ev = r(4, 3), r(3), r(3), r(6, 3)
    xv, iv = r(batch, 2, 4), DATA.integers(0, 6, (batch, 2))
    b = Builder("M")
    x = b.input("x", ((None, 2, 4), "f64"))
    ids = b.input("ids", ((None, 2), "i64"))
    w, s, g, e = (b.param(n, v.shape, DType.f64, data=v) for n, v in (("w", wv), ("s", sv), ("g", gv), ("e", ev)))
    h = b.add(b.matmul(x, w), b.take(e, ids))  # [?, 2, 3]
    h = b.layer_norm(b.mul(h, s), g)
    h = b.concat(h, b.softmax(h, axis=0), axis=2)  # [?, 2, 6]
    m = b.mean(h, axes=(0, 1))  # a dynamic count
    top = b.max(b.slice(h, starts=(1,), ends=(5,), axes=(2,)), axes=(0,))
    b.ret(b.add(b.sum(b.mul(m, m)), b.sum(top)))

    def ref(x, ids, w, s, g, e):
        h = x @ w + e[ids]
        h = F.layer_norm(h * s, (3,), g)
        h = torch.cat([h, torch.softmax(h, 0)], 2)
        m = h.mean(dim=(0, 1))
        return (m * m).sum() + torch.amax(h[:, :, 1:5], dim=0).sum()

    _torch_check(b.build(), [xv, iv], ref, w=wv, s=sv, g=gv, e=ev)


def test_dynamic_dims_unsqueeze_without_reshape() -> None:
    """Two dynamic dims: reductions put their unit dims back with broadcast_to + transpose, not reshape."""
    wv = r(3)
    b = Builder("M")
    x = b.input("x", ((None, None, 3), "f64"))
    w = b.param("w", (3,), DType.f64, data=wv)
    h = b.mul(x, w)
    s = b.sum(b.exp(h), axes=(1,))  # [?, 3]
    b.ret(b.sum(b.log(s)))
    xv = r(2, 4, 3)
    _torch_check(b.build(), [xv], lambda x, w: torch.log(torch.exp(x * w).sum(1)).sum(), w=wv)


RANDOM_SEEDS = range(12)


@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_shapes_against_torch(seed: int) -> None:
    """Broadcasting binaries, multi-axis reductions and batched matmuls on random shapes."""
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(1, 4))
    shape = tuple(int(d) for d in rng.integers(1, 4, rank))
    other = tuple(d if rng.random() < 0.5 else 1 for d in shape)[int(rng.integers(0, rank)):]
    kind = ["add", "sub", "mul", "div", "maximum", "pow"][seed % 6]
    axes = tuple(sorted(int(a) for a in rng.choice(rank, size=int(rng.integers(1, rank + 1)), replace=False)))
    keep = bool(rng.random() < 0.5)
    av, bv = rng.uniform(0.5, 2.0, shape), rng.uniform(0.5, 2.0, other)
    k = int(rng.integers(1, 4))
    mv = rng.uniform(-1, 1, (shape[-1], k))
    b = Builder("M")
    a_, b_ = b.param("a", shape, DType.f64, data=av), b.param("b", other, DType.f64, data=bv)
    m_ = b.param("m", mv.shape, DType.f64, data=mv)
    y = b.op(kind, a_, b_)
    z = b.sum(b.mul(b.op("mean", y, axes=axes, keepdims=keep), b.constant(np.float64(1.5))))
    t = b.sum(b.tanh(b.matmul(y, m_)))
    b.ret(b.add(z, t))
    tfn = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
           "pow": torch.pow}[kind]

    def ref(a, b, m):
        y = tfn(a, b)
        return (y.mean(dim=axes, keepdim=keep) * 1.5).sum() + torch.tanh(y @ m).sum()

    _torch_check(b.build(), [], ref, a=av, b=bv, m=mv)


@pytest.mark.parametrize("batch", [2, 3])
def test_dynamic_batch_through_nn_and_indexing_ops(batch: int) -> None:
    """Input gradients of conv (grouped, strided), pools and batch norm with a `?` batch; take with indices of two
    dynamic dims (no reshape target: the where-and-sum form); concat and slice along a dynamic axis."""
    sv, wv, gv, bv, ev, cv = pos(2, 1, 1), r(4, 1, 3, 3), pos(4), r(4), r(6, 3), r(2, 3)
    xv, iv = r(batch, 2, 7, 7), DATA.integers(0, 4, (batch, 3))
    b = Builder("M")
    x = b.input("x", ((None, 2, 7, 7), "f64"))
    ids = b.input("ids", ((None, None), "i64"))
    s, w, g, beta, e, c = (b.param(n, v.shape, DType.f64, data=v)
                           for n, v in (("s", sv), ("w", wv), ("g", gv), ("beta", bv), ("e", ev), ("c", cv)))
    rm, rv = (b.param(n, (4,), DType.f64, data=v, grad=False) for n, v in (("rm", r(4)), ("rv", pos(4))))
    h = b.conv2d(b.mul(x, s), w, stride=(2, 2), padding=(1, 1), groups=2)  # [?, 4, 4, 4]
    h = b.avg_pool2d(h, kernel=(2, 2), stride=(1, 1), padding=(1, 1), count_include_pad=False)  # [?, 4, 5, 5]
    h = b.max_pool2d(h, kernel=(3, 3), stride=(2, 2))  # [?, 4, 2, 2]
    h, _, _ = b.batch_norm(h, g, beta, rm, rv, b.flag("train", True))
    feat = b.mean(h, axes=(2, 3))  # [?, 4]
    scaled = b.mul(b.slice(feat, starts=(1,), ends=(2**31 - 1,), axes=(0,)), b.constant(np.float64(2.0)))
    stacked = b.concat(b.slice(c, starts=(0,), ends=(1,), axes=(1,)), b.slice(scaled, starts=(0,), ends=(1,),
                                                                              axes=(1,)), axis=0)  # [?, 1]
    row = b.mul(b.sum(feat, axes=(1,)), b.constant(np.float64(0.1)))  # [?]
    picked = b.take(b.mul(e, b.reshape(b.sum(feat), shape=(1, 1))), ids)  # [?, ?, 3]: a one-hot matmul
    chosen = b.take(feat, ids, axis=1)  # [?, ?, ?]: no reshape target, a where of the one-hot summed
    loss = b.add(b.add(b.sum(b.tanh(picked)), b.sum(b.mul(stacked, stacked))), b.sum(b.exp(row)))
    b.ret(b.add(loss, b.sum(b.mul(chosen, chosen))))

    def ref(x, ids, s, w, g, beta, e, c):
        h = F.conv2d(x * s, w, stride=2, padding=1, groups=2)
        h = F.avg_pool2d(h, 2, stride=1, padding=1, count_include_pad=False)
        h = F.batch_norm(F.max_pool2d(h, 3, stride=2), None, None, g, beta, training=True)
        feat = h.mean(dim=(2, 3))
        stacked = torch.cat([c[:, 0:1], (feat[1:] * 2.0)[:, 0:1]], 0)
        picked = (e * feat.sum())[ids]
        chosen = feat[:, ids]
        return (torch.tanh(picked).sum() + (stacked * stacked).sum() + torch.exp(feat.sum(1) * 0.1).sum()
                + (chosen * chosen).sum())

    _torch_check(b.build(), [xv, iv], ref, s=sv, w=wv, g=gv, beta=bv, e=ev, c=cv)


def test_importing_kiln_ir_does_not_load_the_rules() -> None:
    import subprocess
    import sys
    code = ("import sys, kiln.ir, kiln.ir.gradients; "
            "assert 'kiln.ir.grad_rules' not in sys.modules; "
            "from kiln.ir.grad_rules import rule_for; "
            "assert rule_for('add') is not None and 'kiln.ir.grad_rules.nn' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------------------------------------------
# the rule's context


def test_a_rule_emits_only_the_gradients_its_context_wants() -> None:
    """matmul's rule asked for operand 1 only: no gradient (and no ops) for operand 0; both asked: both, equal to
    g @ b^T and a^T @ g evaluated by the interpreter."""
    b = Builder("M")
    x, w = b.input("x", ((2, 3), "f64")), b.input("w", ((3, 4), "f64"))
    b.ret(b.matmul(x, w))
    graph = b.build()
    op = graph.functions["forward"].ops[0]
    for wants in [(False, True), (True, True)]:
        fb = FunctionBuilder("t", graph.symbol)
        for a in (x, w):
            fb.args.append(a)
        g = fb.input("g", TensorType((2, 4), DType.f64))
        dx, dw = rule_for("matmul")(GradContext(fb, wants), op, (g,))
        assert (dx is not None) == wants[0] and dw is not None
        grads = Graph("G", functions={"t": fb.finish([d for d in (dx, dw) if d is not None])})
        xv, wv, gv = r(2, 3), r(3, 4), r(2, 4)
        got = Interpreter(grads).run([xv, wv, gv], "t")
        np.testing.assert_allclose(got[-1], xv.T @ gv)
        if wants[0]:
            np.testing.assert_allclose(got[0], gv @ wv.T)
        else:
            assert all(o.kind != "transpose" or o.operands[0] is not w for o in fb.ops)


def test_autodiff_hands_each_rule_a_context_with_the_active_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass passes a GradContext (not an attribute on the builder) marking only operands that need gradients:
    a frozen parameter's operand is not wanted."""
    seen: list[GradContext] = []
    rules = registered()["mul"].rules
    real = rules["grad"]

    def spy(ctx: GradContext, op, out_grads):
        seen.append(ctx)
        return real(ctx, op, out_grads)

    monkeypatch.setitem(rules, "grad", spy)
    b = Builder("M")
    w = b.param("w", (3,), DType.f64, data=r(3), grad=True)
    f = b.param("f", (3,), DType.f64, data=r(3), grad=False)
    b.ret(b.sum(b.mul(w, f)))
    Autodiff().apply(b.build())
    assert [ctx.wants for ctx in seen] == [(True, False)]
    assert not hasattr(seen[0].fb, "grad_wanted")


@pytest.mark.parametrize("kind", ["all_reduce_start", "all_reduce_wait"])
def test_all_reduces_halves_have_no_gradient(kind: str) -> None:
    """data-parallel{overlap} splits the gradients' all_reduces after autodiff; a graph differentiated through one
    is refused in one line."""
    b = Builder("M")
    w = b.param("w", (3,), DType.f64, data=r(3))
    b.ret(b.sum(b.op(kind, w)))
    with pytest.raises(PassError, match=rf"^{kind}: no gradient \(data-parallel places it after autodiff\)"):
        Autodiff().apply(b.build())


def test_broadcast_has_no_gradient() -> None:
    """Only rank src's operands reach a broadcast's results, on every rank; the gradient would be a reduction to src
    alone, which a rank-agnostic graph cannot say: autodiff refuses it in one line."""
    b = Builder("M")
    w = b.param("w", (3,), DType.f64, data=r(3))
    b.ret(b.sum(b.op("broadcast", w, src=1)))
    with pytest.raises(PassError, match=r"^broadcast: no gradient \(it would be a reduction to rank 1 alone\)"):
        Autodiff().apply(b.build())
