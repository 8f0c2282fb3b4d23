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


class _Factored:
    """The rule: a matmul or linear of a LoRA weight as the base product plus the scaled product of the factors."""

    def __init__(self) -> None:
        self.factors: dict[str, tuple[SymRef, SymRef, SymRef]] = {}  # lora node -> its operands, made once per node

    def __call__(self, rw: Rewriter, op: Op) -> Sequence[Operand] | None:
        if op.kind not in ("matmul", "linear") or len(op.operands) < 2 or op.operands[1].__class__ is not SymRef:
            return None
        node = rw.graph.reparams.get(op.operands[1].name)  # type: ignore[union-attr]
        if node is None or node.kind != "lora":
            return None
        x, rest = op.operands[0], op.operands[2:]
        factors = self.factors.get(node.name)
        if factors is None:
            base, a, b = (SymRef(name, rw.graph.symbol(name).type) for name in node.operands)  # type: ignore[union-attr]
            factors = self.factors[node.name] = (base, a, b)
        base, a, b = factors
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
        return rewrite(graph, lambda: [_Factored()])
