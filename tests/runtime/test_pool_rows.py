"""NCHW pools down columns then along rows (`pool_rows.py`; issue 13: pooling not behind onnxruntime): which pools the
rewrite takes, the kernel's vectors and row buffer from the CPU model, strided taps as shuffles rather than gathers,
and the numbers against the interpreter and an independent numpy oracle over drawn windows (asymmetric padding,
dilation, strides 1-4, maps no vector divides, a dynamic batch)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from cross_targets import AVX2, AVX512
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from tvm import relax
from tvm_ffi.structural import structural_map

import kiln
from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes, cpu_pipeline
from kiln.runtime.tvm.pool_rows import KERNEL_NAME, pool_rows_kernel
from kiln.runtime.tvm.row_vectors import RowSplit, row_vector
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
pytestmark = pytest.mark.usefixtures("module_cache")


def _kernel_names(mod: tvm.IRModule, target: tvm.target.Target = TARGET) -> list[str]:
    with target:
        fused = tvm.transform.Sequential(cpu_fusion_passes(target, fast_math=False))(mod)
    return [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


def _oracle(x: np.ndarray, kind: str, kernel: tuple[int, int], stride: tuple[int, int],
            padding: tuple[int, int, int, int], dilation: tuple[int, int], include: bool) -> np.ndarray:
    """The pool in float64 numpy, tap by tap over the padded map (-inf or 0 outside it)."""
    (kh, kw), (sh, sw), (top, left, bottom, right), (dh, dw) = kernel, stride, padding, dilation
    oh = (x.shape[2] + top + bottom - dh * (kh - 1) - 1) // sh + 1
    ow = (x.shape[3] + left + right - dw * (kw - 1) - 1) // sw + 1
    pads = ((0, 0), (0, 0), (top, bottom), (left, right))

    def taps(a: np.ndarray) -> np.ndarray:
        return np.stack([a[:, :, ry * dh:ry * dh + (oh - 1) * sh + 1:sh, rx * dw:rx * dw + (ow - 1) * sw + 1:sw]
                         for ry in range(kh) for rx in range(kw)])

    x = x.astype(np.float64)
    if kind == "max":
        return taps(np.pad(x, pads, constant_values=-np.inf)).max(axis=0)
    total = taps(np.pad(x, pads)).sum(axis=0)
    count = kh * kw if include else taps(np.pad(np.ones_like(x), pads)).sum(axis=0)
    return total / count


def _assembly(library: tvm.runtime.Executable) -> str:
    return library.mod.imports[0].inspect_source("asm")


def _run(mod: tvm.IRModule, x: np.ndarray, target: tvm.target.Target = TARGET) -> np.ndarray:
    exe = cpu_compile(mod, target, cpu_pipeline(target, fast_math=False))
    return relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def _pool_module(shape: tuple[int, ...], kind: str, kernel: tuple[int, int], stride: tuple[int, int],
                 padding: tuple[int, int, int, int], dilation: tuple[int, int], include: bool) -> tvm.IRModule:
    if kind == "max":
        return relax_module([shape], lambda v: relax.op.nn.max_pool2d(v, kernel, stride, padding, dilation))
    return relax_module([shape], lambda v: relax.op.nn.avg_pool2d(v, kernel, stride, padding, dilation,
                                                                  count_include_pad=include))


@st.composite
def _windows(draw: st.DrawFn) -> tuple:
    kernel = (draw(st.integers(1, 5)), draw(st.integers(1, 5)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    spans = [d * (k - 1) + 1 for k, d in zip(kernel, dilation)]
    padding = tuple(draw(st.integers(0, span // 2)) for span in (*spans, *spans))
    top, left, bottom, right = padding
    size = (draw(st.integers(max(1, spans[0] - top - bottom), 40)),
            draw(st.integers(max(1, spans[1] - left - right), 40)))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 5)), *size)
    return (shape, draw(st.sampled_from(["max", "avg"])), kernel, (draw(st.integers(1, 4)), draw(st.integers(1, 4))),
            padding, dilation, draw(st.booleans()))


# no shrinking: each step is a build
@settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(window=_windows())
def test_pools_over_drawn_windows_match_numpy(window: tuple) -> None:
    """Every drawn pool equals the float64 oracle where each window holds an element of the map."""
    shape, kind, kernel, stride, padding, dilation, include = window
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    want = _oracle(x, kind, kernel, stride, padding, dilation, include)
    assume(np.isfinite(want).all())  # a dilated window may fall wholly in the padding
    got = _run(_pool_module(shape, kind, kernel, stride, padding, dilation, include), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(window))


@pytest.mark.parametrize(("kind", "shape", "kernel", "stride", "padding", "dilation", "include"), [
    ("max", (2, 5, 13, 11), 3, 2, 1, 1, True), ("max", (1, 3, 12, 12), 2, 2, 1, 1, True),
    ("max", (1, 4, 15, 9), 3, 1, 2, 2, True), ("avg", (1, 6, 13, 13), 3, 2, 1, 1, True),
    ("avg", (2, 3, 11, 14), 3, 2, 1, 1, False), ("avg", (1, 2, 9, 9), 3, 1, 1, 2, False),
    ("max", (1, 3, 27, 27), 3, 2, 0, 1, True)],
    ids=["max-3x3s2-batch2", "max-2x2s2-pad1", "max-dilated-pad2", "avg-3x3s2", "avg-3x3s2-exclude-pad",
         "avg-dilated-exclude-pad", "max-3x3s2-pad0-27"])
def test_pools_match_the_interpreter(kind: str, shape: tuple[int, ...], kernel: int, stride: int, padding: int,
                                     dilation: int, include: bool) -> None:
    """kiln's max and average pools (padding counted in the average or not) run as the row kernel and equal kiln's
    reference interpreter."""
    b = Builder("Pool")
    x = b.input("x", (shape, "f32"))
    window = dict(kernel=(kernel, kernel), stride=(stride, stride), padding=(padding, padding),
                  dilation=(dilation, dilation))
    b.ret(b.max_pool2d(x, **window) if kind == "max" else b.avg_pool2d(x, **window, count_include_pad=include))
    graph, inputs = b.build(), [np.random.default_rng(7).standard_normal(shape).astype(np.float32)]
    assert f"{kind}_{KERNEL_NAME}" in _kernel_names(lower(graph).module)
    got = compile_graph(graph, target=TARGET, fast_math=False)(*inputs)
    np.testing.assert_allclose(got, kiln.ir.interpret(graph, inputs)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("budget", [64, 1024], ids=["one-row-blocks", "two-row-blocks"])
def test_row_blocks_past_the_last_row_move_back(budget: int) -> None:
    """A row buffer of one or a few rows (`buffer_bytes`) splits the 13 output rows into blocks whose last one ends
    at the map's last row; the result is unchanged."""
    shape = (1, 3, 26, 30)
    kernel = pool_rows_kernel("max", 3, 26, 30, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1], True, 16, budget)
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    library = cpu_compile(tvm.IRModule({"main": kernel.with_attr("global_symbol", "main")}), TARGET, "default")
    out = tvm.runtime.tensor(np.zeros((1, 3, 13, 15), np.float32))
    library.jit()["main"](tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(out.numpy(), _oracle(x, "max", (3, 3), (2, 2), (1, 1, 1, 1), (1, 1), True))


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_strided_taps_are_shuffles_not_gathers(target: tvm.target.Target) -> None:
    """A 3x3/2 max pool of 56² builds for AVX2 and AVX-512 into vector maxima whose stride-2 taps are permutes of
    contiguous loads: no gather, no scatter."""
    mod = relax_module([(1, 4, 56, 56)], lambda x: relax.op.nn.max_pool2d(x, 3, 2, 1))
    assembly = _assembly(cpu_compile(mod, target, cpu_pipeline(target, fast_math=False)))
    assert "vmaxps" in assembly and "vperm" in assembly
    assert "vgather" not in assembly and "vscatter" not in assembly


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_disjoint_windows_take_the_row_kernel_and_ceil_mode_keeps_tvms(ceil_mode: bool) -> None:
    """A 2x2/2 pool runs as the row kernel too; one in `ceil_mode` (windows past the map) keeps TVM's."""
    mod = relax_module([(1, 4, 13, 13)], lambda x: relax.op.nn.max_pool2d(x, 2, 2, ceil_mode=ceil_mode))
    assert bool([n for n in _kernel_names(mod) if KERNEL_NAME in n]) != ceil_mode


def test_a_dynamic_batch_relu_and_pool_match_the_interpreter() -> None:
    """A relu then a 3x3/2 max pool (the zoo ResNet's stem) over a dynamic batch: one build, the row kernel, equal to
    kiln's reference interpreter at batch 1 and 3."""
    b = Builder("ReluPool")
    x = b.input("x", ((None, 8, 16, 16), "f32"))
    b.ret(b.max_pool2d(b.relu(x), kernel=(3, 3), stride=(2, 2), padding=(1, 1)))
    graph = b.build()
    assert f"max_{KERNEL_NAME}" in _kernel_names(lower(graph).module)
    exe = compile_graph(graph, target=TARGET, fast_math=False)
    for n in (1, 3):
        inputs = [np.random.default_rng(n).standard_normal((n, 8, 16, 16)).astype(np.float32)]
        np.testing.assert_allclose(exe(*inputs), kiln.ir.interpret(graph, inputs)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("extent", "lanes", "width"), [(56, 16, 16), (28, 16, 16), (7, 16, 4), (12, 8, 8),
                                                        (3, 8, 2), (1, 16, 1)])
def test_rows_take_the_widest_vector_no_wider_than_the_row(extent: int, lanes: int, width: int) -> None:
    """28 outputs are two 16-lane vectors, the second overlapping the first; 7 are two of 4 lanes."""
    assert row_vector(extent, lanes) == width


@pytest.mark.parametrize(("width", "step", "starts"), [(64, 32, [0, 32]), (80, 32, [0, 32, 48]), (17, 16, [0, 1]),
                                                       (16, 16, [0]), (197, 16, [*range(0, 192, 16), 181])])
def test_a_row_split_starts_its_last_vector_where_it_ends_at_the_width(width: int, step: int, starts: list[int]
                                                                       ) -> None:
    """Whole vectors from 0, then one ending at the width (overlapping the one before where step does not divide
    it): the attention kernel's conversions of d and of v's columns walk these."""
    assert RowSplit(width, step).starts == starts


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_the_row_buffer_takes_half_the_l1_cache(target: tvm.target.Target) -> None:
    """The kernel of a 3x3/2 pool over 224-wide rows keeps its row buffer within half the target's L1 data cache."""
    model = cpu_model(target)
    kernel = pool_rows_kernel("max", 1, 224, 224, [3, 3], [2, 2], [1, 1, 1, 1], [1, 1], True, model.lanes(),
                              model.caches.l1d // 2)
    sizes: list[int] = []

    def record(alloc: tvm.tirx.AllocBuffer) -> tvm.tirx.AllocBuffer:
        sizes.append(int(np.prod([int(d) for d in alloc.buffer.shape])))
        return alloc

    structural_map(kernel.body, [(tvm.tirx.AllocBuffer, record)])
    assert sizes and all(0 < 4 * size <= model.caches.l1d // 2 for size in sizes)
