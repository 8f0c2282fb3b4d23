"""Matmul weights pre-packed into the panel order the kernel reads (issue 13: "matmul weights pre-packed into the
panel order the kernel reads"; the classic AVX2 kernels' 6x16 tile over a `[N / nr][K][nr]` weight): which weights
pack, the packed layout, the register tile the CPU model derives for it, and numbers against numpy, bound and as
inputs, for odd shapes, batch 1 and 7."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tvm
from cross_targets import AVX2, AVX512
from step_oracle import assert_steps_match_interpreter
from tile_text import column_widths
from tvm import relax, te, tirx

from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.matmul_layout import (
    PACKED_NAME,
    flip_pays,
    pack_matmul_weights,
    pack_te,
    pack_weight,
    packed_matmul,
    packs_operand,
    panel_width,
)
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.relax_rewrite import static_shape
from kiln.runtime.tvm.schedules import CPUMatmul
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()

pytestmark = pytest.mark.usefixtures("module_cache")  # builds go to a scratch cache, never ~/.cache/kiln


def _rule(target: tvm.target.Target) -> CPUMatmul:
    return CPUMatmul().for_cpu(cpu_model(target))


@pytest.mark.parametrize(("target", "rows", "n", "width"), [
    (AVX2, 256, 512, 16), (AVX512, 256, 512, 32), (AVX2, 7, 1000, 16), (AVX2, 1, 512, 64), (AVX512, 1, 512, 256),
    (AVX2, 256, 10, 16), (AVX2, 7, 77, 16), (AVX512, 7, 77, 32), (AVX2, 256, 16, None), (AVX512, 1, 64, None)])
def test_panel_width_is_the_rules_tile_width(target: tvm.target.Target, rows: int, n: int, width: int | None) -> None:
    """A panel is the tile width the rule takes for the rows (16 = 2 AVX2 vectors, 32 on AVX-512; a GEMV's wide
    tile: 8 vectors at batch 1), whole vectors (10 -> 16), whether or not it divides N (77, 1000: padded panels,
    where `[K, N]` tiles 1000 by 8); a weight of one panel (16 on AVX2, 64 for an AVX-512 GEMV) stays `[K, N]`."""
    assert panel_width(_rule(target), rows, n) == width


@pytest.mark.parametrize(("rows", "n", "batch", "width"), [
    (1, 768, 1, 192), (3, 768, 1, 64), (3, 256, 1, 64), (1, 768, 2, 256), (1, 1000, 1, 256), (1, 256, 1, None),
    (2, 77, 1, 80), (1, 256, 2, None)])
def test_few_rows_narrow_the_panels_until_the_cores_share_them_evenly(rows: int, n: int, batch: int,
                                                                       width: int | None) -> None:
    """Rows one register tile takes leave the panels as the only parallel tasks: on 2 AVX-512 cores a GEMV's
    768 columns go in four panels of 192 (two a core), not three of 256, and 3 rows' in twelve of 64; a batch of 2
    shares three panels of 256 evenly already; 1000 columns as four of 256 are as even as any narrower split. A
    product of one panel is not split to make a second task (256 columns stay `[K, N]`, 77 at 2 rows one panel of
    80), while a batch of two such products has two tasks already."""
    assert panel_width(_rule(AVX512), rows, n, batch) == width


def test_the_register_tile_over_a_packed_weight_comes_from_the_register_file() -> None:
    """"try 6x16 on AVX2 = 12 accumulators; AVX-512 must derive its own, e.g. 8x32 or 14x32 of 32 zmm": the sums,
    the k step's vectors and a broadcast fill the file (16 ymm: 12 + 2 + 1; 32 zmm: 28 + 2 + 1)."""
    assert _rule(AVX2).packed_rows(2) == 6 and _rule(AVX512).packed_rows(2) == 14
    assert _rule(AVX2).packed_rows(8) == 1  # a GEMV's 64 columns: one row


