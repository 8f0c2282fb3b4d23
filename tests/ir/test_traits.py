"""Op traits: each op kind declares its properties once in the registry; implied traits follow; `DType.compute`.

The consumers' own tests check that they read the traits: cse (tests/passes/test_cse.py), checkpoint
(tests/passes/test_checkpoint.py), the Relax lowering (tests/runtime/test_lowering.py) and ONNX export
(tests/runtime/test_onnx_export.py).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kiln.ir import Builder, DType, OpDef, Trait, lookup, ops_with, print_graph, registered
from kiln.ir.traits import IMPLIES, closure

T = Trait
MOVES = {"transpose", "reshape", "broadcast_to", "concat", "slice", "take", "gather", "tile", "scatter_nd",
         "pad"}  # pad copies x and fills constants or copies of x's edge elements
SOURCES = {"constant", "zeros", "ones", "full"}
ELEMENTWISE = {"neg", "abs", "relu", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "silu", "gelu", "leaky_relu",
               "erf", "add", "sub", "mul", "div", "pow", "maximum", "minimum", "equal", "less", "greater", "where",
               "cast", "dropout", "floor", "ceil", "round", "sign", "logical_not", "logical_and", "logical_or",
               "logical_xor"}


def test_the_trait_table() -> None:
    """The classification each op kind declares, with what it implies."""
    assert ops_with(T.ELEMENTWISE) == ELEMENTWISE
    assert ops_with(T.DATA_MOVEMENT) == MOVES
    assert ops_with(T.SOURCE) == SOURCES
    assert ops_with(T.EXACT) == MOVES | SOURCES | {"where", "cast"}
    assert ops_with(T.MEMORY_BOUND) == ELEMENTWISE | MOVES | SOURCES
    assert ops_with(T.STOCHASTIC) == {"dropout"}
    assert ops_with(T.COLLECTIVE) == {"all_reduce", "all_reduce_start", "all_reduce_wait", "broadcast"}
    assert ops_with(T.COMMUTATIVE) == {"add", "mul", "equal", "logical_and", "logical_or", "logical_xor"}


@pytest.mark.parametrize(("kind", "traits"), [
    ("where", {T.ELEMENTWISE, T.EXACT, T.MEMORY_BOUND}),
    ("take", {T.DATA_MOVEMENT, T.EXACT, T.MEMORY_BOUND}),
    ("gather", {T.DATA_MOVEMENT, T.EXACT, T.MEMORY_BOUND}),
    ("cast", {T.ELEMENTWISE, T.EXACT, T.MEMORY_BOUND}),
    ("add", {T.ELEMENTWISE, T.COMMUTATIVE, T.MEMORY_BOUND}),
    ("maximum", {T.ELEMENTWISE, T.MEMORY_BOUND}),
    ("dropout", {T.ELEMENTWISE, T.STOCHASTIC, T.MEMORY_BOUND}),
    ("all_reduce", {T.COLLECTIVE}),  # rounds (a sum), reads every rank: neither exact nor memory bound
    ("broadcast", {T.COLLECTIVE}),  # another rank's values: never folded, never merged by cse
    ("all_reduce_start", {T.COLLECTIVE}),  # hands the bucket to the engine: two starts are two communications
    ("all_reduce_wait", {T.COLLECTIVE}),
    ("matmul", set()),
    ("softmax", set()),
    ("scatter_nd", {T.DATA_MOVEMENT, T.EXACT, T.MEMORY_BOUND}),  # reduction none: it only writes updates in place
    ("floor", {T.ELEMENTWISE, T.MEMORY_BOUND}),  # exact in any dtype, yet widened like every computing op
    ("topk", set()),  # a sort along the axis: not O(1) per element
    ("argmax", set()),
    ("cumsum", set()),
    ("prod", set()),
    ("dora", set()),  # a derivation: a matmul and a column reduction, not memory bound, recomputed by nothing
])
def test_op_traits(kind: str, traits: set[Trait]) -> None:
    opdef = lookup(kind)
    assert opdef.traits == traits
    assert all(opdef.has(t) for t in traits) and not any(opdef.has(t) for t in set(Trait) - traits)


def test_declared_traits_are_closed_under_implication() -> None:
    opdef = OpDef("probe", ("x",), {}, lambda ts, attrs: tuple(ts), lambda xs, attrs: tuple(xs),
                  traits=frozenset({T.DATA_MOVEMENT}))
    assert opdef.traits == {T.DATA_MOVEMENT, T.EXACT, T.MEMORY_BOUND}
    assert closure([T.STOCHASTIC]) == {T.STOCHASTIC}
    implied = set().union(*IMPLIES.values())
    assert not implied & set(IMPLIES), "closure is one level deep: implied traits must imply nothing"


def test_maximum_is_not_bitwise_commutative() -> None:
    """Why maximum and minimum are not COMMUTATIVE: signed zeros come out in operand order."""
    for kind in ("maximum", "minimum"):
        ref = lookup(kind).reference
        a, b = np.float32(-0.0), np.float32(0.0)
        assert np.signbit(ref([a, b], {})[0]) != np.signbit(ref([b, a], {})[0])


@pytest.mark.parametrize(("dtype", "compute"), [
    (DType.f16, DType.f32), (DType.bf16, DType.f32), (DType.f32, DType.f32), (DType.f64, DType.f64),
    (DType.i32, DType.i32), (DType.bool, DType.bool), (DType.i4, DType.i4),
])
def test_low_precision_floats_compute_in_f32(dtype: DType, compute: DType) -> None:
    assert dtype.compute is compute


def test_importing_any_ir_module_registers_the_builtin_ops() -> None:
    """The registry loads no ops itself: importing `kiln.ir` (as any `kiln.ir.x` import does) registers them."""
    code = "import kiln.ir.registry as r; print(len(r.registered()), r.lookup('add').name)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(registered())), "add"]


def test_str_of_a_graph_is_its_kir_text() -> None:
    b = Builder("M")
    x = b.input("x", ((2,), DType.f32))
    b.ret(b.op("neg", x))
    graph = b.build()
    assert str(graph) == print_graph(graph) and str(graph).startswith("module @M {")
