"""cse: ops of the same kind, operands and attributes compute the same value once.

Stochastic ops are never merged; the operands of commutative ops are compared in a canonical order, so
`add(a, b)` and `add(b, a)` merge (see `kiln.ir.traits`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir import Graph, Op, Operand, Rewriter, SymRef, Trait, lookup, rewrite
from kiln.ir.attrs import attrs_key

from .base import Pass


def _operand_key(o: Operand) -> tuple[int, str | int]:
    """A sortable identity of an operand: symbols by name, values by object."""
    return (0, o.name) if isinstance(o, SymRef) else (1, id(o))


class _Table:
    """The rule: the first op with a given key is kept; later ones are replaced by its results."""

    def __init__(self) -> None:
        self.seen: dict[tuple, Op] = {}

    def __call__(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        opdef = lookup(op.kind)
        if opdef.has(Trait.STOCHASTIC):
            return None
        operands = [_operand_key(o) for o in op.operands]
        if opdef.has(Trait.COMMUTATIVE):
            operands.sort()
        key = (op.kind, tuple(operands), attrs_key(op.attrs), tuple(r.type for r in op.results))
        first = self.seen.setdefault(key, op)
        return None if first is op else first.results


@dataclass(frozen=True)
class CSE(Pass):
    """Common-subexpression elimination over each function (stochastic ops are never merged)."""

    name = "cse"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [_Table()])
