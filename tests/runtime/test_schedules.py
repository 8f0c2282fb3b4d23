"""kiln's CPU schedule rules and pipeline, on Relax functions built directly (no kiln IR involved)."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch
import tvm
from cross_targets import AVX2, AVX512
from tile_text import unrolled_extents
from tvm import relax, s_tir, te, tirx
from tvm.s_tir import dlight as dl

from kiln.runtime.tvm import target as target_mod
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.conv_layout import from_blocked
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline, cuda_pipeline
from kiln.runtime.tvm.schedules import (
    CPUColumnReduction,
    CPUInjective,
    CPUMatmul,
    CPUPlaneWindow,
    CPUReductionFallback,
    CPURowReduction,
    CPUWindowReduction,
    Safe,
    default_cpu_rules,
)
from kiln.runtime.tvm.schedules.injective import PARALLEL_TASKS
from kiln.runtime.tvm.schedules.safe import DEBUG_ENV
from kiln.runtime.tvm.target import configure_threads, cpu_count, cpu_target, cuda_target

TARGET = cpu_target()
# Schedule-only checks of the sizes each ISA gets (these kernels are inspected, never run, so any host will do):
EXACT, FAST = 1e-4, 3e-3  # relative tolerances: exact math, fast-math kernels
Body = Callable[..., relax.Expr]


@pytest.fixture(autouse=True)
def _rules_must_not_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rule that raises would be skipped silently in production; here it fails the test."""
    monkeypatch.setenv(DEBUG_ENV, "1")


def fused_prim_funcs(mod: tvm.IRModule, fast_math: bool = False, block_convs: bool = True) -> list[tirx.PrimFunc]:
    """The PrimFuncs the CPU pipeline hands to the schedule rules (captured just before them)."""
    seen: list[tirx.PrimFunc] = []

    @tvm.transform.module_pass(opt_level=0, name="Capture")
    def capture(m: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        seen.extend(f for _, f in m.functions_items() if isinstance(f, tirx.PrimFunc))
        return m

    cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math, [capture], block_convs))
    return seen


def run(mod: tvm.IRModule, *arrays: np.ndarray, fast_math: bool = False, block_convs: bool = True) -> np.ndarray:
    """Compile with kiln's CPU pipeline and run `main` on the arrays."""
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math, block_convs=block_convs))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def check(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Elementwise rtol, with an absolute floor of rtol * max|want| for entries near zero."""
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(float(np.abs(want).max()), 1e-30))


def rand(*shape: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(np.float32)


def f64(*arrays: np.ndarray) -> list[np.ndarray]:
    return [a.astype(np.float64) for a in arrays]


def gelu(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def assert_matmul_rule_applies(mod: tvm.IRModule, fast_math: bool = False, extra_blocks: int = 0,
                               block_convs: bool = True) -> None:
    """The contraction is blocked by CPUMatmul itself (not left naive or caught by a fallback rule), and
    its epilogue is fused into the register-tile store: the kernel keeps only init, update and store
    blocks plus `extra_blocks` others (conv padding, an unfusable epilogue)."""
    (func,) = [f for f in fused_prim_funcs(mod, fast_math, block_convs) if _has_reduction(f)]
    sch = CPUMatmul().apply(func, TARGET, False)
    assert sch is not None
    text = sch.mod["main"].script()
    assert "T.parallel" in text and "T.vectorized" in text and 'scope="local"' in text
    assert text.count("with T.sblock(") - text.count('# with T.sblock("root")') == 3 + extra_blocks


def _has_reduction(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    return any(info.is_reduction() for info in dl.normalize_prim_func(sch))


# --- matmul and friends -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "k", "n"),
    [(64, 784, 512), (7, 13, 29), (1, 5, 3), (1, 784, 512), (37, 40, 100)],
    ids=["64x784x512", "odd-7x13x29", "tiny-1x5x3", "batch1", "ragged-tiles"],
)
def test_matmul(m: int, k: int, n: int) -> None:
    mod = relax_module([(m, k), (k, n)], relax.op.matmul)
    a, b = rand(m, k), rand(k, n, seed=1)
    check(run(mod, a, b), np.matmul(*f64(a, b)), EXACT)
    assert_matmul_rule_applies(mod)


def _pads_columns(rows: int, n: int) -> bool:
    """Whether `n` columns under `rows` rows are padded to whole vectors on the host (`_pad_tails`): more than one
    vector, fewer than the tile, no whole number of vectors, at least `mr` rows (8 AVX-512 / 4 AVX2 rows: 10 columns
    are padded under 7 rows on AVX2 only, 24 columns on AVX-512 only)."""
    rule = CPUMatmul().for_cpu(cpu_model(TARGET))
    return rows >= rule.mr and rule.lanes < n < rule.nr and n % rule.lanes != 0


@pytest.mark.parametrize(("m", "k", "n"),
                         [(1, 784, 512), (1, 512, 10), (7, 37, 77), (7, 77, 1000), (7, 1000, 10), (256, 512, 10)],
                         ids=["gemv", "gemv-n10", "odd-7x37x77", "odd-7x77x1000", "odd-7x1000x10", "b256-n10"])
def test_mlp_linear_bias_relu(m: int, k: int, n: int) -> None:
    """The issue's "widths such as 10, 77 or 1000" at batch 1 and odd batches: x @ w + b, relu, against numpy. A
    width `_pads_columns` names is padded to whole vectors (one more block: the copy of w; a weight `matmul_layout`
    packs is padded by its packing kernel instead), a GEMV's is not."""
    mod = relax_module([(m, k), (k, n), (n,)], lambda x, w, b: relax.op.nn.relu(relax.op.matmul(x, w) + b))
    x, w, b = rand(m, k), rand(k, n, seed=1), rand(n, seed=2)
    check(run(mod, x, w, b), np.maximum(np.matmul(*f64(x, w)) + b, 0), EXACT)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    packed = 'T.sblock("matmul_packed")' in func.script()
    assert_matmul_rule_applies(mod, extra_blocks=int(_pads_columns(m, n) and not packed))


def test_odd_batch_takes_its_rows_whole() -> None:
    """7 rows are one register tile of 7, not `mr` = 4 and a predicated tail (the tail's guard stopped the 7x77x1000
    layer at 34% of peak on Zen 3; whole, 57%): no `T.where` in the kernel."""
    (func,) = fused_prim_funcs(relax_module([(7, 77), (77, 1000)], relax.op.matmul))
    assert "T.where" not in CPUMatmul().apply(func, TARGET, False).mod["main"].script()


def _splits(sch: s_tir.Schedule) -> int:
    return sum(inst.kind.name == "Split" for inst in sch.trace.insts)


@pytest.mark.parametrize("target", [TARGET, AVX512, AVX2], ids=["host", "avx512", "avx2"])
@pytest.mark.parametrize(
    ("shape", "panels"),
    [((1024, 256, 1024), True), ((300, 200, 1000), True), ((2, 150, 256, 512), True), ((64, 784, 512), True),
     ((128, 768, 3072), True), ((3, 784, 512), False)],
    ids=["ffn-1024x256x1024", "ragged-panels", "batch-dims-count-as-rows", "64-rows", "encoder-ffn-128-rows",
         "one-row-tile"],
)
def test_matmul_groups_column_tiles_into_cached_panels(shape: tuple[int, ...], panels: bool,
                                                       target: tvm.target.Target) -> None:
    """A weight too big for a panel of L2 is walked in panels (one more split) once the rows make two register
    tiles or more, whatever the CPU (the 128-row encoder matmuls ran at 25-55% of an AVX-512 core's peak streamed,
    75-80% in panels); under one row tile (3 rows) it streams whole; the result against numpy in float64."""
    *lead, k, n = shape
    mod = relax_module([(*lead, k), (k, n), (n,)], lambda x, w, b: relax.op.nn.relu(relax.op.matmul(x, w) + b))
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]  # (not the kernel packing the weight)
    extra = _splits(CPUMatmul().apply(func, target, False)) - _splits(CPUMatmul(panel_bytes=1 << 40).apply(
        func, target, False))
    assert extra == int(panels)
    if target is not TARGET:
        return
    x, w, b = rand(*lead, k), rand(k, n, seed=1), rand(n, seed=2)
    xd, wd, bd = f64(x, w, b)
    check(run(mod, x, w, b), np.maximum(xd @ wd + bd, 0), EXACT)


