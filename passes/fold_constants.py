"""fold-constants: evaluate ops whose operands are all constants, with the reference semantics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir import Graph, Op, Operand, Rewriter, Trait, evaluate_op, lookup, rewrite

from .base import Pass
from .patterns import constant_of


@dataclass(frozen=True)
class FoldConstants(Pass):
    """Replace pure ops on constant operands by constants, up to `max_elements` per result."""

    name = "fold-constants"
    max_elements: int = 1 << 16
    """results larger than this many elements stay computed"""

    def rule(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        opdef = lookup(op.kind)
        if not op.operands or opdef.has(Trait.STOCHASTIC) or opdef.has(Trait.COLLECTIVE):
            return None
        values = [constant_of(o) for o in op.operands]
        if any(v is None for v in values):
            return None
        if any(not r.type.is_static or r.type.numel() > self.max_elements for r in op.results):
            return None
        outs = evaluate_op(op.kind, values, op.attrs, [r.type for r in op.results])  # type: ignore[arg-type]
        return tuple(rw.emit("constant", value=out) for out in outs)

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [self.rule])
