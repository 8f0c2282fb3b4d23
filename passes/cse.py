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


def _order(key: SymRef | int) -> tuple[int, str | int]:
    """Sorts operand identities (symbols by name, values by object id) for a commutative op's canonical order."""
    return (0, key.name) if isinstance(key, SymRef) else (1, key)


class _Table:
    """The rule: the first op with a given key is kept; later ones are replaced by its results."""

    def __init__(self) -> None:
        self.seen: dict[tuple, Op] = {}
        self.kinds: dict[str, tuple[bool, bool]] = {}  # kind -> (never merged, commutative): traits read once per kind

    def _traits(self, kind: str) -> tuple[bool, bool]:
        opdef = lookup(kind)
        traits = (opdef.has(Trait.STOCHASTIC) or opdef.has(Trait.COLLECTIVE), opdef.has(Trait.COMMUTATIVE))
        self.kinds[kind] = traits
        return traits

    def __call__(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        kind = op.kind
        never, commutative = self.kinds.get(kind) or self._traits(kind)
        if never:
            return None
        operands = tuple([o if o.__class__ is SymRef else id(o) for o in op.operands])
        if commutative:
            operands = tuple(sorted(operands, key=_order))
        key = (kind, operands, attrs_key(op.attrs) if op.attrs else (), tuple([r.type for r in op.results]))
        first = self.seen.setdefault(key, op)
        return None if first is op else first.results


@dataclass(frozen=True)
class CSE(Pass):
    """Common-subexpression elimination over each function (stochastic ops are never merged)."""

    name = "cse"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [_Table()])
