"""freeze pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import StatePass, map_state, request_grad, set_flag


@dataclass(frozen=True)
class Freeze(StatePass):
    """No gradients and every flag disabled, persistently."""

    name = "freeze"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=False), partial(set_flag, value=False))
