"""bf16 convolutions on `vdpbf16ps` (issue 13, "matmul/conv in bf16 ... through AVX512-BF16"): the packed
weight against its definition, which convs and CPUs get the kernel (cross-builds, any x86 host), and numbers against
float64 torch within docs/precision.md's bf16 bound where the host has AVX512-BF16."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from test_precision import bf16_bound  # the documented bound, one place
from tvm.target import Target

import kiln
from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.conv_bf16 import (
    CONV_KERNEL_NAME,
    pack_conv_weight,
    pack_row_pair_weight,
    pairs_max_pool,
    row_pairs_input,
    takes_conv,
    takes_row_pairs,
)
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.dot_bf16 import has_dot
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.target import cpu_target

ZEN4 = Target({"kind": "llvm", "mcpu": "znver4", "num-cores": 2})  # AVX512-BF16, no AMX
ZEN3 = Target({"kind": "llvm", "mcpu": "znver3", "num-cores": 2})  # AVX2: bf16 widened to f32
needs_dot = pytest.mark.skipif(not has_dot(cpu_model(cpu_target())),
                               reason="the host CPU has no AVX512-BF16: a vdpbf16ps kernel cannot run")

pytestmark = pytest.mark.usefixtures("module_cache")


def _tensor(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def conv_graph(batch: int | None, channels: int, out: int, size: int, kernel: int, stride: int = 1,
               dilation: int = 1, groups: int = 1, bias: bool = True) -> Graph:
    """One conv2d of an NCHW [batch, channels, size, size] input, padded to keep the map (at stride 1), bound
    weight and bias."""
    b = Builder("conv")
    x = b.input("x", ((batch, channels, size, size), "f32"))
    shape = (out, channels // groups, kernel, kernel)
    w = b.param("w", shape, data=_tensor(shape, 1))
    args = [x, w] + ([b.param("b", (out,), data=np.linspace(-1, 1, out, dtype=np.float32))] if bias else [])
    pad = dilation * (kernel // 2)
    b.ret(b.conv2d(*args, stride=(stride, stride), padding=(pad, pad), dilation=(dilation, dilation), groups=groups))
    return verify(b.build())


def fused(graph: Graph, target: Target, precision: str = "bf16") -> tvm.IRModule:
    """`graph`'s module for `target` after the CPU pipeline's passes up to fusion, where the conv regions pass
    picks each conv's kernel."""
    mod = lower(graph, "bound", None, precision, target).module
    with target:
        return tvm.transform.Sequential(cpu_fusion_passes(target, precision=precision))(mod)


def fused_names(graph: Graph, target: Target, precision: str = "bf16") -> list[str]:
    """The names of the functions `fused` leaves (the kernels among them), sorted."""
    return sorted(gv.name_hint for gv in fused(graph, target, precision).get_global_vars())


def _bf16_bits(v: np.ndarray) -> np.ndarray:
    """The nearest-even bf16 bits of `v` as uint32."""
    return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def test_the_packed_weight_pairs_channels_c_and_c_plus_8() -> None:
    """Word (ob, cb, y, x, q, o) holds bf16(w[16 ob + o, 16 cb + q, y, x]) low and channel 16 cb + q + 8 high, rounded
    to nearest even, zero past O and I: checked element by element against that definition."""
    w = _tensor((20, 24, 3, 2), 5)
    packed = pack_conv_weight(w)
    assert packed.shape == (2, 2, 3, 2, 8, 16) and packed.dtype == np.uint32

    def bits(o: int, i: int, y: int, x: int) -> int:
        return int(_bf16_bits(w[o, i, y, x] if o < 20 and i < 24 else 0))

    for ob, cb, y, x, q, o in np.ndindex(packed.shape):
        want = bits(16 * ob + o, 16 * cb + q, y, x) | bits(16 * ob + o, 16 * cb + q + 8, y, x) << 16
        assert packed[ob, cb, y, x, q, o] == want, (ob, cb, y, x, q, o)


