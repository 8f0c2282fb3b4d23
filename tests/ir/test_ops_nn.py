"""The neural-network ops (conv, pooling, normalization, erf) against torch, their shape errors, and dynamic dims."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kiln.ir import Builder, DType, ShapeError, TensorType, evaluate_op, interpret, parse, print_graph
from kiln.ir.registry import infer

DTYPES = [np.float32, np.float64]
TOLERANCE = {np.float32: {"rtol": 1e-4, "atol": 1e-4}, np.float64: {"rtol": 1e-10, "atol": 1e-10}}


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def run(kind: str, *arrays: np.ndarray, **attrs: Any) -> tuple[np.ndarray, ...]:
    """Infer an op's types from concrete arrays and evaluate its reference semantics."""
    full, types = infer(kind, [TensorType(a.shape, DType.from_numpy(a.dtype)) for a in arrays], attrs)
    return evaluate_op(kind, arrays, full, types)


def assert_close(got: np.ndarray, want: torch.Tensor) -> None:
    """Same dtype and shape as torch's result, and equal within the dtype's tolerance."""
    want = want.detach().numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **TOLERANCE[got.dtype.type])


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def torch_or_none(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


# --- convolution

CONV2D = [
    ((2, 3, 7, 9), (5, 3, 3, 3), {}, True),
    ((1, 4, 8, 5), (6, 2, 3, 2), {"stride": (2, 1), "padding": (1, 2), "groups": 2}, False),
    ((3, 6, 11, 10), (9, 2, 3, 3), {"stride": (2, 3), "padding": (2, 1), "dilation": (2, 2), "groups": 3}, True),
    ((2, 4, 5, 5), (8, 1, 1, 3), {"padding": (0, 1), "groups": 4}, True),
]
CONV1D = [
    ((2, 3, 10), (4, 3, 3), {}, True),
    ((3, 4, 13), (6, 2, 4), {"stride": (3,), "padding": (2,), "dilation": (2,), "groups": 2}, False),
    ((1, 5, 7), (5, 1, 7), {"groups": 5}, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "x_shape", "w_shape", "attrs", "bias"),
                         [("conv2d", *case) for case in CONV2D] + [("conv1d", *case) for case in CONV1D])
def test_conv_matches_torch(rng, kind: str, x_shape, w_shape, attrs: Mapping[str, Any], bias: bool, dtype) -> None:
    x, w = normal(rng, x_shape, dtype), normal(rng, w_shape, dtype)
    b = normal(rng, (w_shape[0],), dtype) if bias else None
    (got,) = run(kind, *(a for a in (x, w, b) if a is not None), **attrs)
    want = getattr(F, kind)(torch.from_numpy(x), torch.from_numpy(w), torch_or_none(b), **attrs)
    assert_close(got, want)


def test_conv2d_is_fast_on_a_realistic_batch(rng) -> None:
    x, w = normal(rng, (8, 64, 32, 32), np.float32), normal(rng, (64, 64, 3, 3), np.float32)
    start = time.perf_counter()
    (got,) = run("conv2d", x, w, padding=(1, 1))
    assert time.perf_counter() - start < 1.0
    assert got.shape == (8, 64, 32, 32)


# --- pooling


def torch_pool_args(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """kiln's pool attrs in torch's keyword spelling."""
    return {("kernel_size" if k == "kernel" else k): v for k, v in attrs.items()}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "attrs"), [
    ((2, 3, 7, 10), {"kernel": (3, 2)}),
    ((1, 2, 9, 8), {"kernel": (3, 3), "stride": (2, 1), "padding": (1, 1)}),
    ((2, 1, 11, 9), {"kernel": (2, 3), "stride": (1, 2), "padding": (1, 1), "dilation": (2, 1)}),
])
def test_max_pool2d_matches_torch(rng, shape, attrs, dtype) -> None:
    x = normal(rng, shape, dtype)
    (got,) = run("max_pool2d", x, **attrs)
    assert_close(got, F.max_pool2d(torch.from_numpy(x), **torch_pool_args(attrs)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "attrs"), [
    ((2, 3, 7, 10), {"kernel": (3, 2)}),
    ((1, 2, 9, 8), {"kernel": (3, 3), "stride": (2, 1), "padding": (1, 1)}),
    ((1, 2, 9, 8), {"kernel": (3, 3), "stride": (2, 1), "padding": (1, 1), "count_include_pad": False}),
    ((2, 1, 5, 7), {"kernel": (2, 4), "stride": (3, 2), "padding": (1, 2), "count_include_pad": False}),
])
def test_avg_pool2d_matches_torch(rng, shape, attrs, dtype) -> None:
    x = normal(rng, shape, dtype)
    (got,) = run("avg_pool2d", x, **attrs)
    assert_close(got, F.avg_pool2d(torch.from_numpy(x), **torch_pool_args(attrs)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "size"), [
    ((2, 3, 7, 10), (3, 4)), ((1, 2, 5, 5), (5, 5)), ((2, 2, 9, 7), (2, 3)), ((1, 3, 6, 6), (1, 1)),
    ((1, 1, 3, 4), (5, 7)),
])
def test_adaptive_avg_pool2d_matches_torch(rng, shape, size, dtype) -> None:
    x = normal(rng, shape, dtype)
    (got,) = run("adaptive_avg_pool2d", x, output_size=size)
    assert_close(got, F.adaptive_avg_pool2d(torch.from_numpy(x), size))