def test_a_weight_computed_at_run_time_packs_only_where_rows_amortize_it() -> None:
    """"weights that are inputs, as in a training step, packed by a kernel only where the rows amortize it":
    lanes x FMA units rows (16 on AVX2, 32 on AVX-512); batch 1 never."""
    assert packs_operand(cpu_model(AVX2), 16) and not packs_operand(cpu_model(AVX2), 15)
    assert packs_operand(cpu_model(AVX512), 32) and not packs_operand(cpu_model(AVX512), 31)
    assert not packs_operand(cpu_model(AVX2), 1)


def test_pack_weight_puts_panels_first() -> None:
    """`[K, N]` as `[N / w, K, w]`: column j of the weight is column j % w of panel j // w."""
    w = np.arange(5 * 48, dtype=np.float32).reshape(5, 48)
    packed = pack_weight(w, 16)
    assert packed.shape == (3, 5, 16) and packed.flags.c_contiguous
    for j in (0, 15, 16, 47):
        np.testing.assert_array_equal(packed[j // 16, :, j % 16], w[:, j])


def test_pack_weight_pads_the_last_panel_with_zeros() -> None:
    """77 columns in panels of 16: 5 panels, the last holding columns 64-76 and 3 zero columns."""
    w = np.random.default_rng(0).standard_normal((3, 77)).astype(np.float32)
    packed = pack_weight(w, 16)
    assert packed.shape == (5, 3, 16)
    np.testing.assert_array_equal(packed[4, :, :13], w[:, 64:])
    assert not packed[4, :, 13:].any()


def _prim_names(mod: tvm.IRModule, target: tvm.target.Target = TARGET) -> list[str]:
    with target:
        out = pack_matmul_weights(target)(mod)
    return [g.name_hint for g, f in out.functions_items() if isinstance(f, tirx.PrimFunc)]


@pytest.mark.parametrize("bound", [True, False])
def test_a_bound_weight_is_packed_at_build_time_and_an_input_by_a_kernel(bound: bool) -> None:
    """A constant weight becomes a packed constant (no per-call packing kernel); a weight passed in is packed by a
    kernel of the program (here 64 rows: worth it on AVX2 and AVX-512)."""
    w = np.random.default_rng(0).standard_normal((33, 64)).astype(np.float32)
    mod = relax_module([(64, 33)] if bound else [(64, 33), (33, 64)],
                       lambda x, *ws: relax.op.matmul(x, ws[0] if ws else relax.const(w)))
    with TARGET:
        out = pack_matmul_weights(TARGET)(mod)
    names = [g.name_hint for g, f in out.functions_items() if isinstance(f, tirx.PrimFunc)]
    assert PACKED_NAME in names and ("pack_matmul_weight" in names) is not bound
    if bound:
        width = panel_width(_rule(TARGET), 64, 64)
        consts = _constants(out["main"])
        assert any(c.shape == (64 // width, 33, width) and np.array_equal(c, pack_weight(w, width)) for c in consts)


def _constants(func: relax.Function) -> list[np.ndarray]:
    """The tensor constants `func` holds."""
    found: list[np.ndarray] = []
    relax.analysis.post_order_visit(func, lambda e: found.append(e.value.numpy()) if isinstance(
        getattr(e, "value", None), tvm.runtime.Tensor) else None)
    return found


def test_a_gemv_with_an_input_weight_is_not_packed() -> None:
    """Batch 1 reads each weight element once: a packing kernel would double its memory traffic."""
    mod = relax_module([(1, 33), (33, 512)], relax.op.matmul)
    assert PACKED_NAME not in _prim_names(mod)


@pytest.mark.parametrize(("x_shape", "w_shape", "flat"), [
    ((2, 1, 384), (384, 768), True), ((4, 3, 1, 512), (512, 1024), True), ((3, 1, 1024), (1024, 77), False),
    ((2, 4, 512), (512, 1024), False)], ids=["2-rows-1.2MB", "12-rows-2MB", "weight-in-l2", "rows-of-4"])
def test_single_rows_of_a_batch_over_a_weight_past_l2_are_one_product(x_shape: tuple, w_shape: tuple,
                                                                      flat: bool) -> None:
    """`[.., B, 1, K] @ [K, N]` with a constant weight larger than L2 (AVX-512's model: 1 MiB) is computed as
    `[B, K] @ [K, N]`, so every task streams its panel once for all B rows; a weight L2 holds, or rows of more than
    one, keep their batch dims. Either way the product equals numpy's."""
    w = np.random.default_rng(0).standard_normal(w_shape).astype(np.float32)
    mod = relax_module([x_shape], lambda x: relax.op.matmul(x, relax.const(w)))
    with AVX512:
        out = pack_matmul_weights(AVX512)(mod)
    (kernel,) = [f for g, f in out.functions_items() if g.name_hint == PACKED_NAME]
    rows = [len(p.ty.shape) for p in kernel.params[:1]]
    assert rows == [2] if flat else rows == [len(x_shape)]
    x = np.random.default_rng(1).standard_normal(x_shape).astype(np.float32)
    got = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False)), tvm.cpu())["main"](
        tvm.runtime.tensor(x)).numpy()
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4 * math.sqrt(w_shape[0]))


