"""A tile product's elementwise consumer computed in the tile kernel's store (`amx_epilogue.py`, issue 13): which
consumers are taken in (a Sapphire Rapids cross-lowering, any x86 host), and the numbers against float64 numpy
within docs/precision.md's bf16 bound where the host has AMX-BF16."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import tvm
from test_amx_matmul import NO_AMX, SAPPHIRE, needs_tiles
from test_precision import bf16_bound  # the documented bound, one place
from tvm import relax, tirx
from tvm.target import Target

from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.amx import KERNEL_NAME, Epilogue, tile_kernel
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.target import TargetLike

pytestmark = pytest.mark.usefixtures("module_cache")
GELU_SLOPE = 1.13  # max |gelu'(x)|: how far an error in gelu's argument moves its value
FAST_GELU = (5e-4, 2e-6)  # fast-math gelu's relative and absolute error (schedules/fastmath.py: 4.5e-4, 1.5e-6)


def _weight(k: int, n: int) -> np.ndarray:
    return np.random.default_rng(k + n).standard_normal((k, n)).astype(np.float32)


def _bias(n: int) -> np.ndarray:
    return np.linspace(-1, 1, n, dtype=np.float32)


def consumer_graph(rows: int, w: np.ndarray, consumer: str, dynamic: bool = False) -> Graph:
    """x [rows, K] @ W + b, then `consumer`: "gelu" (the FFN's first product), "residual" (+ a second input r,
    an attention output projection's) or "transpose" (a layout change, which stays a kernel of its own); with
    `dynamic`, x and r have a leading dynamic batch ([batch, rows, K])."""
    b = Builder("epilogue")
    lead = (None, rows) if dynamic else (rows,)
    x = b.input("x", ((*lead, w.shape[0]), "f32"))
    y = b.linear(x, b.param("w", w.shape, data=w), b.param("b", (w.shape[1],), data=_bias(w.shape[1])))
    if consumer == "gelu":
        y = b.gelu(y)
    elif consumer == "residual":
        y = b.add(y, b.input("r", ((*lead, w.shape[1]), "f32")))
    else:
        y = b.transpose(y, perm=(1, 0))
    b.ret(y)
    return verify(b.build())


def callees(graph: Graph, target: Target = SAPPHIRE) -> list[str]:
    """The kernels a bf16 build of `graph` for `target` (Sapphire Rapids) calls after fusion, in order."""
    module = lower(graph, "bound", None, "bf16", target).module
    with target:
        module = tvm.transform.Sequential(cpu_fusion_passes(target))(module)
    names: list[str] = []
    for _, func in module.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: names.append(e.args[0].name_hint) if isinstance(
                e, relax.Call) and e.op.same_as(tvm.ir.Op.get("relax.call_tir")) else None)
    return names


@pytest.mark.parametrize("consumer", ["gelu", "residual"])
@pytest.mark.parametrize(("rows", "k", "n"), [(128, 96, 64), (7, 77, 64), (7, 77, 77), (37, 64, 1000)])
def test_bias_activation_and_residual_run_in_the_tile_store(consumer: str, rows: int, k: int, n: int) -> None:
    """The bias with gelu or with a residual add after a tile product is one tile kernel with that epilogue, after
    A's cast (and padding, at K = 77): no elementwise kernel reads the product back, also where N (77, 1000) is
    no whole number of C's panels."""
    names = callees(consumer_graph(rows, _weight(k, n), consumer))
    assert len(names) == 2 and names[1] == f"{KERNEL_NAME}_epilogue"


def test_a_transposing_consumer_stays_a_kernel_of_its_own() -> None:
    """A consumer that moves elements (a transpose) is not an epilogue: the plain tile kernel and the copy."""
    names = callees(consumer_graph(128, _weight(96, 64), "transpose"))
    assert KERNEL_NAME in names and not any(n.startswith(f"{KERNEL_NAME}_epilogue") for n in names)


def test_an_epilogue_stores_only_the_rows_of_its_output() -> None:
    """37 rows of a product C padded to 64 (tiles need 32s of M): the epilogue's store is guarded to the output's
    37 rows (its flat index would wrap past them)."""
    module = lower(consumer_graph(37, _weight(96, 64), "residual"), "bound", None, "bf16", SAPPHIRE).module
    with SAPPHIRE:
        module = tvm.transform.Sequential(cpu_fusion_passes(SAPPHIRE))(module)
    (text,) = [f.script() for g, f in module.functions_items() if g.name_hint.startswith(f"{KERNEL_NAME}_epilogue")]
    assert re.search(r"if .*< T.int64\(37\):", text), text


@pytest.mark.parametrize("target", [SAPPHIRE, NO_AMX["znver4"]], ids=["tiles", "dot"])
def test_an_epilogue_stores_only_the_columns_of_its_output(target: Target) -> None:
    """77 columns of a product C padded to whole panels: the vectors inside them are stored as vectors, and the one
    that crosses column 77 element by element up to it (its lanes past 77 would wrap into the next row). The
    kernel builds for the target (compiled, not run: this host may lack its instructions)."""
    graph = consumer_graph(7, _weight(64, 77), "residual")
    module = lower(graph, "bound", None, "bf16", target).module
    with target:
        module = tvm.transform.Sequential(cpu_fusion_passes(target))(module)
    (text,) = [f.script() for g, f in module.functions_items() if g.name_hint.endswith("_epilogue")]
    lanes, end = (rf"(T\.int64\()?{digits}\)?" for digits in (r"\d+", "77"))  # int64 constants or not
    assert re.search(rf"if .* \+ {lanes} <= {end}:", text), text  # whole vectors
    assert re.search(rf"if .* < {end}:", text), text  # the crossing one, element by element
    compile_graph(graph, target=target, precision="bf16")


def _gelu(y: np.ndarray) -> np.ndarray:
    return 0.5 * y * (1.0 + np.vectorize(math.erf)(y / math.sqrt(2.0)))


def check_epilogues(rows: int, k: int, n: int, target: TargetLike = "llvm", batch: int | None = None) -> None:
    """gelu(x W + b) and x W + b + r built for `target` against float64 numpy: the product within the bf16 bound
    (plus an f32 rounding of the bias and residual adds), gelu moving it by at most its slope, plus fast-math
    gelu's own error. With `batch`, the build takes a dynamic batch and runs at that one."""
    w = _weight(k, n)
    rng = np.random.default_rng(rows)
    lead = (rows,) if batch is None else (batch, rows)
    x, r = (rng.standard_normal(s).astype(np.float32) for s in ((*lead, k), (*lead, n)))
    exact = x.astype(np.float64) @ w + _bias(n)
    bound = bf16_bound(x.astype(np.float64), w.astype(np.float64)) + 2.0 ** -23 * (np.abs(exact) + np.abs(r))
    dynamic = batch is not None
    gelu = compile_graph(consumer_graph(rows, w, "gelu", dynamic), target=target, precision="bf16")
    want = _gelu(exact)
    err = np.abs(np.asarray(gelu(x)) - want)
    assert np.all(err <= GELU_SLOPE * bound + FAST_GELU[0] * np.abs(want) + FAST_GELU[1])
    residual = compile_graph(consumer_graph(rows, w, "residual", dynamic), target=target, precision="bf16")
    err = np.abs(np.asarray(residual(x, r)) - (exact + r))
    assert np.all(err <= bound)
    assert err.max() > 2.0 ** -16 * (np.abs(x) @ np.abs(w)).max()  # bf16's error: not an f32 build


@needs_tiles
@pytest.mark.parametrize(("rows", "k", "n"), [(128, 96, 64), (7, 77, 64), (64, 1000, 96), (608, 1000, 96),
                                              (37, 96, 64), (7, 77, 77), (608, 1000, 1000), (37, 96, 10)])
def test_epilogues_are_within_the_bf16_bound(rows: int, k: int, n: int) -> None:
    """`check_epilogues` from the tile store: 7 rows (tiles configured to 7 rows), K not a multiple of 32; 608 rows
    of K = 1000 (19 row blocks in L2 chunks of at most 16: tasks whose last block is the matrix's, so their last
    epilogue runs alone); 37 rows, C padded to 64, whose padding's products the store must drop; N of 77, 1000
    and 10, C padded to whole panels, whose columns past N the store must drop."""
    check_epilogues(rows, k, n)


def _k_loops(stmt: tirx.Stmt) -> list[tirx.For]:
    """The innermost serial loops around `tdpbf16ps` (unrolled loops aside): the K steps."""
    found: list[tirx.For] = []

    def walk(s: tirx.Stmt, loop: tirx.For | None) -> None:
        if isinstance(s, tirx.For):
            walk(s.body, s if s.kind == tirx.ForKind.SERIAL else loop)
        elif isinstance(s, tirx.Evaluate) and "tdpbf16ps" in str(s.value) and loop is not None:
            found.append(loop) if not any(f.same_as(loop) for f in found) else None
        for child in [getattr(s, a, None) for a in ("body", "then_case", "else_case")] + list(getattr(s, "seq", [])):
            if child is not None and not isinstance(s, tirx.For):
                walk(child, loop)
    walk(stmt, None)
    return found


def _stores_to(stmt: tirx.Stmt, buffer: tirx.Buffer) -> bool:
    """Whether `stmt` stores to `buffer` anywhere inside."""
    if isinstance(stmt, tirx.BufferStore):
        return stmt.buffer.same_as(buffer)
    children = [getattr(stmt, a, None) for a in ("body", "then_case", "else_case")] + list(getattr(stmt, "seq", []))
    return any(_stores_to(c, buffer) for c in children if c is not None)


def test_each_block_s_epilogue_runs_under_the_next_block_s_products() -> None:
    """The epilogue of a block runs a slice of rows per K step of the next block (its vector work overlaps the
    tile products instead of following them: the d512 8x128 FFN's first product with gelu 2.8 -> 1.9 ms on one
    core): the K loop stores to the epilogue's output."""
    out = tirx.decl_buffer((64, 64), "float32", name="out")
    epilogue = Epilogue((), out, lambda b, row, col, c: c * 2.0, lambda b, row, col: [row, col])
    kernel = tile_kernel(16, 128, 64, shared_b=True, cores=2, l2_bytes=1 << 20, epilogue=epilogue)
    (k_loop,) = _k_loops(kernel.body)
    assert _stores_to(k_loop.body, out)