def test_adaptive_avg_pool2d_keeps_inf_in_its_bins() -> None:
    x = np.zeros((1, 1, 4, 5), np.float32)
    x[0, 0, 0, 0] = np.inf
    (got,) = run("adaptive_avg_pool2d", x, output_size=(3, 3))
    assert_close(got, F.adaptive_avg_pool2d(torch.from_numpy(x), (3, 3)))


# --- normalization

NORM_CASES = [((3, 5, 7), (-1,), True, True), ((3, 5, 7), (1, 2), True, False), ((4, 6), (-1,), False, False),
              ((2, 3, 4, 5), (-3, -2, -1), True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "axes", "with_gamma", "with_beta"), NORM_CASES)
def test_layer_norm_matches_torch(rng, shape, axes, with_gamma: bool, with_beta: bool, dtype) -> None:
    x = normal(rng, shape, dtype)
    trailing = shape[-len(axes):]
    gamma = normal(rng, trailing, dtype) if with_gamma else None
    beta = normal(rng, trailing, dtype) if with_beta else None
    operands = [a for a in (x, gamma) if a is not None]
    if beta is not None:
        operands.append(beta)
    (got,) = run("layer_norm", *operands, axes=axes, eps=1e-3)
    assert_close(got, F.layer_norm(torch.from_numpy(x), trailing, torch_or_none(gamma), torch_or_none(beta), 1e-3))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "axes", "with_gamma", "_"), NORM_CASES)
def test_rms_norm_matches_torch(rng, shape, axes, with_gamma: bool, _, dtype) -> None:
    x = normal(rng, shape, dtype)
    trailing = shape[-len(axes):]
    gamma = normal(rng, trailing, dtype) if with_gamma else None
    (got,) = run("rms_norm", *(a for a in (x, gamma) if a is not None), axes=axes, eps=1e-4)
    assert_close(got, F.rms_norm(torch.from_numpy(x), trailing, torch_or_none(gamma), 1e-4))


def batch_norm_operands(rng, shape: tuple[int, ...], dtype) -> list[np.ndarray]:
    c = shape[1]
    return [normal(rng, shape, dtype), normal(rng, (c,), dtype), normal(rng, (c,), dtype), normal(rng, (c,), dtype),
            rng.uniform(0.5, 2.0, c).astype(dtype)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 5), (2, 3, 7)])