@pytest.mark.parametrize(("channels", "groups", "taken"), [
    (64, 1, True), (16, 1, True), (24, 1, True),  # 24 pads to 32: 1.33 channels per real one
    (3, 1, False), (17, 1, False), (8, 1, False),  # an RGB input, 17 -> 32, 8 -> 16: f32 is faster
    (64, 2, False), (64, 64, False)])  # grouped and depthwise convs stay f32
def test_which_convs_the_kernel_takes(channels: int, groups: int, taken: bool) -> None:
    assert takes_conv(channels, groups) is taken


def test_the_row_pair_weight_pairs_columns_2m_and_2m_plus_1() -> None:
    """Word (ob, c, y, m, 0, o) holds bf16(w[16 ob + o, c, y, 2m]) low and column 2m + 1 high (zero past the 7
    columns and the 20 output channels): checked element by element."""
    w = _tensor((20, 3, 2, 7), 6)
    packed = pack_row_pair_weight(w)
    assert packed.shape == (2, 3, 2, 4, 1, 16) and packed.dtype == np.uint32
    padded = np.zeros((32, 3, 2, 8), np.float32)
    padded[:20, :, :, :7] = w
    for ob, c, y, m, _, o in np.ndindex(packed.shape):
        want = _bf16_bits(padded[16 * ob + o, c, y, 2 * m]) | _bf16_bits(padded[16 * ob + o, c, y, 2 * m + 1]) << 16
        assert packed[ob, c, y, m, 0, o] == want, (ob, c, y, m, o)


def _build_te(inputs: list[tvm.te.Tensor], output: tvm.te.Tensor) -> tvm.runtime.Module:
    return tvm.compile(tvm.IRModule({"main": tvm.te.create_prim_func([*inputs, output])}), target="llvm")


def test_the_row_pairs_cast_holds_columns_j_and_j_plus_1_of_the_padded_map() -> None:
    """`row_pairs_input` built and run: word (b, c, i, j) is the padded map's columns j and j + 1 as bf16, zero in
    the padding (2 rows on top, 3 columns left, 1 bottom, 2 right) and past its width, which is rounded up to whole
    16-word vectors."""
    x = _tensor((2, 3, 5, 9), 7)
    padding = [2, 3, 1, 2]
    xt = tvm.te.placeholder(x.shape, "float32", name="x")
    func = _build_te([xt], row_pairs_input(xt, 3, padding))
    got = tvm.runtime.tensor(np.zeros((2, 3, 8, 16, 1), np.uint32))
    func(tvm.runtime.tensor(x), got)
    plane = np.zeros((2, 3, 8, 17), np.float32)
    plane[:, :, 2:7, 3:12] = x
    want = _bf16_bits(plane[..., :16]) | _bf16_bits(plane[..., 1:]) << 16
    np.testing.assert_array_equal(got.numpy()[..., 0], want)


def test_the_pairs_max_pool_is_the_pool_of_the_unpacked_values() -> None:
    """`pairs_max_pool` built and run on pairs of signed bf16 values: each half of each word is the max of its
    channel's window, the padding (one row and column each side) never winning, as numpy's pool of the unpacked
    map with -inf borders."""
    values = _tensor((2, 1, 7, 9, 16), 8).astype(ml_dtypes.bfloat16).astype(np.float32)
    words = _bf16_bits(values[..., :8]) | _bf16_bits(values[..., 8:]) << 16
    pairs = tvm.te.placeholder(words.shape, "uint32", name="pairs")
    func = _build_te([pairs], pairs_max_pool(pairs, [3, 3], [2, 2], [1, 1, 1, 1], [4, 5]))
    got = tvm.runtime.tensor(np.zeros((2, 1, 4, 5, 8), np.uint32))
    func(tvm.runtime.tensor(words), got)
    padded = np.full((2, 1, 9, 11, 16), -np.inf, np.float32)
    padded[:, :, 1:8, 1:10] = values
    pooled = np.zeros((2, 1, 4, 5, 16), np.float32)
    for i, j in np.ndindex(4, 5):
        pooled[:, :, i, j] = padded[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].max(axis=(2, 3))
    want = _bf16_bits(pooled[..., :8]) | _bf16_bits(pooled[..., 8:]) << 16
    np.testing.assert_array_equal(got.numpy(), want)


