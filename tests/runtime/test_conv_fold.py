"""Epilogues folded into bf16 conv kernels (issue 13: ResNet-50 under bf16 spent a fifth of its time reading conv
results back for the bias, relu, residual and the next conv's cast): the kernel's stores against a float64 numpy
reference, what `conv_fold.py` takes and leaves (cross-builds for Zen 4 on any x86 host), and whole blocks against
float64 torch."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import torch
import tvm
from test_conv_bf16 import ZEN4, fused, needs_dot

import kiln
from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.conv_bf16 import (
    CONV_KERNEL_NAME,
    DEPTHWISE_KERNEL_NAME,
    bf16_skip,
    conv_kernel,
    depthwise_kernel,
    pack_conv_weight,
)
from kiln.runtime.tvm.conv_epilogue import CHANNEL, IMAGE, MAP, PAIRS, ConvEpilogue, PairsOutput
from kiln.runtime.tvm.conv_layout import pack_weight
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.pipeline import cpu_compile
from kiln.runtime.tvm.target import cpu_target

pytestmark = pytest.mark.usefixtures("module_cache")
GARBAGE = 0xDEADBEEF  # what the outputs hold before the kernel runs: every word it must write is checked


def _tensor(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _bf16(a: np.ndarray) -> np.ndarray:
    """`a` rounded to nearest-even bf16, as float64."""
    return a.astype(ml_dtypes.bfloat16).astype(np.float64)


def _pairs(x: np.ndarray, pad: int) -> np.ndarray:
    """An NCHW map as `conv_bf16.bf16_input` lays it out: [N, C/16, H + 2 pad, W + 2 pad, 8] words of channels c
    (low) and c + 8 (high), zero-padded."""
    n, c, h, w = x.shape
    bits = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))).astype(ml_dtypes.bfloat16).view(np.uint16)
    halves = bits.astype(np.uint32).reshape(n, c // 16, 2, 8, h + 2 * pad, w + 2 * pad).transpose(0, 1, 2, 4, 5, 3)
    return halves[:, :, 0] | halves[:, :, 1] << 16


def _unpaired(words: np.ndarray) -> np.ndarray:
    """The inverse of `_pairs` without removing the padding: [N, C, Hp, Wp] float64."""
    low, high = (words & 0xFFFF).astype(np.uint16), (words >> 16).astype(np.uint16)
    n, blocks, hp, wp, _ = words.shape
    both = np.stack([low, high], axis=2).transpose(0, 1, 2, 5, 3, 4).reshape(n, blocks * 16, hp, wp)
    return both.view(ml_dtypes.bfloat16).astype(np.float64)


@needs_dot
@pytest.mark.parametrize("skip_kind", [MAP, PAIRS])
def test_the_kernel_stores_every_epilogue_output_and_zeroes_the_borders(skip_kind: str) -> None:
    """A 3x3 conv (32 -> 32 channels, a 6x7 map) computing bias (per channel), gate (per image), residual (a map, or
    its unpadded bf16 pairs), relu and min(., 6), storing two f32 maps and two casts: one padded by 1 with 24 real
    channels (lanes 24-31 and the border zero), one unpadded. Outputs start as garbage; each is checked against
    float64 numpy from the same bf16-rounded operands (the sums within f32 accumulation error, the casts within one
    bf16 rounding)."""
    batch, size = (2, (6, 7))
    x, w = _tensor((batch, 32, *size), 1), _tensor((32, 32, 3, 3), 2) * 0.2
    bias, gate, skip = _tensor((32,), 3), _tensor((batch, 32), 4), _tensor((batch, 32, *size), 5)
    epilogue = ConvEpilogue(
        nodes=(("add", ("node", 0), ("operand", 0)), ("multiply", ("node", 1), ("operand", 1)),
               ("add", ("node", 2), ("operand", 2)), ("relu", ("node", 3)), ("minimum", ("node", 4), ("const", 6.0))),
        operands=(CHANNEL, IMAGE, skip_kind), maps=(3, 5),
        pairs=(PairsOutput(5, 24, (1, 1, 1, 1)), PairsOutput(4, 32, (0, 0, 0, 0))))
    kernel = conv_kernel(2, (8, 9), (3, 3), [1, 1], [1, 1], size, 2, cpu_model(cpu_target()), epilogue)
    build = cpu_compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), cpu_target())

    def blocked(a: np.ndarray) -> np.ndarray:  # [N, 32, ...] -> [N, 2, ..., 16]
        return np.ascontiguousarray(np.moveaxis(a.reshape(a.shape[0], 2, 16, *a.shape[2:]), 2, -1))

    outs = [np.full((batch, 2, *size, 16), GARBAGE, np.uint32).view(np.float32) for _ in range(2)]
    outs += [np.full((batch, 2, 8, 9, 8), GARBAGE, np.uint32), np.full((batch, 2, *size, 8), GARBAGE, np.uint32)]
    args = [_pairs(x, 1), pack_conv_weight(w), blocked(bias.reshape(1, 32, 1, 1)),
            blocked(gate.reshape(batch, 32, 1, 1)), blocked(skip) if skip_kind == MAP else _pairs(skip, 0), *outs]
    skip = skip if skip_kind == MAP else _bf16(skip)  # what the kernel adds
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in args]
    build(*tensors)
    got = [t.numpy() for t in tensors[-4:]]

    xp = np.pad(_bf16(x), ((0, 0), (0, 0), (1, 1), (1, 1)))
    windows = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))  # [N, C, H, W, 3, 3]
    conv = np.einsum("nchwyx,ocyx->nohw", windows, _bf16(w))
    terms = np.einsum("nchwyx,ocyx->nohw", np.abs(windows), np.abs(_bf16(w)))
    summed = (conv + bias[:, None, None]) * gate[:, :, None, None] + skip
    relu = np.maximum(summed, 0)
    tol = 2.0 ** -20 * (terms * (1 + np.abs(gate[:, :, None, None])) + np.abs(skip) + np.abs(bias[:, None, None]))
    nchw = [np.moveaxis(g, -1, 2).reshape(batch, 32, *size) for g in got[:2]]
    assert np.all(np.abs(nchw[0] - summed) <= tol)
    assert np.all(np.abs(nchw[1] - np.minimum(relu, 6)) <= tol)
    padded, capped = _unpaired(got[2]), np.minimum(relu, 6)[:, :24]
    assert np.all(np.abs(padded[:, :24, 1:-1, 1:-1] - capped) <= 2.0 ** -8 * capped + tol[:, :24])
    assert not padded[:, 24:].any() and not padded[:, :, [0, -1]].any() and not padded[:, :, :, [0, -1]].any()
    assert np.all(np.abs(_unpaired(got[3]) - relu) <= 2.0 ** -8 * relu + tol)


def _bottleneck(channels: int, mid: int, size: int, hard_swish: bool = False, blocks: int = 1, head: int = 1,
                project: bool = False) -> Graph:
    """`blocks` bottlenecks in a row, each `head`x`head` -> 3x3 -> 1x1 convs with biases and a residual add, relu
    (or hard-swish after the first) between them, the skip through a 1x1 conv with a bias where `project`; the
    input and the first block's first relu are also outputs, so both are stored as f32 maps beside the casts."""
    b = Builder("bottleneck")
    x = b.input("x", ((None, channels, size, size), "f32"))

    def conv(v, cin: int, cout: int, k: int, seed: int):
        w = b.param(f"w{seed}", (cout, cin, k, k), data=_tensor((cout, cin, k, k), seed) * (2 / (cin * k * k)) ** 0.5)
        bias = b.param(f"b{seed}", (cout,), data=_tensor((cout,), seed + 10) * 0.1)
        return b.conv2d(v, w, bias, padding=(k // 2, k // 2))

    y, first = x, None
    for block in range(blocks):
        h = conv(y, channels, mid, head, 3 * block + 1)
        h = b.div(b.mul(h, b.minimum(b.maximum(b.add(h, 3.0), 0.0), 6.0)), 6.0) if hard_swish else b.relu(h)
        first = h if first is None else first
        g = b.relu(conv(h, mid, mid, 3, 3 * block + 2))
        main = conv(g, mid, channels, 1, 3 * block + 3)
        y = b.relu(b.add(main, conv(y, channels, channels, 1, 100 + block) if project else y))
    b.ret(y, first)
    return verify(b.build())


def _torch_bottleneck(graph: Graph, x: np.ndarray, hard_swish: bool, blocks: int = 1, project: bool = False
                      ) -> list[np.ndarray]:
    t = {n: torch.from_numpy(np.asarray(p.data, np.float64)) for n, p in graph.params.items()}
    y, first = torch.from_numpy(x.astype(np.float64)), None
    conv = torch.nn.functional.conv2d
    for block in range(blocks):
        w = [(t[f"w{3 * block + k}"], t[f"b{3 * block + k}"]) for k in (1, 2, 3)]
        h = conv(y, *w[0])
        h = torch.nn.functional.hardswish(h) if hard_swish else torch.relu(h)
        first = h if first is None else first
        g = torch.relu(conv(h, *w[1], padding=1))
        y = torch.relu(conv(g, *w[2]) + (conv(y, t[f"w{100 + block}"], t[f"b{100 + block}"]) if project else y))
    return [y.numpy(), first.numpy()]


def test_the_fold_takes_the_epilogues_and_casts_and_leaves_no_kernel_between_convs() -> None:
    """Zen 4 cross-build of a bottleneck: each of the three convs is a kernel with its epilogue; what is left
    besides them is the cast of the block's NCHW input and the layout conversions at the region's edges."""
    for hard_swish in (False, True):
        mod = fused(_bottleneck(32, 24, 8, hard_swish), ZEN4)
        names = sorted(gv.name_hint for gv in mod.get_global_vars() if isinstance(mod[gv], tvm.tirx.PrimFunc))
        assert sum(n.startswith(f"{CONV_KERNEL_NAME}_epilogue") for n in names) == 3, names
        assert not any(n.startswith(CONV_KERNEL_NAME) and "epilogue" not in n for n in names), names
        rest = [n for n in names if not n.startswith(CONV_KERNEL_NAME)]
        assert all(n.startswith(("bf16_conv_input", "fused_to_blocked", "from_blocked", "to_blocked",
                                 "fused_from_blocked")) for n in rest), rest
        assert sum(n.startswith("bf16_conv_input") for n in rest) == 1, rest  # the NCHW input's cast only


def test_an_op_reading_the_conv_through_an_op_not_taken_ends_the_epilogue() -> None:
    """conv -> avg pool -> + conv: the pool is not elementwise, so the add (whose other operand is computed from
    the conv) stays out of the kernel; the pool reads the kernel's f32 result."""
    b = Builder("pool")
    x = b.input("x", ((None, 32, 8, 8), "f32"))
    w = b.param("w", (32, 32, 3, 3), data=_tensor((32, 32, 3, 3), 1))
    y = b.conv2d(x, w, padding=(1, 1))
    b.ret(b.add(b.avg_pool2d(y, kernel=(3, 3), stride=(1, 1), padding=(1, 1)), b.relu(y)))
    text = str(fused(verify(b.build()), ZEN4)["forward"])
    assert text.count(f"{CONV_KERNEL_NAME}_epilogue") == 1  # the relu is taken, the conv's map stored for the pool
    assert "avg_pool2d" in text and "R.add" not in text.split(f"{CONV_KERNEL_NAME}_epilogue")[0]


def _pooled_block(channels: int, size: int, head: int = 3) -> Graph:
    """ResNet-18's stem and first block in small: conv 3x3 + bias -> relu -> max pool 3x3/2 -> conv `head`x`head`
    -> relu -> conv 3x3, + the pool's map -> relu."""
    b = Builder("pooled")
    x = b.input("x", ((None, channels, size, size), "f32"))

    def conv(v, seed: int, k: int = 3):
        shape = (channels, channels, k, k)
        w = b.param(f"w{seed}", shape, data=_tensor(shape, seed) * (2 / (channels * k * k)) ** 0.5)
        return b.conv2d(v, w, b.param(f"b{seed}", (channels,), data=_tensor((channels,), seed + 10) * 0.1),
                        padding=(k // 2, k // 2))

    pooled = b.max_pool2d(b.relu(conv(x, 1)), kernel=(3, 3), stride=(2, 2), padding=(1, 1))
    b.ret(b.relu(b.add(conv(b.relu(conv(pooled, 2, head)), 3), pooled)))
    return verify(b.build())


@pytest.mark.parametrize("head", [1, 3])
def test_a_max_pool_after_a_bf16_conv_pools_its_pairs(head: int) -> None:
    """The stem's kernel stores only bf16 pairs; the pool reads and writes pairs (no f32 pool); the block's last
    conv reads them for its residual add in its store, and its first conv reads them too where it pads nothing (a
    1x1 head, ResNet-50's), else one cast pads them; no kernel of its own unpacks them. An f32 build keeps its f32
    pool."""
    mod = fused(_pooled_block(32, 12, head), ZEN4)
    names = [gv.name_hint for gv in mod.get_global_vars()]
    calls = _epilogue_calls(mod)
    assert [out for _, _, out in calls] == [["uint32"], ["uint32"], ["float32"]], calls
    pool = re.search(r"(\w+) = R\.call_tir\(bf16_max_pool, \((\w+),\)", str(mod["forward"]))
    assert pool is not None and pool.group(2) == calls[0][0], names
    assert pool.group(1) in calls[2][1] and (pool.group(1) in calls[1][1]) == (head == 1), calls
    padded = [n for n in names if n.startswith("fused_bf16_skip_bf16_conv_input")]  # the pooled pairs padded
    assert len(padded) == (head == 3) and not any(n == "bf16_skip" or "max_pool2d" in n for n in names), names
    assert "max_pool2d" in str(fused(_pooled_block(32, 12, head), ZEN4, "f32")["forward"])


@needs_dot
def test_a_block_after_a_pooled_bf16_conv_is_within_bf16_error_of_float64_torch() -> None:
    """The pool of bf16 pairs is the bf16 rounding of the f32 pool: batch 1 and 3 within the composed bf16 error
    (2^-6 of the output's scale), not an f32 result."""
    graph = _pooled_block(32, 12)
    program = kiln.compile(graph, precision="bf16")
    t = {n: torch.from_numpy(np.asarray(p.data, np.float64)) for n, p in graph.params.items()}
    conv = torch.nn.functional.conv2d
    for batch in (1, 3):
        x = _tensor((batch, 32, 12, 12), batch)
        pooled = torch.nn.functional.max_pool2d(torch.relu(conv(torch.from_numpy(x.astype(np.float64)), t["w1"],
                                                                t["b1"], padding=1)), 3, 2, 1)
        inner = torch.relu(conv(pooled, t["w2"], t["b2"], padding=1))
        exact = torch.relu(conv(inner, t["w3"], t["b3"], padding=1) + pooled).numpy()
        err = np.abs(np.asarray(program(x)) - exact)
        assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
        assert err.max() > 2.0 ** -16 * np.abs(exact).max()


@needs_dot
@pytest.mark.parametrize("hard_swish", [False, True])
def test_a_folded_bottleneck_is_within_bf16_error_of_float64_torch(hard_swish: bool) -> None:
    """24 mid channels (lanes 24-31 of the casts' last block zero), batch 1 and 3; both outputs within the
    composed bf16 error (2^-6 of the output's scale) and not an f32 result."""
    graph = _bottleneck(32, 24, 9, hard_swish)
    program = kiln.compile(graph, precision="bf16")
    for batch in (1, 3):
        x = _tensor((batch, 32, 9, 9), batch)
        for got, exact in zip(program(x), _torch_bottleneck(graph, x, hard_swish), strict=True):
            err = np.abs(np.asarray(got) - exact)
            assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
            assert err.max() > 2.0 ** -16 * np.abs(exact).max()


def _epilogue_calls(mod: tvm.IRModule) -> list[tuple[str, list[str], list[str]]]:
    """Each folded conv kernel call in order: (the var it binds, its arguments, the dtypes of its outputs: f32 maps,
    then uint32 pairs)."""
    calls = re.findall(rf"(\w+) = R\.call_tir\({CONV_KERNEL_NAME}_epilogue\d*, \(([^)]*)\), out_ty=(.*)",
                       str(mod["forward"]))
    return [(var, args.split(", "), re.findall(r'"(float32|uint32)"\)', out)) for var, args, out in calls]


def test_a_residual_skip_that_the_next_conv_reads_as_pairs_is_read_from_those_pairs() -> None:
    """Two bottlenecks in a row: the first block's output is the second's skip and its first conv's (unpadded) input.
    The first block's last conv stores it only as bf16 pairs, no f32 map, and the second block's last conv reads
    those pairs for its residual add; no kernel of its own unpacks them."""
    mod = fused(_bottleneck(32, 24, 8, blocks=2), ZEN4)
    calls = _epilogue_calls(mod)
    assert [out for _, _, out in calls] == [["float32", "uint32"], ["uint32"], ["uint32"], ["uint32"], ["uint32"],
                                            ["float32"]], calls
    assert calls[2][0] in calls[3][1] and calls[2][0] in calls[5][1], calls  # block 2's first conv, and its skip
    assert not any(gv.name_hint.startswith("bf16_skip") for gv in mod.get_global_vars())


def test_a_skip_whose_next_conv_pads_it_stays_an_f32_map() -> None:
    """Where the next block starts with a 3x3 conv, its pairs are padded, not the skip's map: the first block's last
    conv stores the skip as an f32 map beside them, and the second block's last conv reads that map."""
    mod = fused(_bottleneck(32, 24, 8, blocks=2, head=3), ZEN4)
    calls = _epilogue_calls(mod)
    assert calls[2][2] == ["float32", "uint32"], calls
    skip = re.search(rf"(\w+)(?::[^\n]*?)? = {calls[2][0]}\[0\]", str(mod["forward"])).group(1)
    assert calls[5][1][3:] == [skip], calls


def test_a_projection_skip_is_stored_as_pairs_and_read_from_them() -> None:
    """A bottleneck whose skip goes through a 1x1 conv: that conv's kernel stores only bf16 pairs, and the block's
    last conv reads them for its residual add; the block's first conv and the projection read one cast of the
    input (both 1x1, unpadded), and no kernel of its own unpacks the skip."""
    mod = fused(_bottleneck(32, 24, 8, project=True), ZEN4)
    calls = _epilogue_calls(mod)
    assert [out for _, _, out in calls] == [["float32", "uint32"], ["uint32"], ["uint32"], ["float32"]], calls
    assert calls[2][0] in calls[3][1], calls  # the projection's pairs, read by the last conv
    assert calls[0][1][0] == calls[2][1][0], calls  # the first conv and the projection read the same pairs
    names = [gv.name_hint for gv in mod.get_global_vars()]
    assert sum(n.startswith("bf16_conv_input") for n in names) == 1, names
    assert not any(n.startswith("bf16_skip") for n in names), names


def test_an_add_of_a_conv_and_its_own_input_gets_no_projection_cast() -> None:
    """The projection rule needs two independent convs: in the second of two bottlenecks whose skip the next conv
    pads (so no cast of it is unpadded), the last conv's result is computed from the skip, so it is not turned
    into pairs: it takes the add and stores its f32 result."""
    calls = _epilogue_calls(fused(_bottleneck(32, 24, 8, blocks=2, head=3), ZEN4))
    assert [out for _, _, out in calls] == [["float32", "uint32"], ["uint32"], ["float32", "uint32"], ["uint32"],
                                            ["uint32"], ["float32"]], calls
    assert not any(var.endswith("_pairs") for var, _, _ in calls), calls


@needs_dot
def test_a_bottleneck_with_a_bf16_projection_skip_is_within_bf16_error_of_float64_torch() -> None:
    """The projection's result rounded to bf16 once before the add (docs/precision.md): within the composed bf16
    error of float64 torch at batch 1 and 3, and not an f32 result."""
    graph = _bottleneck(32, 24, 9, project=True)
    program = kiln.compile(graph, precision="bf16")
    for batch in (1, 3):
        x = _tensor((batch, 32, 9, 9), batch)
        got, exact = np.asarray(program(x)[0]), _torch_bottleneck(graph, x, False, project=True)[0]
        err = np.abs(got - exact)
        assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
        assert err.max() > 2.0 ** -16 * np.abs(exact).max()


@needs_dot
def test_two_bottlenecks_with_a_bf16_skip_are_within_bf16_error_of_float64_torch() -> None:
    """The second block's skip is the first block's output rounded to bf16 (once, as its first conv reads it): the
    result stays within the composed bf16 error of float64 torch, batch 1 and 3 (the bound docs/precision.md
    states), and is not an f32 result."""
    graph = _bottleneck(32, 24, 9, blocks=2)
    program = kiln.compile(graph, precision="bf16")
    for batch in (1, 3):
        x = _tensor((batch, 32, 9, 9), batch)
        got, exact = np.asarray(program(x)[0]), _torch_bottleneck(graph, x, False, blocks=2)[0]
        err = np.abs(got - exact)
        assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
        assert err.max() > 2.0 ** -16 * np.abs(exact).max()


def test_the_skip_kernel_reads_pairs_back_as_their_f32_channels() -> None:
    """`bf16_skip` (the skip an add reads where no conv's store takes it): word q of a block back as channels q (low
    half) and q + 8 (high half), exactly the bf16 values, checked against `_unpaired`."""
    x = _tensor((2, 32, 5, 3), 7)
    pairs = tvm.te.placeholder((tvm.tirx.Var("n", "int64"), 2, 5, 3, 8), "uint32", name="pairs")
    build = cpu_compile(tvm.te.create_prim_func([pairs, bf16_skip(pairs)]), cpu_target())
    out = tvm.runtime.tensor(np.full((2, 2, 5, 3, 16), np.nan, np.float32))
    build(tvm.runtime.tensor(_pairs(x, 0)), out)
    got = np.moveaxis(out.numpy(), -1, 2).reshape(2, 32, 5, 3)
    np.testing.assert_array_equal(got, _unpaired(_pairs(x, 0)))


@needs_dot
@pytest.mark.parametrize(("kernel", "stride", "pad", "size"), [(3, 1, 1, 9), (5, 2, 2, 14), (3, 2, 1, 7)],
                         ids=["3x3", "5x5-s2", "3x3-s2-7-wide"])
def test_the_depthwise_kernel_sums_bf16_inputs_in_f32(kernel: int, stride: int, pad: int, size: int) -> None:
    """`depthwise_kernel` on padded pairs and an f32 weight, with an epilogue (bias, relu, an f32 map and the next
    conv's unpadded pairs), outputs starting as garbage: the map within f32 accumulation error of float64 numpy
    from the bf16-rounded input, the pairs within one more bf16 rounding."""
    x, w, bias = _tensor((2, 32, size, size), 1), _tensor((32, 1, kernel, kernel), 2), _tensor((32,), 3)
    out = (size + 2 * pad - kernel) // stride + 1
    epilogue = ConvEpilogue(nodes=(("add", ("node", 0), ("operand", 0)), ("relu", ("node", 1))), operands=(CHANNEL,),
                            maps=(2,), pairs=(PairsOutput(2, 32, (0, 0, 0, 0)),))
    side = size + 2 * pad
    func = depthwise_kernel(2, (side, side), (kernel, kernel), [stride, stride], [1, 1], (out, out),
                            cpu_model(cpu_target()), epilogue)
    build = cpu_compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), cpu_target())
    outs = [np.full((2, 2, out, out, 16), GARBAGE, np.uint32).view(np.float32),
            np.full((2, 2, out, out, 8), GARBAGE, np.uint32)]
    bias_blocked = np.ascontiguousarray(bias.reshape(1, 2, 16, 1, 1).transpose(0, 1, 3, 4, 2))
    tensors = [tvm.runtime.tensor(a) for a in (_pairs(x, pad), pack_weight(w, 16), bias_blocked, *outs)]
    build(*tensors)
    got = np.moveaxis(tensors[-2].numpy(), -1, 2).reshape(2, 32, out, out)
    conv = torch.nn.functional.conv2d(torch.from_numpy(_bf16(x)), torch.from_numpy(w.astype(np.float64)),
                                      stride=stride, padding=pad, groups=32)
    terms = torch.nn.functional.conv2d(torch.from_numpy(np.abs(_bf16(x))), torch.from_numpy(np.abs(w).astype(
        np.float64)), stride=stride, padding=pad, groups=32).numpy()
    want = np.maximum(conv.numpy() + bias[:, None, None], 0)
    tol = 2.0 ** -20 * (terms + np.abs(bias[:, None, None]))
    assert np.all(np.abs(got - want) <= tol)
    assert np.all(np.abs(_unpaired(tensors[-1].numpy()) - want) <= 2.0 ** -8 * want + tol)


def _depthwise_block(channels: int, size: int, stride: int) -> Graph:
    """1x1 conv + relu, a 3x3 depthwise conv + bias + relu (`stride`), 1x1 conv: an inverted residual's convs."""
    b = Builder("inverted")
    x = b.input("x", ((None, 16, size, size), "f32"))
    w1 = b.param("w1", (channels, 16, 1, 1), data=_tensor((channels, 16, 1, 1), 1) * 0.3)
    wd = b.param("wd", (channels, 1, 3, 3), data=_tensor((channels, 1, 3, 3), 2) * 0.3)
    bd = b.param("bd", (channels,), data=_tensor((channels,), 3) * 0.1)
    w2 = b.param("w2", (16, channels, 1, 1), data=_tensor((16, channels, 1, 1), 4) * 0.2)
    h = b.relu(b.conv2d(x, w1))
    h = b.relu(b.conv2d(h, wd, bd, stride=(stride, stride), padding=(1, 1), groups=channels))
    b.ret(b.conv2d(h, w2))
    return verify(b.build())


def test_a_depthwise_conv_between_bf16_convs_reads_and_writes_pairs() -> None:
    """Zen 4 cross-build of 1x1 -> depthwise 3x3 -> 1x1: the depthwise conv is `depthwise_kernel`, the first conv
    stores only its (padded) pairs, and the depthwise conv computes its bias and relu and stores only the next
    conv's pairs; no cast kernel is left between them."""
    mod = fused(_depthwise_block(48, 10, 1), ZEN4)
    calls = re.findall(r"= R\.call_tir\((\w+), \(([^)]*)\), out_ty=(.*)", str(mod["forward"]))
    kernels = [(name, re.findall(r'"(float32|uint32)"\)', out)) for name, _, out in calls
               if name.startswith((CONV_KERNEL_NAME, DEPTHWISE_KERNEL_NAME))]
    assert [(name.rstrip("0123456789"), out) for name, out in kernels] == [
        (f"{CONV_KERNEL_NAME}_epilogue", ["uint32"]), (f"{DEPTHWISE_KERNEL_NAME}_epilogue", ["uint32"]),
        (CONV_KERNEL_NAME, ["float32"])], kernels
    assert not any("bf16_conv_input" in name for name, _, _ in calls[1:]), calls  # the NCHW input's cast only


@needs_dot
@pytest.mark.parametrize("stride", [1, 2])
def test_a_bf16_depthwise_block_is_within_bf16_error_of_float64_torch(stride: int) -> None:
    """36 channels (a partial last block), batch 1 and 3: within the composed bf16 error (2^-6 of the output's
    scale) of float64 torch, and not an f32 result."""
    graph = _depthwise_block(36, 11, stride)
    program = kiln.compile(graph, precision="bf16")
    t = {n: torch.from_numpy(np.asarray(p.data, np.float64)) for n, p in graph.params.items()}
    for batch in (1, 3):
        x = _tensor((batch, 16, 11, 11), batch)
        h = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x.astype(np.float64)), t["w1"]))
        h = torch.relu(torch.nn.functional.conv2d(h, t["wd"], t["bd"], stride=stride, padding=1, groups=36))
        exact = torch.nn.functional.conv2d(h, t["w2"]).numpy()
        err = np.abs(np.asarray(program(x)) - exact)
        assert err.max() <= 2.0 ** -6 * np.abs(exact).max()
        assert err.max() > 2.0 ** -16 * np.abs(exact).max()
