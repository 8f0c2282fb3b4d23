"""materialize: fold each reparameterization into a plain parameter holding its computed value.

The result keeps the stored base's ParamId and configured trainability and is detached from its factors, which
are dropped. A QLoRA weight (LoRA over a dequantized base) folds to a dense float parameter with the codes'
ParamId; its codes and scales are dropped too. A plain quantized weight (a standalone `dequantize`) is not a
reparameterization in Burn and stays as it is, as do parameters that are not derived (lazy ones stay lazy).
With `requantize`, a QLoRA weight is instead folded and quantized back into its base's scheme (`requantize.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Interpreter
from kiln.ir.naming import stored_base
from kiln.ir.verifier import DEQUANTIZE

from .param_state import StatePass
from .requantize import requantize as requantize_qlora


@dataclass(frozen=True)
class Materialize(StatePass):
    """Replace every reparameterization by a parameter with its value (base id and grad state kept)."""

    name = "materialize"
    requantize: bool = False
    """fold QLoRA adapters back into the base's quantization scheme"""

    @property
    def preserves_semantics(self) -> bool:  # type: ignore[override]  # requantizing adds rounding error
        return not self.requantize

    def apply(self, graph: Graph) -> Graph:
        if self.requantize:
            graph, _ = requantize_qlora(graph)
        folded = [r for r in graph.reparams.values() if r.kind != DEQUANTIZE]
        if not folded:
            return graph
        values = Interpreter(graph)
        into = {stored_base(graph, r.name): r for r in folded}
        dropped = graph.reads(o for r in folded for o in r.operands) - into.keys()
        params = {}
        for name, p in graph.params.items():
            if name in into:
                r = into[name]
                params[r.name] = p.replace(name=r.name, type=r.type, init=None, data=values.symbol(r.name))
            elif name not in dropped:
                params[name] = p
        reparams = {n: r for n, r in graph.reparams.items() if r.kind == DEQUANTIZE and n not in dropped}
        return graph.replace(params=params, reparams=reparams)