def test_batch_norm_matches_torch(rng, shape, training: bool, dtype) -> None:
    x, gamma, beta, mean, var = batch_norm_operands(rng, shape, dtype)
    y, new_mean, new_var = run("batch_norm", x, gamma, beta, mean, var, np.array(training), eps=1e-3, momentum=0.3)
    torch_mean, torch_var = torch.from_numpy(mean.copy()), torch.from_numpy(var.copy())
    want = F.batch_norm(torch.from_numpy(x), torch_mean, torch_var, torch.from_numpy(gamma), torch.from_numpy(beta),
                        training=training, momentum=0.3, eps=1e-3)
    assert_close(y, want)
    assert_close(new_mean, torch_mean)
    assert_close(new_var, torch_var)
    if not training:
        np.testing.assert_array_equal(new_mean, mean)
        np.testing.assert_array_equal(new_var, var)


def test_batch_norm_training_needs_two_values_per_channel(rng) -> None:
    operands = batch_norm_operands(rng, (1, 3), np.float32)
    with pytest.raises(ShapeError, match="^batch_norm: .*more than one value per channel"):
        run("batch_norm", *operands, np.array(True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_erf_matches_torch(rng, dtype) -> None:
    x = normal(rng, (3, 7), dtype) * 2
    (got,) = run("erf", x)
    assert_close(got, torch.erf(torch.from_numpy(x)))


# --- shape errors


def f32(*shape: int | None) -> TensorType:
    return TensorType(shape, DType.f32)


FLAG, C3 = TensorType((), DType.bool), f32(3)

SHAPE_ERRORS = [
    ("conv2d", [f32(1, 4, 5, 5), f32(2, 3, 3, 3)], {}, "channels"),
    ("conv2d", [f32(1, 4, 5, 5), f32(6, 2, 3, 3)], {"groups": 3}, "does not divide operand 0"),
    ("conv1d", [f32(1, 6, 5), f32(4, 2, 3)], {"groups": 3}, "does not divide operand 1"),
    ("conv2d", [f32(1, 1, 2, 2), f32(1, 1, 5, 5)], {"padding": (1, 1)}, "larger than the padded input"),
    ("conv1d", [f32(1, 1, 4), f32(1, 1, 3)], {"dilation": (2,)}, "larger than the padded input"),
    ("conv2d", [f32(1, 4, 5), f32(2, 4, 3, 3)], {}, "operand 0 .x. must have rank 4"),
    ("conv1d", [f32(1, 4, 5), f32(2, 4, 3, 3)], {}, "operand 1 .weight. must have rank 3"),
    ("conv2d", [f32(1, 4, 5, 5), f32(2, 4, 3, 3), f32(3)], {}, "bias"),
    ("conv2d", [f32(1, 4, 5, 5), f32(2, 4, 3, 3)], {"stride": (1,)}, "stride"),
    ("conv2d", [TensorType((1, 4, 5, 5), DType.i32), TensorType((2, 4, 3, 3), DType.i32)], {}, "floating"),
    ("max_pool2d", [f32(1, 1, 2, 2)], {"kernel": (5, 5), "padding": (1, 1)}, "larger than the padded input"),
    ("max_pool2d", [f32(1, 1, 5, 5)], {"kernel": (2, 2), "padding": (2, 2)}, "half the kernel"),
    ("avg_pool2d", [f32(1, 5, 5)], {"kernel": (2, 2)}, "rank 4"),
    ("adaptive_avg_pool2d", [f32(1, 1, 5, 5)], {"output_size": (2,)}, "output_size"),
    ("layer_norm", [f32(2, 3, 4), f32(3)], {}, "operand 1 .gamma."),
    ("layer_norm", [f32(2, 3, 4), f32(4), f32(3, 4)], {}, "operand 2 .beta."),
    ("layer_norm", [f32(2, 3, 4)], {"axes": (3,)}, "out of range"),
    ("rms_norm", [f32(2, 3, 4), f32(3, 4)], {}, "operand 1 .gamma."),
    ("batch_norm", [f32(4, 3, 5), C3, C3, C3, C3, f32()], {}, "training flag"),
    ("batch_norm", [f32(4, 3, 5), C3, C3, C3, C3, TensorType((1,), DType.bool)], {}, "training flag"),
    ("batch_norm", [f32(4, 3, 5), f32(2), C3, C3, C3, FLAG], {}, "gamma"),
    ("batch_norm", [f32(4, 3, 5), C3, C3, C3, f32(3, 1), FLAG], {}, "running_var"),
    ("batch_norm", [f32(3), C3, C3, C3, C3, FLAG], {}, "operand 0 .x."),
    ("batch_norm", [f32(4, 3), C3, C3, C3, C3, FLAG], {"momentum": 1.5}, "momentum"),
]


@pytest.mark.parametrize(("kind", "types", "attrs", "fragment"), SHAPE_ERRORS,
                         ids=[f"{case[0]}-{case[3]}" for case in SHAPE_ERRORS])
def test_shape_errors_name_the_op(kind: str, types, attrs, fragment: str) -> None:
    with pytest.raises(ShapeError, match=f"^{kind}: .*{fragment}"):
        infer(kind, types, attrs)


# --- dynamic dims

DYNAMIC = [
    ("conv2d", [f32(None, 3, None, 9), f32(4, 3, 3, 3)], {"padding": (1, 1), "stride": (2, 2)}, [(None, 4, None, 5)]),
    ("conv1d", [f32(None, 3, None), f32(4, 3, 3)], {}, [(None, 4, None)]),
    ("max_pool2d", [f32(None, 2, None, 7)], {"kernel": (2, 2)}, [(None, 2, None, 3)]),
    ("avg_pool2d", [f32(None, 2, 6, None)], {"kernel": (3, 3), "padding": (1, 1)}, [(None, 2, 2, None)]),
    ("adaptive_avg_pool2d", [f32(None, 3, None, None)], {"output_size": (2, 3)}, [(None, 3, 2, 3)]),
    ("layer_norm", [f32(None, None, 8), f32(8)], {}, [(None, None, 8)]),
    ("batch_norm", [f32(None, 3, None), C3, C3, C3, C3, FLAG], {}, [(None, 3, None), (3,), (3,)]),
]


@pytest.mark.parametrize(("kind", "types", "attrs", "shapes"), DYNAMIC, ids=[case[0] for case in DYNAMIC])
def test_dynamic_dims_flow_through_inference(kind: str, types, attrs, shapes) -> None:
    _, results = infer(kind, types, attrs)
    assert [r.shape for r in results] == shapes


def dynamic_batch_net() -> Builder:
    """conv2d -> batch_norm (training) -> max_pool2d -> adaptive_avg_pool2d over a `?` batch."""
    b = Builder("Net")
    x = b.input("x", ((None, 3, 9, 8), "f64"))
    w = b.input("w", ((4, 3, 3, 3), "f64"))
    gamma, beta, mean, var = (b.input(n, ((4,), "f64")) for n in ("gamma", "beta", "mean", "var"))
    h = b.conv2d(x, w, padding=(1, 1))
    y, new_mean, new_var = b.batch_norm(h, gamma, beta, mean, var, b.flag("training", True), momentum=0.2)
    b.ret(b.adaptive_avg_pool2d(b.max_pool2d(y, kernel=(2, 2)), output_size=(2, 3)), new_mean, new_var)
    return b


@pytest.mark.parametrize("batch", [2, 5])
def test_dynamic_batch_runs_at_any_size(rng, batch: int) -> None:
    x = normal(rng, (batch, 3, 9, 8), np.float64)
    w = normal(rng, (4, 3, 3, 3), np.float64)
    gamma, beta, mean = (normal(rng, (4,), np.float64) for _ in range(3))
    var = rng.uniform(0.5, 2.0, 4)
    got = interpret(dynamic_batch_net().build(), [x, w, gamma, beta, mean, var])
    torch_mean, torch_var = torch.from_numpy(mean.copy()), torch.from_numpy(var.copy())
    h = F.batch_norm(F.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1), torch_mean, torch_var,
                     torch.from_numpy(gamma), torch.from_numpy(beta), training=True, momentum=0.2)
    assert_close(got[0], F.adaptive_avg_pool2d(F.max_pool2d(h, 2), (2, 3)))
    assert_close(got[1], torch_mean)
    assert_close(got[2], torch_var)


def test_text_round_trip() -> None:
    text = print_graph(dynamic_batch_net().build())
    assert "batch_norm" in text and "{padding = [1, 1]}" in text
    assert print_graph(parse(text)) == text
