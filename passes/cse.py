"""cse: ops of the same kind, operands and attributes compute the same value once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir import Graph, Op, Operand, Rewriter, SymRef, lookup, rewrite
from kiln.ir.attrs import attrs_key

from .base import Pass


class _Table:
    """The rule: the first op with a given key is kept; later ones are replaced by its results."""

    def __init__(self) -> None:
        self.seen: dict[tuple, Op] = {}

    def __call__(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        if lookup(op.kind).stochastic:
            return None
        key = (op.kind, tuple(o if isinstance(o, SymRef) else id(o) for o in op.operands),
               attrs_key(op.attrs), tuple(r.type for r in op.results))
        first = self.seen.setdefault(key, op)
        return None if first is op else first.results


@dataclass(frozen=True)
class CSE(Pass):
    """Common-subexpression elimination over each function (stochastic ops are never merged)."""

    name = "cse"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [_Table()])