@pytest.mark.parametrize("target", [AVX512, AVX2], ids=["avx512", "avx2"])
def test_a_dynamic_batch_over_128_rows_still_walks_panels(target: tvm.target.Target) -> None:
    """A symbolic batch dim counts as one row, so a BERT layer exported with a dynamic batch keeps the panels its
    128 tokens earn (before, any symbolic dim streamed the weight: the imported BERT-base layer's dense matmuls ran
    in 23 ms instead of 11.6, under load); numbers at batch 2 against numpy."""
    mod = relax_module([(tirx.Var("batch", "int64"), 128, 768), (768, 3072)], relax.op.matmul)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    extra = _splits(CPUMatmul().apply(func, target, False)) - _splits(CPUMatmul(panel_bytes=1 << 40).apply(
        func, target, False))
    assert extra == 1
    x, w = rand(2, 128, 768), rand(768, 3072, seed=1)
    check(run(mod, x, w), np.matmul(*f64(x, w)), EXACT)


@pytest.mark.parametrize("m", [768, 3072])
def test_panels_split_the_column_tiles_evenly(m: int) -> None:
    """24 column tiles under a 16-tile panel budget make two panels of 12, not 16 and 8 beside 8 empty tiles: the
    threads split the parallel loop in halves, and with the empty tiles one of two threads had half the work of the
    other (the weight gradients of a 768-wide encoder's K = 128 matmuls ran at 57% of two cores' peak, then 71%).
    No tile is predicated away; numbers against numpy."""
    mod = relax_module([(m, 128), (128, 768)], relax.op.matmul)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    rule = CPUMatmul().for_cpu(cpu_model(AVX512))
    budget = CPUMatmul(panel_bytes=16 * 128 * rule.tile_width(m) * 4).for_cpu(cpu_model(AVX512))
    split = budget.apply(func, AVX512, False)
    assert _splits(split) - _splits(CPUMatmul(panel_bytes=1 << 40).apply(func, AVX512, False)) == 1
    assert "T.where" not in split.mod["main"].script()
    x, w = rand(m, 128), rand(128, 768, seed=1)
    check(run(mod, x, w), np.matmul(*f64(x, w)), EXACT)


def test_batched_matmul_broadcasts_batch_dims() -> None:
    mod = relax_module([(2, 1, 5, 7), (3, 7, 9)], relax.op.matmul)
    a, b = rand(2, 1, 5, 7), rand(3, 7, 9, seed=1)
    check(run(mod, a, b), np.matmul(*f64(a, b)), EXACT)
    assert_matmul_rule_applies(mod)


@pytest.mark.parametrize(("a_shape", "b_shape"), [((4, 37, 64), (4, 64, 37)), ((3, 2, 19, 64), (3, 2, 64, 53))],
                         ids=["attention-scores-37", "4d-batch-53-wide"])
def test_batched_matmul_pads_ragged_columns_to_whole_vectors(a_shape: tuple[int, ...], b_shape: tuple[int, ...]
                                                             ) -> None:
    """Issue 13: "K = 64 attention matmuls" and "extents that are not multiples of the vector width or the tile"
    (the 6x8x197 attention matmul ran 12x onnxruntime): the columns are padded to whole vector tiles, so the
    vectorized update loop runs unguarded and only the store to the real output is masked; against numpy. With
    enough rows (64: `packs_operand`) the right operand is packed per batch into zero-padded panels instead of
    padded by the kernel (`matmul_layout.py`); with 2 x 19 rows it is padded in the kernel."""
    mod = relax_module([a_shape, b_shape], relax.op.matmul)
    a, b = rand(*a_shape), rand(*b_shape, seed=1)
    check(run(mod, a, b), np.matmul(*f64(a, b)), EXACT)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    text = CPUMatmul().apply(func, TARGET, False).mod["main"].script()
    head, update = re.split(r'T\.sblock\("matmul(?:_packed)?_update"\)', text, maxsplit=1)
    lane = re.findall(r"for (\w+) in T\.vectorized", head)[-1]
    guard = re.search(r"T\.where\((.*)\)", update.split("T.sblock(", 1)[0])
    assert ("_pad" in head or "matmul_packed" in head) and (guard is None or lane not in guard.group(1))


def test_dynamic_batch_one_compile_many_sizes() -> None:
    n = tirx.Var("n", "int64")
    mod = relax_module(
        [(n, 33), (33, 40), (40,)], lambda x, w, b: relax.op.nn.relu(relax.op.matmul(x, w) + b)
    )
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET))
    vm = relax.VirtualMachine(exe, tvm.cpu())
    w, b = rand(33, 40, seed=1), rand(40, seed=2)
    for batch in (1, 3, 64):
        x = rand(batch, 33, seed=batch)
        got = vm["main"](*[tvm.runtime.tensor(a) for a in (x, w, b)]).numpy()
        xd, wd, bd = f64(x, w, b)
        check(got, np.maximum(xd @ wd + bd, 0), EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=1)  # the zero-padded copy of the input rows


@pytest.mark.parametrize(("target", "mr", "nr"), [(AVX512, 8, 32), (AVX2, 4, 16)], ids=["avx512", "avx2"])
def test_dynamic_batch_pads_rows_to_a_register_tile(target: tvm.target.Target, mr: int, nr: int) -> None:
    """A symbolic row extent is padded to a multiple of mr: the input rows are copied into a zero-padded buffer,
    the inner loop reads it unguarded, only the epilogue keeps the tail predicate, and buffer compaction can
    shrink the accumulator to mr x nr instead of (n, nr); mr x nr is the target CPU's tile."""
    n = tirx.Var("n", "int64")
    mod = relax_module([(n, 64), (64, 96)], relax.op.matmul)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    sch = CPUMatmul().apply(func, target, False)
    assert sch is not None
    text = sch.mod["main"].script()
    assert text.count("T.where") == 1
    update = text[text.index('"matmul_update"'):].split("T.sblock(", 1)[0]
    assert "if_then_else" not in update and "_pad[" in update
    lowered = s_tir.transform.CompactBufferAllocation()(
        s_tir.transform.ConvertBlocksToOpaque()(
            s_tir.transform.PlanAndUpdateBufferAllocationLocation()(
                s_tir.transform.LowerInitBlock()(tvm.IRModule({"main": sch.mod["main"]}))
            )
        )
    )
    assert f"T.sblock_alloc_buffer((T.int64({mr}), T.int64({nr})), scope=\"local\")" in lowered["main"].script()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_kernels_keep_noalias_compute_bodies(dynamic: bool) -> None:
    """With a symbolic shape the VM adds a shape function to the module; the kernels must still be built
    as noalias `*_compute_` bodies (without them LLVM spills the register tiles: 2-2.5x slower)."""
    batch = tirx.Var("n", "int64") if dynamic else 4
    mod = relax_module([(batch, 8, 16, 16), (8, 8, 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, padding=1))
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET))
    llvm_ir = exe.mod.imports[0].inspect_source("ll")
    assert re.search(r"define internal fastcc i32 @conv2d\w*_compute_\(", llvm_ir)  # NCHW or blocked kernel
    assert "ptr noalias align 64 %p0" in llvm_ir


