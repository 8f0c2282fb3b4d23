"""NCHW depthwise convs plane by plane (issue 13: depthwise 3x3 convs at or below onnxruntime): which ops the rewrite
takes, the schedule's sizes from the CPU model, and the numbers against the interpreter and torch on odd maps
(widths no vector divides, 7², stride 2, padding 0-2, dilation, asymmetric padding, bias and relu fused). Pools:
test_pool_rows.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX2, AVX512
from tvm import relax

import kiln
from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes, cpu_pipeline
from kiln.runtime.tvm.plane_window import ACC_BLOCK, OUT_BLOCK, vector_width
from kiln.runtime.tvm.schedules import CPUPlaneWindow
from kiln.runtime.tvm.schedules.plane_window import GROUP_PLANES, plane_group, row_tile
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
pytestmark = pytest.mark.usefixtures("module_cache")  # a rule that raises fails the test instead of falling back


def _graph(shape: tuple[int, ...], stride: int, padding: int, dilation: int) -> tuple[kiln.ir.Graph, list]:
    """relu(depthwise 3x3 conv + bias) as kiln lowers it; its weight and bias as params with data."""
    rng = np.random.default_rng(sum(shape) + stride)
    c = shape[1]
    w, bias = rng.standard_normal((c, 1, 3, 3)).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    b = Builder("Depthwise")
    x = b.input("x", (shape, "f32"))
    y = b.conv2d(x, b.param("w", w.shape, data=w), b.param("b", bias.shape, data=bias), stride=(stride, stride),
                 padding=(padding, padding), dilation=(dilation, dilation), groups=c)
    b.ret(b.relu(y))
    return b.build(), [rng.standard_normal(shape).astype(np.float32)]


@pytest.mark.parametrize(("shape", "stride", "padding", "dilation", "params"), [
    ((2, 13, 7, 7), 1, 1, 1, "bound"), ((1, 5, 9, 13), 2, 1, 1, "inputs"), ((1, 3, 12, 12), 2, 0, 1, "bound"),
    ((1, 6, 11, 10), 1, 2, 2, "inputs"), ((1, 4, 29, 28), 1, 0, 1, "bound")],
    ids=["7x7-13ch-batch2", "s2-9x13-weight-input", "s2-pad0", "dilated-pad2-weight-input", "pad0-29x28"])
def test_depthwise_bias_relu_matches_the_interpreter(shape: tuple[int, ...], stride: int, padding: int, dilation: int,
                                                     params: str) -> None:
    """The compiled conv (weights constants or inputs) equals kiln's numpy reference interpreter."""
    graph, inputs = _graph(shape, stride, padding, dilation)
    got = compile_graph(graph, target=TARGET, params=params, fast_math=False)(*inputs)
    np.testing.assert_allclose(got, kiln.ir.interpret(graph, inputs)[0], rtol=1e-5, atol=1e-5)


