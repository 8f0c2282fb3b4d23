"""quantize-weights: Burn's Quantizer over a parameter group, as stored codes and scales behind a derivation.

Every matched floating parameter that is not a buffer (biases included, as Burn maps all float params) becomes
`param @P.codes` (the ParamId kept, never trainable), `param @P.scales` and
`reparam @P = dequantize(@P.codes, @P.scales) {value, block}` (the scales at the scale dtype), so uses of `@P`
are unchanged. The values come
from the `quantize` op's reference semantics. Already quantized parameters are skipped; a LoRA base is an error,
since Burn's QLoRA quantizes before it adapts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiln.ir import DType, Graph, KilnError, ParamNode, PassError, ReparamNode, evaluate_op, new_param_id
from kiln.ir.interpreter import param_value
from kiln.ir.naming import quant_codes, quant_scales
from kiln.ir.ops.quant import CALIBRATIONS, SCALE_DTYPES, VALUE_KINDS
from kiln.ir.registry import infer
from kiln.ir.verifier import DEQUANTIZE

from .param_state import GroupOptions

QuantValue = Literal[VALUE_KINDS]  # type: ignore[valid-type]  # the op's value kinds, as option choices
Calibration = Literal[CALIBRATIONS]  # type: ignore[valid-type]
ScaleDtype = Literal[tuple(d.value for d in SCALE_DTYPES)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class QuantizeWeights(GroupOptions):
    """Quantize matched floating parameters with `value` (Burn's default q8f, or kiln's nf4), `block` (trailing
    dims; empty: per tensor), `calibration` (minmax or absmean) and `scale_dtype` (f32, f16 or bf16)."""

    name = "quantize-weights"
    value: QuantValue = "q8f"
    block: tuple[int, ...] = ()
    calibration: Calibration = "minmax"
    scale_dtype: ScaleDtype = "f32"

    def apply(self, graph: Graph) -> Graph:
        hit = self.selected(graph)
        derived = _derivation_operands(graph)
        params: dict[str, ParamNode] = {}
        reparams = dict(graph.reparams)
        for name, p in graph.params.items():
            kind = derived.get(name)
            if kind == DEQUANTIZE or not p.type.dtype.is_float or p.buffer or not hit(p):
                params[name] = p
                continue
            if kind is not None:
                raise PassError(f"quantize-weights: @{name} is an operand of a {kind} derivation; quantize "
                                "before reparameterizing (as Burn's QLoRA does)")
            codes, scales, reparams[name] = self.quantized(graph, p)
            params.update({codes.name: codes, scales.name: scales})
        return graph.replace(params=params, reparams=reparams)

    def quantized(self, graph: Graph, p: ParamNode) -> tuple[ParamNode, ParamNode, ReparamNode]:
        """P's codes (keeping its ParamId), its scales, and the dequantize derivation standing for it."""
        for taken in (quant_codes(p.name), quant_scales(p.name)):
            if graph.symbol(taken) is not None:
                raise PassError(f"quantize-weights: @{taken} already exists")
        scheme = {"value": self.value, "block": self.block}
        try:
            full, types = infer("quantize", [p.type], {**scheme, "calibration": self.calibration,
                                                       "scale_dtype": DType(self.scale_dtype)})
            codes, scales = evaluate_op("quantize", [param_value(p)], full, types)
            attrs, _ = infer(DEQUANTIZE, types, {**scheme, "dtype": p.type.dtype, "calibration": self.calibration})
        except KilnError as e:
            raise PassError(f"quantize-weights: @{p.name}: {e}") from None
        stored = p.replace(name=quant_codes(p.name), type=types[0], init=None, data=codes, grad=False,
                           configured_grad=False)
        scale = ParamNode(quant_scales(p.name), types[1], new_param_id(), data=scales, device=p.device,
                          autodiff=p.autodiff, checkpointing=p.checkpointing)
        return stored, scale, ReparamNode(p.name, p.type, DEQUANTIZE, (stored.name, scale.name), attrs)


def _derivation_operands(graph: Graph) -> dict[str, str]:
    """Each stored parameter a derivation reads, with that derivation's kind."""
    return {o: r.kind for r in graph.reparams.values() for o in r.operands}