def test_dense_bias_relu() -> None:
    mod = relax_module(
        [(16, 48), (24, 48), (24,)], lambda x, w, b: relax.op.nn.relu(relax.op.linear(x, w, b))
    )
    x, w, b = rand(16, 48), rand(24, 48, seed=1), rand(24, seed=2)
    xd, wd, bd = f64(x, w, b)
    check(run(mod, x, w, b), np.maximum(xd @ wd.T + bd, 0), EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=int(_pads_columns(16, 24)))  # (the weight transpose: a kernel)


@pytest.mark.parametrize(("fast_math", "rtol"), [(False, EXACT), (True, FAST)], ids=["exact", "fast-math"])
def test_dense_bias_gelu(fast_math: bool, rtol: float) -> None:
    mod = relax_module(
        [(16, 64), (64, 96), (96,)], lambda x, w, b: relax.op.nn.gelu(relax.op.matmul(x, w) + b)
    )
    x, w, b = rand(16, 64), rand(64, 96, seed=1) * 0.2, rand(96, seed=2)
    xd, wd, bd = f64(x, w, b)
    check(run(mod, x, w, b, fast_math=fast_math), gelu(xd @ wd + bd), rtol)
    assert_matmul_rule_applies(mod, fast_math)


def test_matmul_feeding_residual_add() -> None:
    mod = relax_module([(8, 32), (32, 32), (8, 32)], lambda x, w, r: relax.op.matmul(x, w) + r)
    x, w, r = rand(8, 32), rand(32, 32, seed=1), rand(8, 32, seed=2)
    xd, wd, rd = f64(x, w, r)
    check(run(mod, x, w, r), xd @ wd + rd, EXACT)
    assert_matmul_rule_applies(mod)


def test_matmul_where_epilogue() -> None:
    zero = relax.const(0.0, "float32")
    mod = relax_module(
        [(8, 16), (16, 24), (8, 24)],
        lambda x, w, m: relax.op.where(relax.op.greater(m, zero), relax.op.matmul(x, w), zero),
    )
    x, w, m = rand(8, 16), rand(16, 24, seed=1), rand(8, 24, seed=2)
    xd, wd = f64(x, w)
    check(run(mod, x, w, m), np.where(m > 0, xd @ wd, 0.0), EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=int(_pads_columns(8, 24)))


def test_broadcasting_epilogue_stays_a_separate_loop() -> None:
    """An epilogue with more elements than the matmul result cannot be fused into its store."""
    mod = relax_module([(4, 8), (8, 16), (3, 4, 16)], lambda x, w, r: relax.op.matmul(x, w) + r)
    x, w, r = rand(4, 8), rand(8, 16, seed=1), rand(3, 4, 16, seed=2)
    xd, wd, rd = f64(x, w, r)
    check(run(mod, x, w, r), xd @ wd + rd, EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=1)


# --- conv2d -------------------------------------------------------------------------------------


def conv2d_nchw(x: np.ndarray, w: np.ndarray, pad: int) -> np.ndarray:
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    win = np.lib.stride_tricks.sliding_window_view(xp, w.shape[2:], axis=(2, 3))
    return np.einsum("nchwij,ocij->nohw", win, w)


@pytest.mark.parametrize(
    ("x_shape", "cout", "lines"),
    [((2, 16, 12, 12), 8, 4), ((1, 3, 9, 7), 5, 3), ((2, 8, 16, 16), 16, 4), ((1, 4, 32, 32), 8, 2),
     ((2, 8, 8, 8), 16, 4)],
    ids=["2x16x12x12->8", "odd-1x3x9x7->5", "16-wide-map", "32-wide-map", "8-wide-map"],
)
def test_conv2d_3x3_padded(x_shape: tuple[int, ...], cout: int, lines: int) -> None:
    """Conv register tiles hold `lines` output rows (an unrolled loop) besides the channel rows (on AVX-512, the
    ISA these counts were measured on; `test_conv_tiles_fit_the_accumulators` covers both)."""
    w_shape = (cout, x_shape[1], 3, 3)
    mod = relax_module([x_shape, w_shape], lambda x, w: relax.op.nn.conv2d(x, w, padding=1))
    x, w = rand(*x_shape), rand(*w_shape, seed=1)
    check(run(mod, x, w, block_convs=False), conv2d_nchw(*f64(x, w), pad=1), EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=1, block_convs=False)  # the NCHW width tile (see test_conv_layout)
    (func,) = [f for f in fused_prim_funcs(mod, block_convs=False) if _has_reduction(f)]
    unrolled = _conv_tile(func, AVX512)
    assert len(unrolled) == 2 + (lines > 1) and (lines == 1 or unrolled[-1] == lines)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "kw"),
    [((1, 3, 23, 19), (8, 3, 7, 7), dict(padding=3, strides=2)),
     ((2, 5, 15, 13), (6, 5, 3, 3), dict(padding=1, strides=2)),
     ((1, 4, 17, 11), (7, 4, 3, 3), dict(padding=2, dilation=2)),
     ((1, 3, 11, 10), (5, 3, 5, 5), dict(padding=2)),
     ((3, 6, 9, 13), (6, 1, 3, 3), dict(padding=1, groups=6))],
    ids=["7x7-stride2", "3x3-stride2", "dilated", "5x5", "depthwise"],
)
def test_strided_dilated_and_depthwise_convs_get_register_tiles(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                                kw: dict) -> None:
    """Issue 13 lists "1x1, 3x3, 5x5, 7x7, depthwise, strided and dilated convs" among the shapes the rules must cover
    (strided ones fell to the scalar reduction fallback: 5-9x slower); checked on odd extents against torch."""
    mod = relax_module([x_shape, w_shape], lambda x, w: relax.op.nn.conv2d(x, w, **kw))
    x, w = rand(*x_shape), rand(*w_shape, seed=1)
    torch_kw = {"stride": kw.get("strides", 1), "padding": kw["padding"], "dilation": kw.get("dilation", 1),
                "groups": kw.get("groups", 1)}
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), **torch_kw).numpy()
    check(run(mod, x, w, block_convs=False), want, EXACT)
    assert_matmul_rule_applies(mod, extra_blocks=1, block_convs=False)  # the NCHW width tile (see test_conv_layout)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "kw", "split"),
    [((2, 5, 20, 20), (7, 5, 3, 3), dict(padding=1, strides=2), True),
     ((1, 8, 28, 28), (16, 8, 1, 1), dict(padding=0, strides=2), True),
     ((1, 4, 17, 17), (6, 4, 3, 3), dict(padding=0, strides=2), False)],
    ids=["3x3-s2-pad1", "1x1-s2-unpadded", "odd-width-keeps-gathers"],
)
def test_strided_conv_reads_its_input_phase_by_phase(x_shape: tuple[int, ...], w_shape: tuple[int, ...], kw: dict,
                                                     split: bool) -> None:
    """Issue 13: the strided 3x3/2 conv "gathers" (1% of peak); its input is stored as `x[.., w % s, w // s]` so
    the register tile reads it with stride 1: the kernel's input buffer gains a phase dimension of extent s, and
    the result still matches torch (outputs 10, 14 and 8 wide)."""
    mod = relax_module([x_shape, w_shape], lambda x, w: relax.op.nn.conv2d(x, w, **kw))
    x, w = rand(*x_shape), rand(*w_shape, seed=1)
    torch_kw = {"stride": kw["strides"], "padding": kw["padding"], "dilation": kw.get("dilation", 1),
                "groups": kw.get("groups", 1)}
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), **torch_kw).numpy()
    check(run(mod, x, w), want, EXACT)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    scheduled = CPUMatmul().apply(func, TARGET, False)
    update = scheduled.get(scheduled.get_sblock(f"{_reduction_name(func)}_update"))
    widths = [len(r.source.shape) for r in update.reads]
    assert (5 in widths) == split and all(n <= 5 for n in widths)


