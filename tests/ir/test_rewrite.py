"""The rewrite driver: replaying a function into another builder with value and symbol mappings, and rules."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import (
    Builder,
    DType,
    FunctionBuilder,
    Graph,
    Interpreter,
    Op,
    Rewriter,
    SymRef,
    TensorType,
    VerifyError,
    verify,
)

X = TensorType((2, 3), DType.f64)
W = TensorType((3, 3), DType.f64)


def source() -> Graph:
    """forward(x) = relu(x @ @w) * 2 + x @ @w."""
    b = Builder("M")
    x = b.input("x", X)
    w = b.param("w", (3, 3), DType.f64, data=np.random.default_rng(0).normal(size=(3, 3)))
    y = b.matmul(x, w)
    b.ret(b.add(b.mul(b.relu(y), 2.0), y))
    return verify(b.build())


def copy(graph: Graph, rules=()) -> tuple[Graph, FunctionBuilder]:
    """forward copied into g(w, x): @w becomes the argument `w`; `0` is taken beforehand, so that one is renamed."""
    fb = FunctionBuilder("g", graph.symbol)
    w = fb.input("w", W)
    fb.taken.add("0")  # a name the source's first op result has: the copy must rename it
    rw = Rewriter(graph, fb, rules, symbols=lambda ref: w if ref.name == "w" else ref)
    results = rw.inline(graph.functions["forward"], [fb.input("x", X)], rename=fb.unique)
    return Graph("G", functions={"g": fb.finish(results)}), fb


def test_copy_maps_values_and_symbols_into_a_new_function() -> None:
    graph = source()
    out, fb = copy(graph)
    fn, g = graph.functions["forward"], out.functions["g"]
    assert not any(isinstance(o, SymRef) for op in g.ops for o in op.operands)  # @w is the argument now
    assert not {id(op) for op in g.ops} & {id(op) for op in fn.ops}  # copies, the source untouched
    names = [r.name for op in g.ops for r in op.results]
    assert len(set(names)) == len(names) and names.count("0") == 0 and fn.ops[0].results[0].name == "0"
    x = np.random.default_rng(1).normal(size=(2, 3))
    (want,) = Interpreter(graph).run([x])
    (got,) = Interpreter(out).run([graph.params["w"].data, x], "g")
    np.testing.assert_allclose(got, want)


def test_copied_ops_are_offered_to_the_rules() -> None:
    """A rule seeing the copies (operands already mapped) replaces relu by maximum(y, 0); values agree."""
    seen: list[Op] = []

    def relu_as_maximum(rw: Rewriter, op: Op):
        seen.append(op)
        if op.kind == "relu":
            return (rw.emit("maximum", op.operands[0], 0.0),)
        return None

    graph = source()
    out, _ = copy(graph, [relu_as_maximum])
    kinds = [op.kind for op in out.functions["g"].ops]
    assert "relu" not in kinds and "maximum" in kinds
    assert seen[0].kind == "matmul" and seen[0].operands[1] is out.functions["g"].args[0]
    x = np.random.default_rng(2).normal(size=(2, 3))
    np.testing.assert_allclose(Interpreter(out).run([graph.params["w"].data, x], "g")[0],
                               Interpreter(graph).run([x])[0])


def test_in_place_rewrite_without_changes_returns_the_function_itself() -> None:
    graph = source()
    fn = graph.functions["forward"]
    assert Rewriter.in_place(graph, fn, [lambda rw, op: None]).run(fn) is fn


def _emit_as(result_type: TensorType) -> Graph:
    """forward with relu(y) replaced by `emit_as(result_type, "neg", y) + y`: neg's type stated, not inferred (a
    [1, 3] type still broadcasts against y, so the rewriter's own check of the replacement's type passes)."""
    def relu_as_neg(rw: Rewriter, op: Op):
        if op.kind != "relu":
            return None
        y = op.operands[0]
        return (rw.emit("add", rw.emit_as(result_type, "neg", y), y),)

    graph = source()
    fn = Rewriter.in_place(graph, graph.functions["forward"], [relu_as_neg]).run(graph.functions["forward"])
    return graph.with_function(fn)


def test_a_stated_result_type_is_rechecked_by_the_verifier() -> None:
    """`emit_as` skips inference for a type known by construction; the verifier re-infers it, so a wrong one is a
    VerifyError naming the op, and a right one verifies."""
    verify(_emit_as(TensorType((2, 3), DType.f64)))
    with pytest.raises(VerifyError, match=r"neg.*tensor<1x3xf64>.*infers \(tensor<2x3xf64>\)"):
        verify(_emit_as(TensorType((1, 3), DType.f64)))
