"""cse reads the op traits: commutative ops merge whatever their operand order; stochastic ops never merge."""

from __future__ import annotations

import numpy as np

from kiln.ir import Builder, DType, Graph, interpret
from kiln.passes import PassManager


def cse(graph: Graph) -> Graph:
    return PassManager.parse("cse,dce", verify_each=True).run(graph)


def kinds(graph: Graph) -> list[str]:
    return [op.kind for op in graph.functions["forward"].ops]


def pair(kind: str, swap: bool, **attrs) -> Graph:
    """`kind(x, w) <op> kind(w, x)` (or both in one order), w a parameter, combined by sub."""
    b = Builder("Pair")
    x = b.input("x", ((3,), DType.f32))
    w = b.param("w", (3,), data=np.array([1.0, -2.0, 0.5], np.float32))
    first = b.op(kind, x, w, **attrs)
    second = b.op(kind, *((w, x) if swap else (x, w)), **attrs)
    b.ret(b.op("sub", first, second))
    return b.build()


def test_commutative_ops_merge_with_their_operands_swapped() -> None:
    for kind in ("add", "mul"):
        graph = pair(kind, swap=True)
        merged = cse(graph)
        assert kinds(merged) == [kind, "sub"], kind
        x = np.array([3.0, 4.0, -1.0], np.float32)
        np.testing.assert_array_equal(interpret(merged, [x])[0], interpret(graph, [x])[0])


def test_ordered_ops_do_not_merge_with_their_operands_swapped() -> None:
    assert kinds(cse(pair("sub", swap=True))) == ["sub", "sub", "sub"]
    assert kinds(cse(pair("maximum", swap=True))) == ["maximum", "maximum", "sub"]  # signed zeros: not commutative
    assert kinds(cse(pair("maximum", swap=False))) == ["maximum", "sub"]


def test_stochastic_ops_never_merge() -> None:
    b = Builder("Drop")
    x = b.input("x", ((3,), DType.f32))
    train = b.flag("train", True)
    b.ret(b.op("add", b.op("dropout", x, train, p=0.5), b.op("dropout", x, train, p=0.5)))
    assert kinds(cse(b.build())) == ["dropout", "dropout", "add"]
