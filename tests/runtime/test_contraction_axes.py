"""CPUMatmul on contractions over several reduction axes (a K split in two, a blocked conv's `rb, ry, rx, rc`), and
contractions whose every reduction axis has length 1, against numpy and torch.

Issue 13's blocked conv read over whole input-channel blocks (`rb, ry, rx, rc`) came out wrong; the rule was the
suspect. These kernels are built from TE directly (not through a model), so each test pins the rule alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX512
from tvm import relax, te, tirx

from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.schedules import CPUInjective, CPUMatmul
from kiln.runtime.tvm.schedules.safe import DEBUG_ENV
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
RNG = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _rules_must_not_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")


def split_matmul(m: int, n: int, extents: tuple[int, ...], epilogue: bool) -> tirx.PrimFunc:
    """`C = A @ B` with K = prod(extents) walked by one reduction axis per extent (row-major), then
    `relu(C + bias)` if `epilogue`."""
    k = int(np.prod(extents))
    a, b = te.placeholder((m, k), name="A"), te.placeholder((k, n), name="B")
    bias = te.placeholder((n,), name="bias")
    axes = [te.reduce_axis((0, e), f"k{i}") for i, e in enumerate(extents)]
    flat = axes[0]
    for axis, extent in zip(axes[1:], extents[1:]):
        flat = flat * extent + axis
    c = te.compute((m, n), lambda i, j: te.sum(a[i, flat] * b[flat, j], axis=axes), name="C")
    if not epilogue:
        return te.create_prim_func([a, b, c])
    d = te.compute((m, n), lambda i, j: tirx.max(c[i, j] + bias[j], tirx.const(0, "float32")), name="D")
    return te.create_prim_func([a, b, bias, d])


def blocked_conv4(cin: int, hw: int, cout: int, lanes: int) -> tirx.PrimFunc:
    """The reverted blocked 3x3 conv: input `x[b, rb, h, w, rc]` (already padded), weight `[O/b, I, 3, 3, b]` read
    at `rb * lanes + rc`, reduction axes `rb, ry, rx, rc` (rc, the lane within an input block, innermost)."""
    x = te.placeholder((1, cin // lanes, hw + 2, hw + 2, lanes), name="x")
    w = te.placeholder((cout // lanes, cin, 3, 3, lanes), name="w")
    rb, ry, rx, rc = (te.reduce_axis((0, e), name) for e, name in ((cin // lanes, "rb"), (3, "ry"), (3, "rx"),
                                                                    (lanes, "rc")))
    y = te.compute((1, cout // lanes, hw, hw, lanes), lambda b, o, i, j, v: te.sum(
        x[b, rb, i + ry, j + rx, rc] * w[o, rb * lanes + rc, ry, rx, v], axis=[rb, ry, rx, rc]), name="conv")
    return te.create_prim_func([x, w, y])


def scheduled_run(func: tirx.PrimFunc, out_shape: tuple[int, ...], *arrays: np.ndarray) -> np.ndarray:
    """Schedule `func` with CPUMatmul for this host (the rule must apply), build it and run it."""
    sch = CPUMatmul().apply(func, TARGET, False)
    assert sch is not None
    args = [tvm.runtime.tensor(a) for a in (*arrays, np.zeros(out_shape, np.float32))]
    cpu_compile(sch.mod, TARGET)(*args)
    return args[-1].numpy()


@pytest.mark.parametrize(("m", "n", "extents", "epilogue"), [
    (16, 32, (2, 8), False),  # K split in two
    (7, 40, (3, 5), True),  # neither split a multiple of the lanes, ragged rows and columns
    (14, 16, (2, 3, 3, 8), True),  # four axes, as a blocked conv's rb, ry, rx, rc
    (14, 16, (1, 1, 1, 8), True),  # unit outer axes (a 1x1 conv over one input block)
    (7, 40, (2, 1, 3, 1), False),  # unit axes between and innermost
], ids=["k0xk1", "3x5-relu", "four-axes-relu", "unit-outer-relu", "unit-inner"])
def test_split_reduction_matches_numpy(m: int, n: int, extents: tuple[int, ...], epilogue: bool) -> None:
    """Every reduction axis is summed once: C = A @ B (then relu(C + bias)) with K walked by several axes."""
    k = int(np.prod(extents))
    a, b = RNG.standard_normal((m, k)).astype(np.float32), RNG.standard_normal((k, n)).astype(np.float32)
    bias = RNG.standard_normal(n).astype(np.float32)
    want = a.astype(np.float64) @ b
    inputs = (a, b, bias) if epilogue else (a, b)
    got = scheduled_run(split_matmul(m, n, extents, epilogue), (m, n), *inputs)
    np.testing.assert_allclose(got, np.maximum(want + bias, 0) if epilogue else want, rtol=1e-4, atol=1e-4)


def test_four_axis_blocked_conv_matches_torch_and_cross_builds() -> None:
    """The reverted `rb, ry, rx, rc` conv with channels in whole blocks is right under CPUMatmul (the rule is not
    what made it wrong: its index `rb * lanes + rc` runs past a weight whose I is no multiple of the lanes), and
    the same kernel builds for AVX-512."""
    lanes, cin, hw, cout = 8, 16, 6, 16
    x = RNG.standard_normal((1, cin, hw, hw)).astype(np.float32)
    w = RNG.standard_normal((cout, cin, 3, 3)).astype(np.float32)
    xb = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))).reshape(1, cin // lanes, lanes, hw + 2, hw + 2)
    wb = w.reshape(cout // lanes, lanes, cin, 3, 3).transpose(0, 2, 3, 4, 1)
    func = blocked_conv4(cin, hw, cout, lanes)
    got = scheduled_run(func, (1, cout // lanes, hw, hw, lanes), np.ascontiguousarray(xb.transpose(0, 1, 3, 4, 2)),
                        np.ascontiguousarray(wb))
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1).numpy()
    want = want.reshape(1, cout // lanes, lanes, hw, hw).transpose(0, 1, 3, 4, 2)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    cross = CPUMatmul().apply(func, AVX512, False)
    assert cross is not None
    cpu_compile(cross.mod, AVX512)


def test_no_rule_inlines_an_epilogue_into_a_unit_reduction() -> None:
    """dlight's normalization drops a contraction's only (length-1) reduction loop but keeps its init, so the
    block looks elementwise: CPUInjective took it and its bias was added twice. No kiln rule takes it now."""
    func = split_matmul(4, 8, (1, 1), epilogue=True)
    assert CPUInjective().apply(func, TARGET, False) is None
    assert CPUMatmul().apply(func, TARGET, False) is None


@pytest.mark.parametrize("block_convs", [True, False], ids=["blocked", "nchw"])
def test_one_channel_1x1_conv_with_bias_relu_matches_torch(block_convs: bool) -> None:
    """A 1x1 conv of a 1-channel map is a contraction of length 1: relu(conv(x, w) + b) through the CPU pipeline
    equals torch's (it was relu(x * w + 2b) before)."""
    shapes = [(1, 1, 16, 16), (16, 1, 1, 1), (1, 16, 1, 1)]
    x, w, b = (RNG.standard_normal(s).astype(np.float32) for s in shapes)
    mod = relax_module(shapes, lambda x, w, b: relax.op.nn.relu(relax.op.add(relax.op.nn.conv2d(x, w), b)))
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, block_convs=block_convs))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in (x, w, b))).numpy()
    t = [torch.from_numpy(a).double() for a in (x, w, b)]
    want = torch.relu(torch.nn.functional.conv2d(t[0], t[1]) + t[2]).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fast_math", [True, False], ids=["fast", "exact"])
def test_softmax_over_a_length_1_axis_is_one(fast_math: bool) -> None:
    """Softmax over one element (attention's first decoding step: one key) is 1; its max and sum are reductions
    of length 1, and the same normalization made them look elementwise (both builds gave values other than 1)."""
    x = RNG.standard_normal((4, 3, 1)).astype(np.float32)
    mod = relax_module([x.shape], lambda v: relax.op.nn.softmax(v, axis=-1))
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math))
    np.testing.assert_allclose(relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy(),
                               np.ones_like(x), rtol=1e-6)