def _kernels(mod: tvm.IRModule, target: tvm.target.Target) -> list[tvm.tirx.PrimFunc]:
    with target:
        fused = tvm.transform.Sequential(cpu_fusion_passes(target, fast_math=False))(mod)
    return [f for _, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_lone_depthwise_conv_is_one_scheduled_plane_kernel(target: tvm.target.Target) -> None:
    """A lone NCHW depthwise conv with bias and relu is one kernel, scheduled by the plane rule for AVX2 and
    AVX-512 (the epilogue fused, channels in parallel, vectors of `vector_width` lanes, the real columns stored
    with the epilogue in vectors too: as a scalar loop the bias add tripled a 3x3/2 conv's time), and builds for
    both."""
    c = np.random.default_rng(1).standard_normal((24, 1, 3, 3)).astype(np.float32)
    bias = np.ones((24, 1, 1), np.float32)
    mod = relax_module([(1, 24, 14, 14)], lambda x: relax.op.nn.relu(
        relax.op.add(relax.op.nn.conv2d(x, relax.const(c), padding=1, groups=24), relax.const(bias))))
    (kernel,) = _kernels(mod, target)
    sch = CPUPlaneWindow().apply(kernel, target, False)
    assert sch is not None
    text = sch.mod["main"].script()
    lanes = vector_width(14, cpu_model(target).lanes())
    groups = 24 // plane_group(24, 4 * 16 * 18, cpu_model(target))  # planes of 16 rows, 16 + 2 columns
    assert f"T.parallel(T.int64({groups}))" in text and f"T.vectorized(T.int64({lanes}))" in text
    assert text.count("with T.sblock(") - text.count('# with T.sblock("root")') == 5  # pad, init, update, tile, out
    *_, store = sch.get_loops(sch.get_sblock(OUT_BLOCK))
    assert sch.get(store).kind == tvm.tirx.ForKind.VECTORIZED
    cpu_compile(mod, target, cpu_pipeline(target, fast_math=False))


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_each_row_of_a_tile_sums_its_window_before_the_next_row(target: tvm.target.Target) -> None:
    """Inside a register tile the rows are outside the window's taps, so each row's 3 x 3 taps run together and the
    next rows reuse the input vectors they loaded. With the taps outside the rows, every row's loads stayed live
    from tap to tap, and the spills made the 3x3 conv of 64x56² 1.65x slower on Zen 4."""
    w = relax.const(np.random.default_rng(6).standard_normal((8, 1, 3, 3)).astype(np.float32))
    mod = relax_module([(1, 8, 56, 56)], lambda x: relax.op.nn.conv2d(x, w, padding=1, groups=8))
    (kernel,) = _kernels(mod, target)
    sch = CPUPlaneWindow().apply(kernel, target, False)
    *_, rows, ry, rx, lanes = (sch.get(loop) for loop in sch.get_loops(sch.get_sblock(f"{ACC_BLOCK}_update")))
    model = cpu_model(target)
    assert [int(loop.extent) for loop in (rows, ry, rx, lanes)] == [
        row_tile(56, 9, 3, model), 3, 3, vector_width(56, model.lanes())]
    assert rows.kind == tvm.tirx.ForKind.UNROLLED and lanes.kind == tvm.tirx.ForKind.VECTORIZED


def test_convs_that_are_not_depthwise_keep_their_kernels() -> None:
    """A grouped conv of two channels a group and a depthwise conv with a channel multiplier are not plane kernels."""
    grouped = relax_module([(1, 8, 10, 10), (8, 2, 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, groups=4))
    multiplier = relax_module([(1, 4, 10, 10), (8, 1, 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, groups=4))
    for mod in (grouped, multiplier):
        assert not [f for f in _kernels(mod, TARGET) if OUT_BLOCK in f.script()]


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_small_strided_plane_is_copied_by_unrolled_rows(target: tvm.target.Target) -> None:
    """The 3x3/2 depthwise conv of 27² (27 rows x 2 phases x 8-9 columns: under `UNROLLED_PLANE`) copies its plane
    row by unrolled row, which on AVX-512 leaves no gather or scatter in the kernel (as a loop, LLVM vectorized the
    copy across rows into them); a 56² plane (57 x 2 x 33) keeps its row loop."""
    w = relax.const(np.random.default_rng(4).standard_normal((4, 1, 3, 3)).astype(np.float32))
    small = relax_module([(1, 4, 27, 27)], lambda x: relax.op.nn.conv2d(x, w, strides=2, groups=4))
    large = relax_module([(1, 4, 56, 56)], lambda x: relax.op.nn.conv2d(x, w, strides=2, padding=1, groups=4))
    for mod, rows, unrolled in ((small, 27, True), (large, 57, False)):
        (kernel,) = _kernels(mod, target)
        text = CPUPlaneWindow().apply(kernel, target, False).mod["main"].script()
        assert (f"T.unroll(T.int64({rows}))" in text) == unrolled
    library = cpu_compile(small, target, cpu_pipeline(target, fast_math=False))
    assembly = library.mod.imports[0].inspect_source("asm")
    assert "vfmadd" in assembly and "vscatter" not in assembly and "vgather" not in assembly


def test_asymmetric_padding_matches_torch() -> None:
    """Padding (top, left, bottom, right) = (0, 1, 2, 1), as an imported ONNX conv may have it, at stride 2."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((1, 7, 15, 12)).astype(np.float32), rng.standard_normal((7, 1, 3, 3)).astype(np.float32)
    mod = relax_module([x.shape], lambda v: relax.op.nn.conv2d(v, relax.const(w), strides=2, padding=(0, 1, 2, 1),
                                                               groups=7))
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    padded = torch.nn.functional.pad(torch.from_numpy(x).double(), (1, 1, 0, 2))
    want = torch.nn.functional.conv2d(padded, torch.from_numpy(w).double(), stride=2, groups=7).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("columns", "lanes", "width"), [(56, 16, 16), (7, 16, 8), (28, 8, 8), (3, 8, 4), (1, 16, 1)])
def test_rows_take_the_narrowest_vector_that_needs_no_more_vectors(columns: int, lanes: int, width: int) -> None:
    """A 7-wide row is one 8-lane vector on AVX-512 (one 16-lane vector would pad it as far); 56 takes 16 lanes."""
    assert vector_width(columns, lanes) == width


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("rows", [56, 28, 14, 7, 13])
def test_row_tiles_fit_the_register_file_beside_the_weights(target: tvm.target.Target, rows: int) -> None:
    """A tile's accumulators, the 9 taps' weights and one input row's 3 shifted vectors fit the register file, the
    tile divides the rows, and a map whose divisors are all too small (7, 13 rows) is taken whole."""
    model = cpu_model(target)
    tile = row_tile(rows, 9, 3, model)
    assert rows % tile == 0 and tile <= model.accumulators
    assert tile + 9 + 3 <= model.vector_registers or tile == rows
    assert tile > 1 or rows > model.accumulators



@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize(("channels", "plane_bytes"), [(512, 360), (256, 1152), (13, 360), (4, 360), (64, 15312)])
def test_plane_groups_fit_a_quarter_of_l1_and_leave_every_core_work(target: tvm.target.Target, channels: int,
                                                                    plane_bytes: int) -> None:
    """A group's planes fit a quarter of L1 (or it is one plane), it divides the channels, holds at most
    `GROUP_PLANES`, and leaves each core a group at batch 1; small planes (7², 14²) are grouped, a 56² one not."""
    model = cpu_model(target)
    planes = plane_group(channels, plane_bytes, model)
    assert channels % planes == 0 and planes <= GROUP_PLANES
    assert planes * plane_bytes <= model.caches.l1d // 4 or planes == 1
    assert channels // planes >= min(channels, model.cores)
    assert (planes > 1) == (channels in (512, 256, 4) and plane_bytes < 2048)


def test_a_dynamic_batch_gets_the_plane_kernel_and_matches_the_interpreter() -> None:
    """Over a symbolic batch the plane rule schedules a depthwise conv with bias and SiLU (the batch fused with the
    channels into the parallel loop), and one build matches kiln's reference interpreter at batch 1 and 3. It once
    failed to build: `y * sigmoid(y)` reads the bias add twice, and the add lost its buffer."""
    rng = np.random.default_rng(3)
    w, bias = rng.standard_normal((8, 1, 3, 3)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    b = Builder("DepthwiseSiLU")
    x = b.input("x", ((None, 8, 16, 16), "f32"))
    y = b.conv2d(x, b.param("w", w.shape, data=w), b.param("b", bias.shape, data=bias), padding=(1, 1), groups=8)
    b.ret(b.mul(y, b.sigmoid(y)))
    graph, shape = b.build(), (8, 16, 16)
    kernels = [f for f in _kernels(lower(graph).module, TARGET) if OUT_BLOCK in f.script()]
    assert len(kernels) == 1 and CPUPlaneWindow().apply(kernels[0], TARGET, False) is not None
    exe = compile_graph(graph, target=TARGET, fast_math=False)
    for n in (1, 3):
        inputs = [np.random.default_rng(n).standard_normal((n, *shape)).astype(np.float32)]
        np.testing.assert_allclose(exe(*inputs), kiln.ir.interpret(graph, inputs)[0], rtol=1e-5, atol=1e-5)