@pytest.mark.parametrize(("x_shape", "stride"), [((1, 12, 29, 29), 1), ((2, 10, 26, 26), 2)],
                         ids=["grouped-s1-odd", "grouped-s2"])
def test_conv_padding_is_partitioned_not_guarded_per_lane(x_shape: tuple[int, ...], stride: int) -> None:
    """A conv's zero padding, vectorized with the guard in every lane, cost as much as a depthwise conv did (those
    now pad per channel: test_plane_window.py). The padding loop is left to TVM's loop partitioning (border
    zeros, a branch-free interior); grouped convs of two channels a group match torch on widths no multiple of 8."""
    channels = x_shape[1]
    mod = relax_module([x_shape, (channels, 2, 3, 3)],
                       lambda x, w: relax.op.nn.conv2d(x, w, strides=stride, padding=1, groups=channels // 2))
    x, w = rand(*x_shape), rand(channels, 2, 3, 3, seed=1)
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), stride=stride,
                                      padding=1, groups=channels // 2).numpy()
    check(run(mod, x, w), want, EXACT)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]
    pad = CPUMatmul().apply(func, TARGET, False).mod["main"].script().split('T.sblock("pad_temp")')[0]
    assert "pragma_loop_partition_hint" in pad and "T.vectorized" not in pad.rsplit("T.parallel", 1)[1]


def _reduction_name(func: tirx.PrimFunc) -> str:
    sch = s_tir.Schedule(func)
    return next(sch.get(info.block_rv).name_hint for info in dl.normalize_prim_func(sch) if info.is_reduction())


def _conv_tile(func: tirx.PrimFunc, target: tvm.target.Target) -> list[int]:
    """The unrolled loops inside a conv's reduction: kernel width, channel rows and, if any, output lines."""
    text = CPUMatmul().apply(func, target, False).mod["main"].script()
    tile = text[:text.index('"conv2d_nchw_update"')].rsplit("T.grid", 1)[1]
    return unrolled_extents(tile)


@pytest.mark.parametrize(("target", "lanes", "accumulators"), [(AVX512, 16, 16), (AVX2, 8, 8)],
                         ids=["avx512", "avx2"])
@pytest.mark.parametrize("x_shape", [(2, 16, 12, 12), (2, 8, 16, 16), (1, 4, 32, 32), (2, 8, 8, 8)],
                         ids=["12-wide", "16-wide", "32-wide", "8-wide"])
