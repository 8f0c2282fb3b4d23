"""no-grad pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import StatePass, map_state, request_grad


@dataclass(frozen=True)
class NoGrad(StatePass):
    """set-require-grad{value=false}: persistently no gradients; dropout and batch norm keep behaving."""

    name = "no-grad"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=False))
