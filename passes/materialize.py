"""materialize: fold each derived parameter into a plain parameter holding its computed value.

The result keeps the base's ParamId and configured trainability and is detached from its factors, which
are dropped. Parameters that are not derived are untouched (lazy ones stay lazy).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Interpreter

from .param_state import StatePass


@dataclass(frozen=True)
class Materialize(StatePass):
    """Replace every reparam node by a parameter with its value (base id and grad state kept)."""

    name = "materialize"
    preserves_semantics = True

    def apply(self, graph: Graph) -> Graph:
        if not graph.reparams:
            return graph
        values = Interpreter(graph)
        derived_from = {r.operands[0]: r for r in graph.reparams.values()}
        factors = {o for r in graph.reparams.values() for o in r.operands[1:]}
        params = {}
        for name, p in graph.params.items():
            if name in derived_from:
                r = derived_from[name]
                params[r.name] = p.replace(name=r.name, type=r.type, init=None, data=values.symbol(r.name))
            elif name not in factors:
                params[name] = p
        return graph.replace(params=params, reparams={})
