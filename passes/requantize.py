"""Requantization of QLoRA weights (issue 11): fold each LoRA over a dequantized base and quantize the folded
weight back into the base's scheme, measuring the error that adds.

The base's dequantize keeps its scheme (value kind, block, calibration, the scales' dtype and double
quantization; `quantize_weights.quantize_value` quantizes), its codes their ParamId and its scales their nodes;
the LoRA factors are dropped, and the weight becomes a plain quantized one, `reparam @w = dequantize(@w.codes,
@w.scales)`. `materialize{requantize=true}` runs it before folding the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kiln.ir import DType, Graph, Interpreter, ReparamNode, evaluate_op
from kiln.ir.verifier import DEQUANTIZE

from .quantize_weights import quantize_value

log = logging.getLogger("kiln")


@dataclass(frozen=True)
class RequantizeError:
    """The absolute error requantizing adds to one weight, against the folded dense weight."""

    max_abs: float
    mean_abs: float


def requantize(graph: Graph) -> tuple[Graph, dict[str, RequantizeError]]:
    """The graph with every LoRA over a dequantized base re-quantized, and each weight's error by name; each
    error is also logged on the `kiln` logger."""
    qlora = {n: r for n, r in graph.reparams.items()
             if r.kind != DEQUANTIZE and graph.reparams.get(r.operands[0], r).kind == DEQUANTIZE}
    if not qlora:
        return graph, {}
    values = Interpreter(graph)
    params, reparams, report = dict(graph.params), dict(graph.reparams), {}
    for name, r in qlora.items():
        base = graph.reparams[r.operands[0]]
        codes, *scales = (graph.params[o] for o in base.operands)
        dense = values.symbol(name)
        double = len(scales) > 1
        scheme = {"value": base.attrs["value"], "block": base.attrs["block"]}
        new_codes, arrays, _ = quantize_value(dense, r.type, scheme, base.attrs["calibration"],
                                              DType.f32 if double else scales[0].type.dtype, double)
        (back,) = evaluate_op(DEQUANTIZE, [new_codes, *arrays], base.attrs, [r.type])
        error = np.abs(back.astype(np.float64) - dense.astype(np.float64))
        report[name] = RequantizeError(float(error.max(initial=0.0)), float(error.mean()) if error.size else 0.0)
        log.info("requantize @%s (%s): max |error| %.3g, mean |error| %.3g", name, scheme["value"],
                 report[name].max_abs, report[name].mean_abs)
        params[codes.name] = codes.replace(data=new_codes)
        for node, array in zip(scales, arrays):
            params[node.name] = node.replace(data=array, init=None)
        for factor in r.operands[1:]:
            del params[factor]
        del reparams[base.name]
        reparams[name] = ReparamNode(name, r.type, DEQUANTIZE, base.operands, base.attrs)
    return graph.replace(params=params, reparams=reparams), report
