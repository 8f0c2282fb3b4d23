"""quantize-weights: Burn's Quantizer over a parameter group, as stored codes and scales behind a derivation.

Every matched floating parameter that is not a buffer (biases included, as Burn maps all float params) becomes
`param @P.codes` (the ParamId kept, never trainable), `param @P.scales` and
`reparam @P = dequantize(@P.codes, @P.scales) {value, block}` (the scales at the scale dtype), so uses of `@P`
are unchanged. With `double_quant` (NF4 only) the f32 scales are stored double-quantized: i8 `@P.scales`,
`@P.scales.scales` and `@P.scales.offset` (`quant.double_quantize`), the dequantize's extra operands. The values come
from the `quantize` op's reference semantics. Already quantized parameters are skipped; a LoRA base is an error,
since Burn's QLoRA quantizes before it adapts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from kiln.ir import DType, Graph, KilnError, ParamNode, PassError, ReparamNode, TensorType, evaluate_op, new_param_id
from kiln.ir.interpreter import param_value
from kiln.ir.naming import quant_codes, quant_scale_factors
from kiln.ir.ops.quant import CALIBRATIONS, SCALE_DTYPES, VALUE_KINDS, check_double_quant, double_quantize
from kiln.ir.registry import infer
from kiln.ir.verifier import DEQUANTIZE

from .param_state import GroupOptions

QuantValue = Literal[VALUE_KINDS]  # type: ignore[valid-type]  # the op's value kinds, as option choices
Calibration = Literal[CALIBRATIONS]  # type: ignore[valid-type]
ScaleDtype = Literal[tuple(d.value for d in SCALE_DTYPES)]  # type: ignore[valid-type]


@dataclass(frozen=True)
class QuantizeWeights(GroupOptions):
    """Quantize matched floating parameters with `value` (Burn's default q8f, or kiln's nf4), `block` (trailing
    dims; empty: per tensor), `calibration` (minmax or absmean), `scale_dtype` (f32, f16 or bf16) and
    `double_quant` (NF4's double-quantized f32 scales)."""

    name = "quantize-weights"
    value: QuantValue = "q8f"
    """the stored value kind"""
    block: tuple[int, ...] = ()
    """the block shape sharing one scale (empty: one scale per tensor)"""
    calibration: Calibration = "minmax"
    """how the range is measured"""
    scale_dtype: ScaleDtype = "f32"
    """the dtype scales are stored in"""
    double_quant: bool = False
    """quantize the scales too (NF4)"""

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
            params.update({node.name: node for node in (codes, *scales)})
        return graph.replace(params=params, reparams=reparams)

    def quantized(self, graph: Graph, p: ParamNode) -> tuple[ParamNode, list[ParamNode], ReparamNode]:
        """P's codes (keeping its ParamId), its scale nodes, and the dequantize derivation standing for it."""
        names = quant_scale_factors(p.name, self.double_quant)
        for taken in (quant_codes(p.name), *names):
            if graph.symbol(taken) is not None:
                raise PassError(f"quantize-weights: @{taken} already exists")
        scheme = {"value": self.value, "block": self.block}
        try:
            if self.double_quant:
                check_double_quant(self.value)
                if self.scale_dtype != "f32":
                    raise PassError(f"double quantization codes f32 scales, not {self.scale_dtype}")
            codes, arrays, attrs = quantize_value(param_value(p), p.type, scheme, self.calibration,
                                                  DType(self.scale_dtype), self.double_quant)
        except KilnError as e:
            raise PassError(f"quantize-weights: @{p.name}: {e}") from None
        stored = p.replace(name=quant_codes(p.name), type=TensorType(p.type.shape, DType.from_numpy(codes.dtype)),
                           init=None, data=codes, grad=False, configured_grad=False)
        scales = [ParamNode(name, TensorType(tuple(a.shape), DType.from_numpy(a.dtype)), new_param_id(), data=a,
                            device=p.device, autodiff=p.autodiff, checkpointing=p.checkpointing)
                  for name, a in zip(names, arrays)]
        return stored, scales, ReparamNode(p.name, p.type, DEQUANTIZE, (stored.name, *names), attrs)


def quantize_value(value: np.ndarray, type: TensorType, scheme: dict, calibration: str, scale_dtype: DType,
                   double: bool) -> tuple[np.ndarray, list[np.ndarray], dict]:
    """Codes, scale arrays (three when double-quantized) and dequantize attributes of a float value, through the
    `quantize` op's reference semantics (also what materialize{requantize} re-quantizes with)."""
    full, types = infer("quantize", [type], {**scheme, "calibration": calibration, "scale_dtype": scale_dtype})
    codes, scales = evaluate_op("quantize", [value], full, types)
    arrays = list(double_quantize(scales)) if double else [scales]
    operands = [types[0], *(TensorType(tuple(a.shape), DType.from_numpy(a.dtype)) for a in arrays)]
    attrs, _ = infer(DEQUANTIZE, operands, {**scheme, "dtype": type.dtype, "calibration": calibration})
    return codes, arrays, attrs


def _derivation_operands(graph: Graph) -> dict[str, str]:
    """Each stored parameter a derivation reads, with that derivation's kind."""
    return {o: r.kind for r in graph.reparams.values() for o in r.operands}