@pytest.mark.parametrize(("weight", "groups", "dilation", "taken"), [
    ((64, 3, 7, 7), 1, 1, True), ((64, 3, 3, 3), 1, 1, True), ((32, 8, 3, 3), 1, 1, True),  # 1728-9408 products
    ((32, 3, 3, 3), 1, 1, False), ((16, 3, 3, 3), 1, 1, False),  # 864 and 432 products: f32 is faster
    ((64, 3, 1, 1), 1, 1, False),  # one column: the pair's other half would be zero
    ((64, 3, 7, 7), 1, 2, False),  # dilated columns are not adjacent
    ((64, 1, 7, 7), 3, 1, False),  # grouped
    ((64, 64, 3, 3), 1, 1, False)])  # channels that fill blocks take channel pairs
def test_which_convs_take_column_pairs(weight: tuple[int, ...], groups: int, dilation: int, taken: bool) -> None:
    assert takes_row_pairs(weight, groups, dilation) is taken


def test_each_cpu_gets_its_conv() -> None:
    """A Zen 4 bf16 build computes a dense conv with the kernel, and leaves a depthwise one and an RGB input's
    in f32 (no bf16 cast in front of them); Zen 3 (no AVX512-BF16) and an f32 build never get it."""
    dense = conv_graph(None, 32, 48, 14, 3)
    assert sum(n.startswith(CONV_KERNEL_NAME) for n in fused_names(dense, ZEN4)) == 1
    assert not any(n.startswith(CONV_KERNEL_NAME) for n in fused_names(dense, ZEN3))
    assert not any(n.startswith(CONV_KERNEL_NAME) for n in fused_names(dense, ZEN4, "f32"))
    for graph in (conv_graph(None, 32, 32, 14, 3, groups=32), conv_graph(None, 3, 32, 14, 3)):
        names = fused_names(graph, ZEN4)
        assert not any(n.startswith(CONV_KERNEL_NAME) or "astype" in n or "cast" in n for n in names), names