def test_conv_tiles_fit_the_accumulators(target: tvm.target.Target, lanes: int, accumulators: int,
                                         x_shape: tuple[int, ...]) -> None:
    """Issue 13: register tiles from "register count from the target's ISA": channel rows x output lines x
    vectors of the column tile (the map's width, at most two vectors) stay within half the vector registers (16
    of AVX-512's 32, 8 of AVX2's 16)."""
    mod = relax_module([x_shape, (16, x_shape[1], 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, padding=1))
    (func,) = [f for f in fused_prim_funcs(mod, block_convs=False) if _has_reduction(f)]  # the NCHW width tile
    _kw, rows, *lines = _conv_tile(func, target)
    columns = CPUMatmul().for_cpu(cpu_model(target)).vector_tile(tirx.IntImm("int64", x_shape[3]))
    assert columns <= min(x_shape[3], 2 * lanes)
    vectors = -(-columns // lanes)
    assert rows * (lines[0] if lines else 1) * vectors <= accumulators


# --- injective and reductions -------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(512, 512), (17, 33)], ids=["512x512", "odd-17x33"])
def test_transpose(shape: tuple[int, int]) -> None:
    mod = relax_module([shape], relax.op.permute_dims)
    x = rand(*shape)
    np.testing.assert_array_equal(run(mod, x), x.T)
    (func,) = fused_prim_funcs(mod)
    sch = CPUInjective().apply(func, TARGET, False)
    assert sch is not None and "T.vectorized" in sch.mod["main"].script()


@pytest.mark.parametrize("target", [TARGET, AVX512], ids=["host", "avx512"])
def test_transpose_tile_gathers_one_vector_from_few_source_rows(target: tvm.target.Target) -> None:
    """A tile of 8 cache lines of the source's contiguous axis by one vector: the vector gathers from `lanes` source
    rows (16 x 16 tiles gathered from 16, more lines than an L1 set holds when rows are 4 KiB apart)."""
    mod = relax_module([(64, 256)], relax.op.permute_dims)
    (func,) = fused_prim_funcs(mod)
    lines = CPUInjective().apply(func, target, False).mod["main"].script().splitlines()
    loops = [line.strip() for line in lines if line.lstrip().startswith("for ")]
    lanes, rows = cpu_model(target).lanes(), 8 * cpu_model(target).caches.line // 4
    assert loops[-2].endswith(f"in range(T.int64({rows})):") and f"T.vectorized(T.int64({lanes}))" in loops[-1]


def softmax_ref(x: np.ndarray) -> np.ndarray:
    (xd,) = f64(x)
    e = np.exp(xd - xd.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def assert_row_rule(funcs: list[tirx.PrimFunc], partial: bool, target: tvm.target.Target = AVX512) -> None:
    """CPURowReduction schedules every kernel: rows in parallel and, when `partial`, vector partial results (of the
    target's lanes: the cases below were written for AVX-512's 16)."""
    for func in funcs:
        sch = CPURowReduction().apply(func, target, False)
        assert sch is not None
        lines = sch.mod["main"].script().splitlines()
        updates = [i for i, line in enumerate(lines) if '_rf_update")' in line]
        assert any("T.parallel" in line for line in lines) and bool(updates) == partial
        for i in updates:  # the loop right around each partial update runs over vector lanes
            assert "T.vectorized" in next(line for line in reversed(lines[:i]) if line.lstrip().startswith("for "))


def test_transpose_after_a_reshape_is_tiled() -> None:
    """Splitting heads reads `x[b, s, h * 64 + d]`: the last index walks `d` with stride 1 inside an expression,
    and the kernel still gets its transpose tile (a loop over the 32 rows around one vector of the target's lanes),
    not a strided gather."""
    mod = relax_module([(2, 32, 128)], lambda x: relax.op.permute_dims(relax.op.reshape(x, (2, 32, 4, 32)),
                                                                          [0, 2, 3, 1]))
    x = rand(2, 32, 128)
    np.testing.assert_array_equal(run(mod, x), x.reshape(2, 32, 4, 32).transpose(0, 2, 3, 1))
    (func,) = fused_prim_funcs(mod)
    lines = CPUInjective().apply(func, TARGET, False).mod["main"].script().splitlines()
    loops = [line.strip() for line in lines if line.lstrip().startswith("for ")]
    lanes = cpu_model(TARGET).lanes()
    assert loops[-2].endswith("in range(T.int64(32)):") and f"T.vectorized(T.int64({lanes}))" in loops[-1]


@pytest.mark.parametrize(("shape", "heads", "tasks"), [((8, 197, 768), 12, 96), ((1, 197, 256), 8, 1576),
                                                     ((300, 8, 64), 2, 300)], ids=["b8-h12", "b1-h8", "b300"])
def test_a_head_split_runs_its_outer_loops_in_parallel_and_the_rest_in_each_task(
        shape: tuple[int, int, int], heads: int, tasks: int) -> None:
    """`[b, s, h x d] -> [b, h, s, d]` runs in parallel over as few outer loops as make `PARALLEL_TASKS` tasks
    (batch x heads, 96; or down to the tokens where one image has too few, 8 x 197), each task walking the loops
    inside it serially, so its indices are divided out once a task, not once a vector (1.9-2.1x faster at 8 x 197
    x 12 x 64); the oracle is numpy's transpose."""
    b, s, width = shape
    d = width // heads
    mod = relax_module([shape], lambda x: relax.op.permute_dims(relax.op.reshape(x, (b, s, heads, d)), [0, 2, 1, 3]))
    x = rand(*shape)
    np.testing.assert_array_equal(run(mod, x), x.reshape(b, s, heads, d).transpose(0, 2, 1, 3))
    (func,) = fused_prim_funcs(mod)
    loops = _loops(CPUInjective().apply(func, TARGET, False))
    assert tasks >= PARALLEL_TASKS and f"T.parallel(T.int64({tasks}))" in loops[0], loops
    assert "T.vectorized" in loops[-1] and len(loops) > 2, loops


def _loops(sch: s_tir.Schedule) -> list[str]:
    return [line.strip() for line in sch.mod["main"].script().splitlines() if line.lstrip().startswith("for ")]


@pytest.mark.parametrize("target", [TARGET, AVX512, AVX2], ids=["host", "avx512", "avx2"])
def test_blocked_layout_exit_is_tiled_as_a_transpose(target: tvm.target.Target) -> None:
    """NCHW[16]c -> NCHW (`conv_layout.from_blocked`) reads `xb[b, c // 16, h, w, c % 16]`: the lane index walks
    `c`, so the kernel gets the transpose tile (a loop over the channels around one vector of pixels), not a gather
    of one float a cache line (1x1 conv 64x56²'s exit: 39 -> 22 us on an AVX-512 core, bench/RESULTS.md); rows
    shorter than a vector (7 pixels) keep the elementwise schedule, which was faster there."""
    short = te.placeholder((1, 4, 6, 7, 16), name="xb")
    loops = _loops(CPUInjective().apply(te.create_prim_func([short, from_blocked(short, 64)]), target, False))
    assert not loops[-2].endswith("in range(64):"), loops
    xb = te.placeholder((1, 4, 6, 20, 16), name="xb")
    sch = CPUInjective().apply(te.create_prim_func([xb, from_blocked(xb, 64)]), target, False)
    loops = _loops(sch)
    assert loops[-2].endswith("in range(64):") and "T.vectorized" in loops[-1], loops
    if target is TARGET:
        x = rand(1, 4, 6, 20, 16)
        got = tvm.runtime.empty((1, 64, 6, 20), "float32")
        cpu_compile(sch.mod, target)["main"](tvm.runtime.tensor(x), got)
        np.testing.assert_array_equal(got.numpy(), x.transpose(0, 1, 4, 2, 3).reshape(1, 64, 6, 20))


@pytest.mark.parametrize(("fast_math", "rtol"), [(False, EXACT), (True, FAST)], ids=["exact", "fast-math"])
@pytest.mark.parametrize(("rows", "width", "partial"), [
    (6, 128, True), (6, 100, True), (6, 77, False), (3, 16, False), (5, 197, False), (4, 17, False)],
    ids=["lanes-multiple", "four-lanes-multiple", "odd-width", "one-vector", "prime-width", "one-vector-and-one"])
def test_softmax(fast_math: bool, rtol: float, rows: int, width: int, partial: bool) -> None:
    """Softmax rows against float64 numpy: exact, the row rule's kernel, with vector partial results where a width of
    4 or more divides the row; under fast math kiln's own kernel (`softmax_rows.py`)."""
    mod = relax_module([(rows, width)], lambda x: relax.op.nn.softmax(x, axis=-1))
    x = rand(rows, width) * 4
    check(run(mod, x, fast_math=fast_math), softmax_ref(x), rtol)
    funcs = fused_prim_funcs(mod, fast_math)
    if fast_math:
        assert [f.attrs["tirx.is_scheduled"] for f in funcs] == [True]
    else:
        assert_row_rule(funcs, partial)


def test_a_row_no_vector_divides_is_computed_in_whole_vectors_and_a_peeled_tail() -> None:
    """Softmax over rows of 197 (a prime: no divisor of 4 to 16 lanes): its exp and its division run in 16-lane
    vectors whose guarded last one TVM's loop partitioning peels off (they had run one element at a time)."""
    for func in fused_prim_funcs(relax_module([(5, 197)], lambda x: relax.op.nn.softmax(x, axis=-1))):
        text = CPURowReduction().apply(func, AVX512, False).mod["main"].script()
        hinted = [line for line in text.splitlines() if "pragma_loop_partition_hint" in line]
        assert len(hinted) == 2 and "T.vectorized(T.int64(16))" in text, text


@pytest.mark.parametrize(("scale", "divide", "kernels"), [(0.125, False, 1), (-0.5, False, 2), (0.125, True, 1)],
                         ids=["positive", "negative", "divided"])
def test_fast_softmax_takes_in_a_positive_score_scale(scale: float, divide: bool, kernels: int) -> None:
    """softmax(x * s) for a positive scalar s (attention's 1/sqrt(d_head)), or softmax(x / (1 / s)) (an imported
    BERT's), is one kernel that scales inside the exp, not a multiply kernel writing the scores back first (FuseOps
    leaves an elementwise producer of a row reduction on its own); a negative s (max(s x) is not s max(x)) keeps
    the multiply. Values against float64."""
    def body(x: relax.Expr) -> relax.Expr:
        scaled = relax.op.divide(x, relax.const(1 / scale, "float32")) if divide else \
            relax.op.multiply(x, relax.const(scale, "float32"))
        return relax.op.nn.softmax(scaled, axis=-1)

    mod = relax_module([(12, 128)], body)
    assert len(fused_prim_funcs(mod, True)) == kernels
    x = rand(12, 128) * 4
    check(run(mod, x, fast_math=True), softmax_ref(x * scale), FAST)


def test_row_lanes_follow_the_target() -> None:
    """A 16-wide row is one AVX-512 vector (kept whole) but two AVX2 vectors (split into 8 partial sums)."""
    mod = relax_module([(3, 16)], lambda x: relax.op.nn.softmax(x, axis=-1))
    assert_row_rule(fused_prim_funcs(mod), partial=False, target=AVX512)
    assert_row_rule(fused_prim_funcs(mod), partial=True, target=AVX2)
    text = CPURowReduction().apply(fused_prim_funcs(mod)[0], AVX2, False).mod["main"].script()
    assert "T.vectorized(T.int64(8))" in text and "T.vectorized(T.int64(16))" not in text


@pytest.mark.parametrize(("target", "lanes"), [(AVX512, 16), (AVX2, 8)], ids=["avx512", "avx2"])
def test_row_partials_fold_in_independent_chains(target: tvm.target.Target, lanes: int) -> None:
    """Each row's `lanes` partial results fold into 4 independent partial results of their own before the last
    sum (16 lanes: 4 + 4 dependent steps, not 16), every partial update vectorized; softmax values against float64
    numpy (layer norms are `norm_rows.py`'s, tests/runtime/test_norm_rows.py)."""
    mod = relax_module([(5, 256)], lambda x: relax.op.nn.softmax(x, axis=-1))
    (func,) = fused_prim_funcs(mod)
    text = CPURowReduction().apply(func, target, False).mod["main"].script()
    assert f"T.vectorized(T.int64({lanes}))" in text and "T.vectorized(T.int64(4))" in text
    assert_row_rule([func], True, target)
    x = rand(5, 256) * 4
    check(run(mod, x), softmax_ref(x), EXACT)


def test_row_mean_has_no_lanes_after_its_rows() -> None:
    mod = relax_module([(6, 128)], lambda x: relax.op.mean(x, axis=[-1]))
    assert_row_rule(fused_prim_funcs(mod), partial=True)
    x = rand(6, 128)
    check(run(mod, x), x.astype(np.float64).mean(-1), EXACT)


def test_softmax_over_a_middle_axis_keeps_whole_reductions() -> None:
    """Reducing a non-innermost axis has no contiguous lanes to split (they would be a gather)."""
    mod = relax_module([(4, 32, 16)], lambda x: relax.op.nn.softmax(x, axis=1))
    assert_row_rule(fused_prim_funcs(mod), partial=False)
    x = rand(4, 32, 16)
    check(run(mod, x), softmax_ref(x.transpose(0, 2, 1)).transpose(0, 2, 1), EXACT)


def test_column_sum_takes_the_reduction_fallback() -> None:
    mod = relax_module([(40, 24)], lambda x: relax.op.sum(x, axis=[0]))
    (func,) = fused_prim_funcs(mod)
    assert dl.cpu.Reduction().apply(func, TARGET, False) is None
    assert CPUReductionFallback().apply(func, TARGET, False) is not None
    x = rand(40, 24)
    check(run(mod, x), x.astype(np.float64).sum(0), EXACT)


def assert_window_rule(mod: tvm.IRModule) -> None:
    """CPUWindowReduction takes the pool: outputs in parallel and vectorized, window loops unrolled around them."""
    (func,) = [f for f in fused_prim_funcs(mod) if not _injective(f)]
    sch = CPUWindowReduction().apply(func, TARGET, False)
    assert sch is not None
    lines = sch.mod["main"].script().splitlines()
    update = next(i for i, line in enumerate(lines) if '_update")' in line)
    loops = [line.strip() for line in lines[:update] if line.lstrip().startswith("for ")]
    assert "T.vectorized" in loops[-1] and "T.unroll" in loops[-2] and "T.parallel" in loops[0]


def _injective(func: tirx.PrimFunc) -> bool:
    return all(info.is_injective() for info in dl.normalize_prim_func(s_tir.Schedule(func)))


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "pad"),
    [((8, 32, 32, 32), 2, 2, 0), ((2, 3, 15, 15), 3, 2, 1), ((1, 4, 9, 7), 3, 1, 1)],
    ids=["2x2-stride2", "odd-3x3-stride2-pad1", "3x3-stride1-pad1-batch1"],
)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling(kind: str, shape: tuple[int, ...], kernel: int, stride: int, pad: int) -> None:
    pool = {"max": relax.op.nn.max_pool2d, "avg": relax.op.nn.avg_pool2d}[kind]
    extra = {"count_include_pad": True} if kind == "avg" else {}
    mod = relax_module([shape], lambda x: pool(x, kernel, stride, pad, **extra))
    x = rand(*shape)
    reference = {"max": torch.nn.functional.max_pool2d, "avg": torch.nn.functional.avg_pool2d}[kind]
    want = reference(torch.from_numpy(x).double(), kernel, stride, pad).numpy()
    check(run(mod, x), want, EXACT)
    assert [f for f in fused_prim_funcs(mod) if f.attrs.get("tirx.is_scheduled")]  # the row kernel (pool_rows.py)


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pooling_a_blocked_map_vectorizes_its_channel_lanes(kind: str) -> None:
    """Issue 13: "max/avg pooling ... that read and write the blocked layout inside a region": on NCHW8c the window
    slides along the width, the index before the lanes; the rule takes it, one vector over the 8 channel lanes."""
    mod = relax_module([(2, 3, 15, 15, 8)], lambda x: getattr(relax.op.nn, f"{kind}_pool2d")(
        x, 3, 2, 1, layout="NCHW8c"))
    assert_window_rule(mod)
    x = rand(2, 3, 15, 15, 8)
    nchw = torch.from_numpy(x).double().permute(0, 1, 4, 2, 3).reshape(2, 24, 15, 15)
    want = getattr(torch.nn.functional, f"{kind}_pool2d")(nchw, 3, 2, 1, **({"count_include_pad": False}
                                                                            if kind == "avg" else {}))
    check(run(mod, x), want.reshape(2, 3, 8, 8, 8).permute(0, 1, 3, 4, 2).numpy(), EXACT)


def test_pooling_over_a_dynamic_batch() -> None:
    """A pool in `ceil_mode` (the NCHW pools `pool_rows` leaves) over a symbolic batch: the window rule's."""
    n = tirx.Var("n", "int64")
    mod = relax_module([(n, 16, 9, 9)], lambda x: relax.op.nn.max_pool2d(x, 2, 2, ceil_mode=True))
    assert_window_rule(mod)
    for batch in (1, 3):
        x = rand(batch, 16, 9, 9)
        check(run(mod, x), torch.nn.functional.max_pool2d(torch.from_numpy(x), 2, ceil_mode=True).numpy(), EXACT)


# --- rule applicability and the Safe wrapper ----------------------------------------------------


def _only_func(shapes: list[tuple], body: Body) -> tirx.PrimFunc:
    (func,) = fused_prim_funcs(relax_module(shapes, body))
    return func


def _nt_matmul(m: int, n: int, k: int) -> tirx.PrimFunc:
    """C[i, j] = sum_k A[i, k] * B[j, k]: no operand is contiguous along C's last axis."""
    a, b = te.placeholder((m, k), name="A"), te.placeholder((n, k), name="B")
    r = te.reduce_axis((0, k), name="k")
    c = te.compute((m, n), lambda i, j: te.sum(a[i, r] * b[j, r], axis=r), name="C")
    return te.create_prim_func([a, b, c])


def test_each_rule_declines_what_it_does_not_handle() -> None:
    elementwise = _only_func([(8, 16)], lambda x: relax.op.exp(x) + x)
    matmul = _only_func([(8, 16), (16, 4)], relax.op.matmul)
    row_sum = _only_func([(8, 16)], lambda x: relax.op.sum(x, axis=[1]))
    softmax = _only_func([(8, 16)], relax.op.nn.softmax)
    nt_matmul = _nt_matmul(8, 4, 16)

    assert all(
        CPUMatmul().apply(f, TARGET, False) is None for f in (elementwise, row_sum, softmax, nt_matmul)
    )
    assert all(CPUInjective().apply(f, TARGET, False) is None for f in (matmul, row_sum, softmax))
    assert CPUReductionFallback().apply(elementwise, TARGET, False) is None
    assert all(CPURowReduction().apply(f, TARGET, False) is None for f in (elementwise, matmul, row_sum))
    assert all(CPUWindowReduction().apply(f, TARGET, False) is None for f in (elementwise, matmul, row_sum, softmax))
    gpu = cuda_target("sm_80")
    for rule in (CPUMatmul(), CPUInjective(), CPUReductionFallback(), CPURowReduction(), CPUWindowReduction()):
        picked = {CPUMatmul: matmul, CPURowReduction: softmax}.get(type(rule), elementwise)
        assert rule.apply(picked, gpu, False) is None
    assert CPUReductionFallback().apply(row_sum, TARGET, False) is not None


class _Broken(dl.ScheduleRule):
    def apply(self, func: tirx.PrimFunc, target: tvm.target.Target, tunable: bool) -> s_tir.Schedule:
        raise RuntimeError("rule bug")


def test_safe_turns_a_failure_into_not_applicable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEBUG_ENV)
    func = _only_func([(8, 16)], lambda x: relax.op.exp(x) + x)
    assert Safe(_Broken()).apply(func, TARGET, False) is None
    mod = tvm.IRModule({"f": func})
    with TARGET:
        scheduled = dl.ApplyDefaultSchedule(Safe(_Broken()), Safe(CPUInjective()))(mod)
    assert scheduled["f"].attrs["tirx.is_scheduled"] and "T.vectorized" in scheduled["f"].script()


