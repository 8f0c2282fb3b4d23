"""dce: remove ops whose results nothing uses."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, prune

from .base import Pass


@dataclass(frozen=True)
class DCE(Pass):
    """Dead-code elimination over each function."""

    name = "dce"

    def apply(self, graph: Graph) -> Graph:
        functions = {name: prune(fn) for name, fn in graph.functions.items()}
        if all(functions[n] is graph.functions[n] for n in functions):
            return graph
        return graph.replace(functions=functions)
