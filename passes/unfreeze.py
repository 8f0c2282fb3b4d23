"""unfreeze pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import StatePass, map_state, request_grad, set_flag


@dataclass(frozen=True)
class Unfreeze(StatePass):
    """Every floating parameter requires gradients and every flag is enabled (set, not restored)."""

    name = "unfreeze"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=True), partial(set_flag, value=True))