def test_safe_reraises_in_debug_mode() -> None:
    func = _only_func([(8, 16)], lambda x: relax.op.exp(x) + x)
    with pytest.raises(RuntimeError, match="rule bug"):
        Safe(_Broken()).apply(func, TARGET, False)


def test_default_rules_order() -> None:
    kinds = [type(rule.rule) for rule in default_cpu_rules()]
    assert kinds == [CPUPlaneWindow, CPUMatmul, CPUWindowReduction, CPUColumnReduction, CPURowReduction,
                     dl.cpu.Reduction, CPUInjective, CPUReductionFallback]


# --- targets, threads and the CUDA pipeline -----------------------------------------------------


def test_targets_are_dict_form_and_threads_use_every_core() -> None:
    assert TARGET.kind.name == "llvm" and int(TARGET.attrs["num-cores"]) == cpu_count()
    assert cuda_target("sm_90").attrs["arch"] == "sm_90" and cuda_target().host.kind.name == "llvm"
    assert configure_threads() == configure_threads() == tvm.runtime.num_threads()


def test_thread_pool_blocks_idle_workers_unless_the_user_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM's workers spin 300,000 polls before blocking, which stalled a loaded host's calls 10-100x, while blocking
    at once made quiet batch-1 calls 45% slower: kiln's default is `TVM_THREAD_POOL_SPIN_COUNT=10000`; a value the
    user set is kept."""
    monkeypatch.setenv(target_mod.SPIN_ENV, "")
    monkeypatch.delenv(target_mod.SPIN_ENV)
    monkeypatch.setattr(target_mod, "_threads", None)
    configure_threads()
    assert os.environ[target_mod.SPIN_ENV] == target_mod.SPIN_DEFAULT == "10000"
    monkeypatch.setenv(target_mod.SPIN_ENV, "1000")
    monkeypatch.setattr(target_mod, "_threads", None)
    configure_threads()
    assert os.environ[target_mod.SPIN_ENV] == "1000"


@pytest.mark.skipif(tvm.cuda(0).exist, reason="covers hosts without a GPU, where no device binary is built")
def test_cuda_pipeline_generates_cuda_source_without_a_gpu() -> None:
    n = tirx.Var("n", "int64")
    mod = relax_module(
        [(n, 32), (32, 64)], lambda x, w: relax.op.nn.softmax(relax.op.nn.relu(relax.op.matmul(x, w)))
    )
    target = cuda_target("sm_90")
    exe = tvm.compile(mod, target=target, relax_pipeline=cuda_pipeline(target))
    (host,) = exe.mod.imports
    (device,) = host.imports
    assert device.kind == "cuda" and "__global__" in device.inspect_source()


@pytest.mark.parametrize(("shape", "axes"), [((8, 128, 256), [0, 1]), ((300, 100), [0]), ((5, 3), [0]),
                                             ((4, 6, 32), [0])], ids=["bias-grad", "odd-width", "tiny", "two-spatial"])
def test_column_sums_run_down_vectors_of_columns(shape: tuple[int, ...], axes: list[int]) -> None:
    """Issue 14 (the training step's non-matmul kernels): a sum over the leading axes (bias and norm-scale
    gradients) is CPUColumnReduction's: the reduction loops outside one vector loop over adjacent columns, the
    column blocks in parallel; the oracle is numpy's f64 sum."""
    mod = relax_module([shape], lambda x: relax.op.sum(x, axis=axes))
    x = rand(*shape)
    check(run(mod, x), f64(x)[0].sum(tuple(axes)), EXACT)
    (func,) = fused_prim_funcs(mod)
    lines = CPUColumnReduction().apply(func, TARGET, False).mod["main"].script().splitlines()
    update = next(i for i, line in enumerate(lines) if '_update")' in line)
    loops = [line.strip() for line in lines[:update] if line.lstrip().startswith("for ")]
    assert ("T.parallel" in loops[0]) is (x.size >= 4096) and "T.vectorized" in loops[-1], loops  # tiny: no pool
    assert "range(" in loops[-2] or "T.grid(" in loops[-2], loops  # the reduction, outside the vector


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-batch"])
@pytest.mark.parametrize("shape", [(1, 8, 28, 28, 16), (1, 5, 28, 28, 16), (2, 3, 7, 7, 16), (1, 42, 7, 7, 16)],
                         ids=["8-blocks", "5-blocks", "batch-2", "42-blocks-7x7"])