def _linear_graph(m: tuple[int, ...], k: int, n: int, relu: bool, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    w, bias = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    x = rng.standard_normal((*m, k)).astype(np.float32)
    b = Builder("Linear")
    y = b.linear(b.input("x", (x.shape, "f32")), b.param("w", w.shape, data=w), b.param("b", bias.shape, data=bias))
    b.ret(b.relu(y) if relu else y)
    want = x.astype(np.float64) @ w.astype(np.float64) + bias
    return b.build(), x, np.maximum(want, 0) if relu else want


@pytest.mark.parametrize(("rows", "k", "n", "relu", "params"), [
    ((256,), 33, 64, True, "bound"), ((7,), 77, 64, True, "bound"), ((1,), 33, 512, False, "bound"),
    ((37,), 33, 64, False, "inputs"), ((2, 19), 33, 64, True, "inputs"), ((7,), 37, 77, True, "bound"),
    ((37,), 20, 10, False, "inputs"), ((1,), 13, 10, False, "bound"), ((3,), 64, 80, True, "bound")],
    ids=["b256-bias-relu-bound", "b7-bound", "b1-bound", "b37-inputs", "3d-bias-relu-inputs", "b7-n77-bound",
         "b37-n10-inputs", "b1-n10-bound", "b3-n80-bound"])
def test_packed_linear_matches_numpy(rows: tuple[int, ...], k: int, n: int, relu: bool, params: str) -> None:
    """x @ w + b (+ relu) through `compile_graph` for odd K and rows (7, 37, 2 x 19 with batch dims), batch 1 and
    256, widths 77 and 10 in zero-padded panels, bound and as inputs, against float64 numpy; every case packs its
    weight on AVX2 and AVX-512 alike (3 rows of 80 columns: two panels of 48 on AVX-512, a tile of 3 vectors)."""
    graph, x, want = _linear_graph(rows, k, n, relu, seed=len(rows) + k)
    got = compile_graph(graph, target=TARGET, params=params, fast_math=False)(x)
    np.testing.assert_allclose(np.asarray(got[0] if isinstance(got, (list, tuple)) else got), want,
                               rtol=1e-4, atol=1e-4 * np.abs(want).max())


def _packed_func(m: int, k: int, n: int, width: int) -> tirx.PrimFunc:
    x, wp = te.placeholder((m, k), name="x"), te.placeholder((n // width, k, width), name="wp")
    return te.create_prim_func([x, wp, packed_matmul(x, wp, n)])


@pytest.mark.parametrize(("target", "rows", "tile"), [(AVX2, 12, (6, 16)), (AVX512, 28, (14, 32)), (AVX2, 7, (7, 16))])
def test_cpu_matmul_tiles_a_packed_weight_by_its_panel(target: tvm.target.Target, rows: int, tile: tuple) -> None:
    """The rule takes the panel width as its vector tile and `packed_rows` rows (6 x 16, 14 x 32; an odd 7 rows
    whole, not 6 + a guarded 1), with no predicate in the kernel."""
    width = tile[1]
    sch = _rule(target).apply(_packed_func(rows, 33, 4 * width, width), target, False)
    text = sch.mod["main"].script()
    assert "T.where" not in text
    assert f"T.unroll({tile[0]})" in text and set(column_widths(text)) == {width}


def test_avx512_cross_build_of_a_packed_matmul_uses_zmm() -> None:
    """"AVX-512 must derive its own [tile] and still build and use zmm for -mcpu=skylake-avx512": the 14 x 32 tile
    over a packed weight builds and its FMAs are on zmm registers."""
    w = np.random.default_rng(0).standard_normal((33, 64)).astype(np.float32)
    mod = relax_module([(28, 33)], lambda x: relax.op.matmul(x, relax.const(w)))
    asm = cpu_compile(mod, AVX512, cpu_pipeline(AVX512)).mod.imports[0].inspect_source("asm")
    assert re.search(r"vfmadd\d+ps\s+[^\n]*%zmm", asm)
    assert PACKED_NAME in _prim_names(mod, AVX512)


def test_a_tile_of_five_vectors_is_vectorized_one_vector_at_a_time() -> None:
    """A 3-row tile over 80-wide panels (5 AVX-512 vectors) runs as an unrolled loop of 16-lane vectors, and its
    build has no lane inserts: vectorized as one 80-lane loop, LLVM built it from per-lane inserts through the
    stack (570 of them) and it ran at 29 GFLOP/s where a 64-wide tile ran at 158."""
    sch = _rule(AVX512).apply(_packed_func(3, 256, 320, 80), AVX512, False)
    text = sch.mod["main"].script()
    assert "T.vectorized(80)" not in text and set(column_widths(text)) == {80}
    asm = tvm.compile(sch.mod, target=AVX512).mod.inspect_source("asm")
    assert re.search(r"vfmadd\d+ps\s+[^\n]*%zmm", asm) and "vinsertps" not in asm


def test_padded_panels_guard_only_the_store() -> None:
    """77 columns in 5 panels of 16: the sums cover all 80 columns unguarded (no predicated vector in the k loop,
    which had left the 7x37x77 layer at 3% of peak), and only the store of the real 77 is guarded."""
    x, wp = te.placeholder((7, 37), name="x"), te.placeholder((5, 37, 16), name="wp")
    text = _rule(AVX2).apply(te.create_prim_func([x, wp, packed_matmul(x, wp, 77)]), AVX2, False).mod["main"].script()
    head, after = text.split('T.sblock("matmul_packed_update")')
    update, store = after.split("T.sblock(", 1)
    assert "T.where" not in head + update and "T.where" in store


@pytest.mark.parametrize(("target", "rows", "width", "padded"), [
    (AVX512, 197, 32, 198), (AVX512, 196, 32, 196), (AVX512, 50, 32, 50), (AVX512, 13, 32, 13), (AVX2, 37, 16, 40),
    (AVX2, 36, 16, 36)])
def test_a_row_count_no_tile_divides_is_summed_in_whole_tiles(target: tvm.target.Target, rows: int, width: int,
                                                              padded: int) -> None:
    """197 tokens (a prime) over 32-wide panels are summed as 198 (18 tiles of 11 rows, the fewest rows past 197 a
    tile of 4 to 14 rows (`packed_rows`) divides) on AVX-512, 37 rows as 40 on AVX2 (tiles of 4 to 6); a count a tile
    of 4 rows or more divides (196 = 14 x 14, 50 = 5 x 10, 36 = 6 x 6), or one tile takes whole (13), is summed as it
    is."""
    assert _rule(target).padded_rows(rows, width) == padded


def test_padded_rows_read_the_last_row_again_and_guard_only_the_store() -> None:
    """197 rows summed as 198 (the last row of x read again for the one past it) in tiles of 11: no predicate in
    the k loop, and the store keeps only the 197 real rows."""
    x, wp = te.placeholder((197, 64), name="x"), te.placeholder((2, 64, 32), name="wp")
    func = te.create_prim_func([x, wp, packed_matmul(x, wp, 64, rows=198)])
    text = _rule(AVX512).apply(func, AVX512, False).mod["main"].script()
    head, after = text.split('T.sblock("matmul_packed_update")')
    update, store = after.split("T.sblock(", 1)
    assert "T.where" not in head + update and "T.unroll(11)" in head + update
    assert "< 197" in re.search(r"T\.where\((.*)\)", store).group(1)


def test_a_dynamic_batch_over_padded_panels_guards_its_columns() -> None:
    """A symbolic row count over 77 columns in padded panels (ResNet's 1000 classes at a dynamic batch): the store
    keeps the column guard; compared as static dims the two symbolic row counts looked different, the epilogue was
    fused into the store and wrote every panel column past the output."""
    x, wp = te.placeholder((te.var("n", "int64"), 37), name="x"), te.placeholder((5, 37, 16), name="wp")
    text = _rule(AVX2).apply(te.create_prim_func([x, wp, packed_matmul(x, wp, 77)]), AVX2, False).mod["main"].script()
    store = text.split('T.sblock("matmul_columns")')[1]
    assert "< 77" in re.search(r"T\.where\((.*)\)", store).group(1)


def test_a_row_tail_over_padded_panels_guards_rows_and_columns() -> None:
    """37 rows (tiles of 8 and a tail) over 77 columns in padded panels, with a relu: the store keeps both bounds
    (fused into the tile's store, the column guard replaced the row guard, and the tail wrote past the output)."""
    x, wp = te.placeholder((37, 70), name="x"), te.placeholder((5, 70, 16), name="wp")
    y = packed_matmul(x, wp, 77)
    relu = te.compute((37, 77), lambda i, j: tirx.max(y[i, j], tirx.const(0, "float32")), name="relu")
    text = _rule(AVX2).apply(te.create_prim_func([x, wp, relu]), AVX2, False).mod["main"].script()
    store = text.split('T.sblock("relu")')[1]
    guard = re.search(r"T\.where\((.*)\)", store).group(1)
    assert "< 37" in guard and "< 77" in guard


@pytest.mark.parametrize(("a_shape", "b_shape", "packs"), [
    ((2, 3, 129, 64), (2, 3, 64, 77), True), ((3, 7, 37), (3, 37, 1000), False), ((4, 129, 37), (4, 37, 10), True),
    ((2, 129, 64), (1, 64, 48), False), ((1, 12, 1, 64), (1, 12, 64, 128), False),
    ((2, 2, 197, 64), (2, 2, 64, 197), True), ((2, 2, 197, 197), (2, 2, 197, 64), True)],
    ids=["heads-n77", "m7-n1000", "n10", "broadcast-batch", "m1", "scores-m197", "context-m197"])
def test_batched_right_operand_packs_per_batch(a_shape: tuple, b_shape: tuple, packs: bool) -> None:
    """Attention's `q @ k^T` and `p @ v` (batch dims equal on both sides) pack their right operand batch by batch
    where its rows amortize the copy (129 rows, not 7 or 1), into whole-vector panels for odd widths; a
    broadcasting batch stays `[.., K, N]`. Numbers against float64 numpy either way, on odd M, K and N (197 tokens:
    rows summed in whole tiles, `CPUMatmul.padded_rows`)."""
    mod = relax_module([a_shape, b_shape], relax.op.matmul)
    assert (PACKED_NAME in _prim_names(mod)) is packs
    rng = np.random.default_rng(len(a_shape) + a_shape[-1])
    a, b = (rng.standard_normal(s).astype(np.float32) for s in (a_shape, b_shape))
    library = cpu_compile(mod, TARGET, cpu_pipeline(TARGET))
    got = relax.VirtualMachine(library, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_avx512_cross_build_of_a_packed_batched_matmul() -> None:
    """The per-batch panels build for AVX-512 too (32-wide panels, zmm FMAs)."""
    mod = relax_module([(2, 129, 64), (2, 64, 77)], relax.op.matmul)
    asm = cpu_compile(mod, AVX512, cpu_pipeline(AVX512)).mod.imports[0].inspect_source("asm")
    assert re.search(r"vfmadd\d+ps\s+[^\n]*%zmm", asm) and PACKED_NAME in _prim_names(mod, AVX512)


def _fused_names(mod: tvm.IRModule) -> list[str]:
    with TARGET:
        fused = tvm.transform.Sequential([pack_matmul_weights(TARGET)])(mod)
    return [g.name_hint for g, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk-transposed"])
def test_a_dynamic_batch_over_a_constant_weight_is_packed(transposed: bool) -> None:
    """A symbolic batch (an ONNX export's `dynamic_axes`) over a constant weight packs it at build time, and so
    does a transposed constant (`permute_dims(W)`: ONNX's Gemm with transB, as torch exports a Linear); one build
    runs batch 1 and 5 against numpy. Before, the 1280x1000 classifier of MobileNetV3 read its weight unpacked:
    0.94 ms at batch 1 against 0.30 packed."""
    w = np.random.default_rng(5).standard_normal((48, 64) if transposed else (64, 48)).astype(np.float32)
    mod = relax_module([(tirx.Var("batch", "int64"), 64)], lambda x: relax.op.matmul(
        x, relax.op.permute_dims(relax.const(w)) if transposed else relax.const(w)))
    assert any(PACKED_NAME in name for name in _fused_names(mod))
    vm = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, fast_math=False)),
                              tvm.cpu())
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
        want = x.astype(np.float64) @ (w.T if transposed else w)
        np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_dynamic_batch_never_packs_a_weight_known_only_at_run_time() -> None:
    """With the rows unknown, `packs_operand` cannot weigh the copy: an input weight stays `[K, N]`."""
    mod = relax_module([(tirx.Var("batch", "int64"), 64), (64, 48)], relax.op.matmul)
    assert not any(PACKED_NAME in name for name in _fused_names(mod))


@pytest.mark.parametrize(("rows", "k", "n", "flips"), [
    (128, 768, 3072, True), (128, 3072, 768, True), (128, 768, 768, True), (1024, 256, 1024, False),
    (1024, 256, 256, False), (64, 512, 512, True), (64, 512, 10, False)],
    ids=["d768-ffn-in", "d768-ffn-out", "d768-proj", "d256-8x128-ffn", "d256-8x128-proj", "mlp-b64", "mlp-head"])
def test_a_weight_larger_than_its_activations_is_not_transposed_to_pack(rows: int, k: int, n: int, flips: bool) -> None:
    """`dy @ W^T` flips to `(W @ dy^T)^T` where the weight (k x n) is larger than the activation and the result it
    replaces: the d768 1x128 encoder's and the b64 MLP's hidden layers, not the d256 8x128 layer (1024 rows) or the
    MLP's 10-wide head; a flipped product never flips back."""
    assert flip_pays(rows, k, n) is flips
    assert not (flips and flip_pays(k, rows, n))


def _pack_shapes(mod: tvm.IRModule, target: tvm.target.Target) -> list[tuple[int, ...]]:
    """The output shapes of the packing kernels `pack_matmul_weights` adds for `target`."""
    with target:
        out = pack_matmul_weights(target)(mod)
    return [tuple(static_shape(b.var.ty)) for block in out["main"].body.blocks for b in block.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.args[0], tvm.ir.GlobalVar)
            and b.value.args[0].name_hint.startswith("pack_matmul_weight")]


@pytest.mark.parametrize("target", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize(("x_shape", "w_shape", "flips"), [
    ((128, 3072), (768, 3072), True), ((1, 128, 768), (3072, 768), True), ((1024, 1024), (256, 1024), False)],
    ids=["2d", "batch-dims", "rows-over-weight"])
def test_the_flip_packs_the_activation_instead_of_the_weight(
        target: tvm.target.Target, x_shape: tuple, w_shape: tuple, flips: bool) -> None:
    """`x @ W^T` with W an input: flipped, the one packing kernel holds `x^T`'s panels (`[rows / w, n, w]`, 128
    columns), not the weight's (`[k / w, n, w]`); 1024 rows over a 256 x 1024 weight keep the weight's pack."""
    mod = relax_module([x_shape, w_shape], lambda x, w: relax.op.matmul(x, relax.op.permute_dims(w)))
    (shape,) = _pack_shapes(mod, target)
    rows, (k, n) = math.prod(x_shape[:-1]), w_shape
    packed_columns = shape[0] * shape[2]
    assert shape[1] == n and packed_columns == (rows if flips else k)


@pytest.mark.parametrize(("x_shape", "w_shape"), [
    ((37, 301), (299, 301)), ((1, 45, 130), (97, 130)), ((2, 19, 200), (190, 200)), ((33, 96), (96, 96))],
    ids=["odd-2d", "batch1-3d", "2x19-rows", "b33"])
def test_flipped_matmul_matches_numpy(x_shape: tuple, w_shape: tuple) -> None:
    """The flipped product at odd rows (37, 45, 2 x 19, 33), odd and non-vector widths (97, 299, 190) and batch dims
    of 1, against float64 numpy; each shape flips (`flip_pays`) and packs its activation."""
    assert flip_pays(math.prod(x_shape[:-1]), *w_shape)
    mod = relax_module([x_shape, w_shape], lambda x, w: relax.op.matmul(x, relax.op.permute_dims(w)))
    rng = np.random.default_rng(sum(x_shape))
    a, b = (rng.standard_normal(s).astype(np.float32) for s in (x_shape, w_shape))
    library = cpu_compile(mod, TARGET, cpu_pipeline(TARGET))
    got = relax.VirtualMachine(library, tvm.cpu())["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    want = a.astype(np.float64) @ b.T.astype(np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_captured_step_with_flipped_input_gradients_is_the_interpreters() -> None:
    """Two SGD steps of a 40 -> 96 -> 96 -> 3 MLP at batch 33 (its 96 x 96 layer's input gradient flips, the head's
    does not): losses and new weights as the reference interpreter's."""
    import kiln
    from kiln import nn

    dev = kiln.Device("cpu").autodiff()

    class Net(kiln.Module):
        def __init__(self) -> None:
            self.fc1, self.fc2, self.fc3 = nn.Linear(40, 96, device=dev), nn.Linear(96, 96, device=dev), nn.Linear(
                96, 3, device=dev)

        def forward(self, x: kiln.Tensor) -> kiln.Tensor:
            return self.fc3(self.fc2(self.fc1(x).relu()).relu())

    def loss(m: Net, x: kiln.Tensor, y: kiln.Tensor) -> kiln.Tensor:
        return nn.mse_loss(m(x), y)

    assert flip_pays(33, 96, 96) and not flip_pays(33, 96, 3)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((33, 40)).astype(np.float32), rng.standard_normal((33, 3)).astype(np.float32))
            for _ in range(2)]
    assert_steps_match_interpreter(Net(), loss, [(33, 40), (33, 3)], data)


@pytest.mark.parametrize(("target", "register"), [(AVX2, "ymm"), (AVX512, "zmm")], ids=["avx2", "avx512"])
def test_cross_builds_of_a_flipped_matmul(target: tvm.target.Target, register: str) -> None:
    """The flipped `x @ W^T` builds for an AVX2 (haswell) and an AVX-512 target, its FMAs on that ISA's vectors."""
    assert flip_pays(40, 150, 200)
    mod = relax_module([(40, 200), (150, 200)], lambda x, w: relax.op.matmul(x, relax.op.permute_dims(w)))
    asm = cpu_compile(mod, target, cpu_pipeline(target)).mod.imports[0].inspect_source("asm")
    assert re.search(rf"vfmadd\d+ps\s+[^\n]*%{register}", asm)


def test_a_run_time_pack_pads_by_a_select_not_a_branch() -> None:
    """The zero columns past N come from a select over a clamped (in-bounds) load: TVM vectorizes an
    `if_then_else` as a branch per lane, and attention's xᵀ over 197 tokens packed 2-4x slower so."""
    keys = te.placeholder((2, 64, 197), "float32", name="keys")
    text = te.create_prim_func([keys, pack_te(keys, 32)]).script()
    assert "T.Select(" in text and "if_then_else" not in text, text