def _check(program, graph: Graph, batch: int, channels: int, size: int, stride: int, dilation: int) -> None:
    """The build's output against float64 torch within the bf16 bound over each output's terms."""
    x = _tensor((batch, channels, size, size), batch + size)
    params = {n: np.asarray(p.data, np.float64) for n, p in graph.params.items()}
    w, bias = params["w"], params.get("b")
    pad = dilation * (w.shape[-1] // 2)

    def conv(a: np.ndarray, k: np.ndarray) -> np.ndarray:
        return torch.nn.functional.conv2d(torch.from_numpy(a), torch.from_numpy(k), None, stride, pad,
                                          dilation).numpy()

    exact = conv(x.astype(np.float64), w) + (0.0 if bias is None else bias[:, None, None])
    terms = conv(np.abs(x.astype(np.float64)), np.abs(w))  # sum_k |x_k w_k| of each output
    depth = w[0].size
    bound = bf16_bound(np.ones((1, depth)), np.ones((depth, 1)))[0, 0] / depth * terms
    err = np.abs(np.asarray(program(x)) - exact)
    assert np.all(err <= bound), err.max()
    assert err.max() > 2.0 ** -16 * terms.max()  # bf16's error: not an f32 build


@needs_dot
@pytest.mark.parametrize(("channels", "out", "size", "kernel", "stride", "dilation"), [
    (64, 64, 14, 1, 1, 1),  # a matmul over 196 pixels
    (32, 48, 9, 3, 1, 1),  # 81 pixels: the last row tile moves back; 3 output blocks, panels of 1 or 3
    (16, 32, 7, 3, 2, 1),  # strided: a 4x4 map, fewer pixels than a tile has rows
    (24, 40, 11, 3, 1, 2),  # dilated, input channels padded 24 -> 32, outputs 40 -> 48
    (16, 16, 3, 5, 1, 1),  # a 5x5 window over a map smaller than it (padding all round)
    (128, 64, 1, 1, 1, 1)])  # a 1x1 map: one pixel (a squeeze-excite's conv)
def test_bf16_convs_are_within_the_bound(channels: int, out: int, size: int, kernel: int, stride: int,
                                         dilation: int) -> None:
    graph = conv_graph(None, channels, out, size, kernel, stride, dilation)
    assert any(n.startswith(CONV_KERNEL_NAME) for n in fused_names(graph, cpu_target()))
    program = compile_graph(graph, precision="bf16")
    for batch in (1, 3):
        _check(program, graph, batch, channels, size, stride, dilation)


@needs_dot
@pytest.mark.parametrize(("channels", "out", "size", "kernel", "stride"), [
    (3, 64, 23, 7, 2),  # a ResNet stem: 7 columns as 4 pairs, the last half zero; an odd map
    (3, 48, 12, 5, 1),  # 3 pairs at stride 1, output channels padded 48 -> 48 in 3 blocks
    (8, 40, 9, 3, 1),  # 8 channels, 2 pairs; outputs 40 -> 48
    (3, 64, 10, 4, 2)])  # an even window: 2 whole pairs
def test_convs_over_column_pairs_are_within_the_bound(channels: int, out: int, size: int, kernel: int,
                                                      stride: int) -> None:
    """Convs over too few channels to fill a block run the bf16 kernel over column pairs, with their cast."""
    graph = conv_graph(None, channels, out, size, kernel, stride)
    names = fused_names(graph, cpu_target())
    assert any(n.startswith(CONV_KERNEL_NAME) for n in names) and "bf16_row_pairs" in names, names
    program = compile_graph(graph, precision="bf16")
    for batch in (1, 3):
        _check(program, graph, batch, channels, size, stride, 1)


@needs_dot
def test_an_empty_batch_gives_an_empty_result() -> None:
    """A symbolic batch of 0 makes no task (never a division by zero)."""
    program = compile_graph(conv_graph(None, 32, 32, 8, 3), precision="bf16")
    assert np.asarray(program(np.zeros((0, 32, 8, 8), np.float32))).shape == (0, 32, 8, 8)


def block_graph(channels: int, size: int) -> Graph:
    """A residual block: conv 3x3 -> relu -> conv 3x3 -> + x -> relu, so the second conv reads the first's blocked
    result through the relu and the cast."""
    b = Builder("block")
    x = b.input("x", ((None, channels, size, size), "f32"))
    w1 = b.param("w1", (channels, channels, 3, 3), data=_tensor((channels, channels, 3, 3), 7) * 0.1)
    w2 = b.param("w2", (channels, channels, 3, 3), data=_tensor((channels, channels, 3, 3), 8) * 0.1)
    h = b.relu(b.conv2d(x, w1, padding=(1, 1)))
    b.ret(b.relu(b.add(b.conv2d(h, w2, padding=(1, 1)), x)))
    return verify(b.build())


@needs_dot
def test_a_residual_block_runs_both_convs_in_bf16() -> None:
    """Both convs run the kernel inside one blocked region; the block is within bf16's error of float64 torch
    (the two bounds compose: 2^-6 of the terms' scale) and not an f32 result."""
    graph = block_graph(32, 10)
    assert str(fused(graph, cpu_target())["forward"]).count(CONV_KERNEL_NAME) == 2  # one kernel, called twice
    program = kiln.compile(graph, precision="bf16")
    x = _tensor((2, 32, 10, 10), 9)
    t = {n: torch.from_numpy(np.asarray(p.data, np.float64)) for n, p in graph.params.items()}
    xt = torch.from_numpy(x.astype(np.float64))
    h = torch.relu(torch.nn.functional.conv2d(xt, t["w1"], padding=1))
    exact = torch.relu(torch.nn.functional.conv2d(h, t["w2"], padding=1) + xt).numpy()
    err = np.abs(np.asarray(program(x)) - exact)
    assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
    assert err.max() > 2.0 ** -16 * np.abs(exact).max()