def test_a_pool_over_a_blocked_maps_rows_and_columns_runs_down_its_lanes(shape: tuple[int, ...], dynamic: bool
                                                                         ) -> None:
    """Issue 13 (MobileNetV3's squeeze-excite pools): a mean over H and W of an NCHW[16]c map is a column reduction
    with an epilogue (the division), taken by CPUColumnReduction ahead of the row rule, which summed it lane by lane
    with scalar loads 64 bytes apart (1x8x28x28x16: 25 -> 3.8 us, 2 threads, Emerald Rapids VM). Each task sums
    whole lane vectors of a few channel blocks, one per core at least, and divides its own sums: tasks whose sums
    were not a rectangle of blocks x lanes divided sums another task had not finished (5 blocks gave wrong means).
    A symbolic batch sizes the tasks within one image. The oracle is numpy's f64 mean."""
    batch = tirx.Var("n", "int64") if dynamic else shape[0]
    mod = relax_module([(batch, *shape[1:])], lambda x: relax.op.mean(x, axis=[2, 3], keepdims=True))
    x = rand(*shape)
    check(run(mod, x), f64(x)[0].mean((2, 3), keepdims=True), EXACT)
    (func,) = fused_prim_funcs(mod)
    rule = next(r.rule for r in default_cpu_rules(TARGET) if r.rule.apply(func, TARGET, False) is not None)
    assert isinstance(rule, CPUColumnReduction)
    text = rule.apply(func, TARGET, False).mod["main"].script()
    lanes = int(re.search(r"T\.vectorized\((?:T\.int64\()?(\d+)", text).group(1))
    tasks = re.search(r"T\.parallel\((?:T\.int64\()?(n \* T\.int64\()?(\d+)", text)
    assert lanes == shape[-1] and tasks is not None, text
    assert dynamic is bool(tasks.group(1)) and (dynamic or int(tasks.group(2)) >= cpu_model(TARGET).cores), text


