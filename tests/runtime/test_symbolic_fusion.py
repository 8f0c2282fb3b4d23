"""Fusion over a dynamic batch: `symbolic_injective` (a reshape naming the batch is injective, not opaque),
`fuse_into_selections` (attention's q, k and v slices each compute the head split they read) and the parallel
loops of a symbolic kernel (`schedules.injective.parallel_tasks`). Values against kiln's reference interpreter."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.script import tirx as T

import kiln
from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.schedules import default_cpu_rules
from kiln.runtime.tvm.symbolic_patterns import INJECTIVE, OPAQUE, symbolic_injective
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
ROWS, HEADS, DEPTH = 16, 2, 8
WIDTH = HEADS * DEPTH

pytestmark = pytest.mark.usefixtures("module_cache")


def heads_graph() -> Graph:
    """Attention over a dynamic batch as an imported BERT layer writes it: x [batch, 16, 16] projected to q, k and
    v at once (+ bias), viewed as [batch, 16, 3, heads, depth], moved to [3, batch, heads, 16, depth] and sliced;
    softmax(q kᵀ) v."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((WIDTH, 3 * WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    b = Builder("Heads")
    x = b.input("x", ((None, ROWS, WIDTH), "f32"))
    y = b.linear(x, b.param("w", w.shape, data=w), b.param("b", (3 * WIDTH,), data=np.linspace(-1, 1, 3 * WIDTH,
                                                                                             dtype=np.float32)))
    y = b.transpose(b.reshape(y, shape=(-1, ROWS, 3, HEADS, DEPTH)), perm=(2, 0, 3, 1, 4))
    q, k, v = (b.reshape(b.slice(y, starts=(i,), ends=(i + 1,), axes=(0,)), shape=(-1, HEADS, ROWS, DEPTH))
               for i in range(3))
    b.ret(b.matmul(b.softmax(b.matmul(q, b.transpose(k, perm=(0, 1, 3, 2)))), v))
    return verify(b.build())


def fused_calls(graph: Graph) -> list[str]:
    """The `R.call_tir` lines of the graph's forward function after kiln's CPU fusion passes (f32)."""
    module = lower(graph, "bound", None, "f32", TARGET).module
    with TARGET:
        module = tvm.transform.Sequential(cpu_fusion_passes(TARGET))(module)
    return [line for gv, f in module.functions_items() if isinstance(f, relax.Function)
            for line in str(f).splitlines() if "R.call_tir(" in line]


def test_each_slice_computes_the_head_split_it_reads() -> None:
    """No kernel writes the whole [3, batch, heads, 16, depth] head split: its bias add, reshape and transpose
    run in each of the three kernels that slice it, which read the projection itself."""
    calls = fused_calls(heads_graph())
    whole = [c for c in calls if re.search(r"out_ty=R\.Tensor\(\(3, [a-z]", c)]  # 3 x a symbolic batch
    assert not whole, whole
    projection = next(c for c in calls if "matmul" in c.split("R.call_tir(")[1].split(",")[0])
    product = projection.split("=")[0].strip()
    readers = [c for c in calls if re.search(rf"[( ]{re.escape(product)}[,)]", c.partition("out_ty=")[0])]
    assert len(readers) == 3 and all("slice" in c for c in readers), readers


def test_the_head_split_matches_the_interpreter() -> None:
    """One build, run at batch 1 and 3, against kiln's reference interpreter."""
    graph = heads_graph()
    exe = compile_graph(graph, target=TARGET)
    for n in (1, 3):
        x = np.random.default_rng(n).standard_normal((n, ROWS, WIDTH)).astype(np.float32)
        np.testing.assert_allclose(exe(x), kiln.ir.interpret(graph, [x])[0], rtol=2e-5, atol=2e-6)


