"""factor-lora: `x @ lora(base, a, b)` becomes `x @ base + scale * ((x @ a) @ b)`, so no dense weight is formed.

Under (Q)LoRA the adapted weight `base + scale * a @ b` is never needed itself: multiplying through the factors
costs rank * (d0 + d1) per row instead of d0 * d1 per call for the dense sum, and a quantized base stays codes
that the matmul decodes (the TVM lowering fuses `x @ dequantize(...)`). Run before `autodiff`, the gradients of
`a` and `b` come out as matmuls of rank-wide activations: no [d0, d1] gradient is formed either. Applies to
`matmul` and `linear` whose weight (operand 1) is a `lora` derivation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir import Graph, Op, Operand, Rewriter, SymRef, rewrite

from .base import Pass


def _factored(rw: Rewriter, op: Op) -> Sequence[Operand] | None:
    """The rule: a matmul or linear of a LoRA weight as the base product plus the scaled product of the factors."""
    if op.kind not in ("matmul", "linear") or len(op.operands) < 2 or not isinstance(op.operands[1], SymRef):
        return None
    node = rw.graph.reparams.get(op.operands[1].name)
    if node is None or node.kind != "lora":
        return None
    x, rest = op.operands[0], op.operands[2:]
    base, a, b = (SymRef(name, rw.graph.symbol(name).type) for name in node.operands)
    t = op.results[0].type  # every product below but x @ a has it: the factored sum equals the op's result
    product = rw.emit_as(t, op.kind, x, base, *rest)
    delta = rw.emit_as(t, "matmul", rw.emit("matmul", x, a), b)
    scaled = rw.emit_as(t, "mul", delta, rw.builder.constant(node.attrs["scale"], t.dtype))
    return (rw.emit_as(t, "add", product, scaled),)


@dataclass(frozen=True)
class FactorLora(Pass):
    """Multiply activations through LoRA factors instead of forming `base + scale * a @ b`."""

    name = "factor-lora"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [_factored])