def test_row_reductions_are_not_column_reductions() -> None:
    """A sum over the contiguous last axis stays with the row rules."""
    (func,) = fused_prim_funcs(relax_module([(6, 128)], lambda x: relax.op.sum(x, axis=[1])))
    assert CPUColumnReduction().apply(func, TARGET, False) is None


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
def test_a_column_tile_is_one_vector_at_most_or_whole_vectors(target: tvm.target.Target) -> None:
    """Issue 13 (widths not multiples of the vector): a register tile's columns fill one vector at most or a whole
    number of them, and divide the extent where one of at least 8 does (else the tile's width, with a tail). A 28-lane
    tile on a 16-lane CPU became shuffles and spills: the NCHW 3x3 conv of 40 channels on a 28-wide map ran in
    1.08 ms, in tiles of 14 columns 0.16 (one AVX-512 core, this session's scratch timing)."""
    rule = CPUMatmul().for_cpu(cpu_model(target))
    for width in range(1, 300):
        tile = rule.vector_tile(tirx.IntImm("int64", width))
        assert tile <= rule.lanes or tile % rule.lanes == 0, (width, tile)
        assert width % tile == 0 or tile == rule.nr, (width, tile)


@pytest.mark.parametrize("width", [20, 24, 28])
def test_nchw_convs_over_widths_no_vector_divides_match_torch(width: int) -> None:
    """The NCHW conv (blocking off) over 20-, 24- and 28-wide maps, tiled in single vectors, against torch."""
    rng = np.random.default_rng(width)
    x, w = rng.standard_normal((1, 12, width, width)).astype(np.float32), rng.standard_normal((8, 12, 3, 3))
    mod = relax_module([x.shape], lambda v: relax.op.nn.conv2d(v, relax.const(w.astype(np.float32)), padding=1))
    exe = cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False, block_convs=False))
    got = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    want = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w), padding=1).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_blocked_depthwise_conv_sums_a_row_of_outputs_in_registers() -> None:
    """Issue 13 (depthwise convs): a blocked depthwise conv's register tile holds as many outputs of a row as the
    accumulators allow (a divisor of the 28 columns), each window tap's weight loaded once for all of them, and
    the bias and relu fused into the tile's store; one output at a time was a chain of dependent FMAs (the 5x5 on
    128x28² ran 0.120 -> 0.054 ms on one AVX-512 core). Numbers against torch."""
    rng = np.random.default_rng(3)
    w1, dw, bias = rng.standard_normal((32, 32, 1, 1)), rng.standard_normal((32, 1, 5, 5)), rng.standard_normal(32)
    c = relax.const

    def body(x: relax.Expr) -> relax.Expr:
        y = relax.op.nn.conv2d(x, c(w1.astype(np.float32)))
        y = relax.op.nn.conv2d(y, c(dw.astype(np.float32)), padding=2, groups=32)
        return relax.op.nn.relu(relax.op.add(y, c(bias.reshape(32, 1, 1).astype(np.float32))))

    mod = relax_module([(1, 32, 28, 28)], body)
    (func,) = [f for f in fused_prim_funcs(mod) if "depthwise" in f.script()]
    text = CPUWindowReduction().apply(func, TARGET, False).mod["main"].script()
    rows = max(d for d in range(1, cpu_model(TARGET).accumulators + 1) if 28 % d == 0)
    assert '"local")' in text and f"T.unroll(T.int64({rows}))" in text, text
    assert text.count("T.parallel") == 1, text  # the epilogue is no loop nest of its own
    x = rand(1, 32, 28, 28)
    t = torch.from_numpy(x).double()
    y = torch.nn.functional.conv2d(torch.nn.functional.conv2d(t, torch.from_numpy(w1)), torch.from_numpy(dw),
                                   padding=2, groups=32)
    check(run(mod, x), torch.relu(y + torch.from_numpy(bias).reshape(32, 1, 1)).numpy(), EXACT)


def test_a_gate_read_by_a_broadcast_is_computed_once_per_channel() -> None:
    """A squeeze-excite's `sigmoid(conv + bias)` fused with its product with the whole map stays a value of the
    gate's shape, computed in the conv's store, not again for every pixel of the map (one exp per pixel made the
    zoo's EfficientNet 0.55 ms at batch 8 against 0.47 with the gate computed once); numbers against torch."""
    rng = np.random.default_rng(4)
    w, bias = rng.standard_normal((32, 32, 1, 1)).astype(np.float32) / 4, rng.standard_normal((32, 1, 1))

    def body(x: relax.Expr, s: relax.Expr) -> relax.Expr:
        gate = relax.op.sigmoid(relax.op.add(relax.op.nn.conv2d(s, relax.const(w)), relax.const(bias.astype(
            np.float32))))
        return relax.op.multiply(x, gate)

    mod = relax_module([(2, 32, 14, 14), (2, 32, 1, 1)], body)
    (func,) = [f for f in fused_prim_funcs(mod) if _has_reduction(f)]  # blocked: a 1x1 map is one register tile
    text = CPUMatmul().apply(func, TARGET, False).mod["main"].script()
    product = text[text.rindex("T.sblock("):]  # the last block: the map times the gate
    assert "sigmoid" not in product and "exp" not in product, product
    x, s = rand(2, 32, 14, 14), rand(2, 32, 1, 1, seed=1)
    gate = torch.sigmoid(torch.nn.functional.conv2d(torch.from_numpy(s).double(), torch.from_numpy(w).double())
                         + torch.from_numpy(bias))
    check(run(mod, x, s), (torch.from_numpy(x).double() * gate).numpy(), EXACT)