def test_consumers_that_read_all_of_a_producer_do_not_copy_it() -> None:
    """exp(x) read whole by two consumers (not selections) stays one kernel: a copy in each would double it."""
    b = Builder("Twice")
    x = b.input("x", ((None, 64), "f32"))
    y = b.exp(x)
    b.ret(b.matmul(b.add(y, b.constant(np.float32(1))), b.transpose(b.mul(y, y), perm=(1, 0))))
    calls = fused_calls(verify(b.build()))
    assert sum("exp" in c.split("R.call_tir(")[1].split(",")[0] for c in calls) == 1, calls


def _legalized(shape: tuple, op: str) -> tvm.IRModule:
    """One op over x of `shape` (a symbolic dim by name), legalized and annotated as TVM's pipeline does."""
    dims = tuple(tirx.Var(d, "int64") if isinstance(d, str) else d for d in shape)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(dims, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            if op == "reshape":
                y = relax.op.reshape(x, (dims[0], dims[1], 3, dims[2] // 3))
            else:
                y = relax.op.sum(x, axis=[2])
            out = bb.emit_output(bb.emit(y))
        bb.emit_func_output(out)
    return relax.transform.AnnotateTIROpPattern()(relax.transform.LegalizeOps()(bb.get()))


def _patterns(mod: tvm.IRModule) -> dict[str, int]:
    return {gv.name_hint: int(f.attrs["op_pattern"]) for gv, f in mod.functions_items()
            if isinstance(f, tirx.PrimFunc)}


def test_a_reshape_over_a_symbolic_batch_is_injective() -> None:
    """TVM calls it opaque (its load names `batch`); the pass calls it injective, as TVM calls the static one."""
    symbolic = _legalized(("batch", 4, 12), "reshape")
    assert _patterns(symbolic) == {"reshape": OPAQUE}
    assert _patterns(symbolic_injective(symbolic)) == {"reshape": INJECTIVE}
    assert _patterns(_legalized((2, 4, 12), "reshape")) == {"reshape": INJECTIVE}


def test_a_reduction_and_a_scatter_keep_their_patterns() -> None:
    """A sum over a symbolic batch keeps TVM's reduction pattern; a kernel storing at computed indices (a scatter:
    an element may be written twice) and one reading what it writes (a scan) stay opaque."""
    reduction = _legalized(("batch", 4, 12), "sum")
    assert _patterns(symbolic_injective(reduction)) == _patterns(reduction) != {"sum": OPAQUE}

    @T.prim_func(private=True, s_tir=True)
    def scatter(x: T.Buffer((8,), "float32"), at: T.Buffer((8,), "int64"), y: T.Buffer((8,), "float32")):
        T.func_attr({"op_pattern": 8})
        for i in range(8):
            with T.sblock("scatter"):
                vi = T.axis.spatial(8, i)
                y[at[vi]] = x[vi]

    @T.prim_func(private=True, s_tir=True)
    def scan(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
        T.func_attr({"op_pattern": 8})
        for i in range(8):
            with T.sblock("scan"):
                vi = T.axis.spatial(8, i)
                y[vi] = T.if_then_else(vi > 0, y[vi - 1], T.float32(0)) + x[vi]

    mod = tvm.IRModule({"scatter": scatter, "scan": scan})
    assert _patterns(symbolic_injective(mod)) == {"scatter": OPAQUE, "scan": OPAQUE}


def test_a_symbolic_transpose_divides_tasks_by_constants_only() -> None:
    """[batch, 128, 3, 4, 16] moved to [3, batch, 4, 128, 16]: the parallel loop puts `batch` outermost, so no
    task recovers an index by dividing by a runtime extent."""
    batch = tirx.Var("batch", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((batch, 128, 3, 4, 16), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(relax.op.permute_dims(x, [2, 0, 3, 1, 4])))
        bb.emit_func_output(out)
    mod = relax.transform.LegalizeOps()(bb.get())
    with TARGET:
        scheduled = dl.ApplyDefaultSchedule(*default_cpu_rules(TARGET))(mod)
    text = scheduled["transpose"].script()
    assert "T.parallel(batch" in text, text
    assert not re.search(r"(//|%) \(?batch", text), text
