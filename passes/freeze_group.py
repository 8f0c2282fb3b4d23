"""freeze-group pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import GroupOptions, map_state, request_grad, set_flag


@dataclass(frozen=True)
class FreezeGroup(GroupOptions):
    """freeze for matched parameters and flags only."""

    name = "freeze-group"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=False), partial(set_flag, value=False),
                         self.selected())
