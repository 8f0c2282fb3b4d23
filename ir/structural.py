"""Structural equality of graphs with SSA value names ignored, for Before/Expected pass tests.

Two graphs are structurally equal when they print the same once every function's arguments and op results
are renamed `%0, %1, ...` in definition order. Everything else the printer writes therefore counts: symbol
names (module, params, flags, derived params, functions), types, attributes, parameter state and data, op
order and operand order. This is the comparison TVM's `assert_structural_equal` makes for Relax functions,
and it reuses the canonical printer rather than a second notion of what a graph is.
"""

from __future__ import annotations

import difflib

from .graph import Function, Graph, Op, Operand, SymRef, Value
from .printer import print_graph


def _renumbered(fn: Function) -> Function:
    """`fn` with its values renamed by definition order; the original values are left untouched."""
    new: dict[int, Value] = {}

    def define(v: Value) -> Value:
        new[id(v)] = Value(v.type, str(len(new)))
        return new[id(v)]

    def use(o: Operand) -> Operand:
        return o if isinstance(o, SymRef) else new[id(o)]

    args = tuple(define(a) for a in fn.args)
    ops = []
    for op in fn.ops:
        operands = tuple(use(o) for o in op.operands)
        ops.append(Op(op.kind, operands, dict(op.attrs), tuple(define(r) for r in op.results)))
    return Function(fn.name, args, tuple(ops), tuple(use(r) for r in fn.results))


def canonical_text(graph: Graph) -> str:
    """The graph's `.kir` text with SSA values numbered in definition order, function by function."""
    return print_graph(graph.replace(functions={k: _renumbered(f) for k, f in graph.functions.items()}))


def structurally_equal(a: Graph, b: Graph) -> bool:
    """Whether `a` and `b` are the same graph up to the names of SSA values."""
    return canonical_text(a) == canonical_text(b)


def assert_structurally_equal(actual: Graph, expected: Graph) -> None:
    """Raise AssertionError, with a unified diff of both canonical texts, unless the graphs are structurally
    equal (see the module docstring)."""
    got, want = canonical_text(actual), canonical_text(expected)
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(keepends=True), got.splitlines(keepends=True),
                                            "expected", "actual"))
        raise AssertionError(f"graphs differ structurally (SSA values renumbered):\n{diff}\n"
                             f"--- actual, as printed\n{print_graph(actual)}")
