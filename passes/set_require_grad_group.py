"""set-require-grad-group pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import GroupOptions, map_state, request_grad


@dataclass(frozen=True)
class SetRequireGradGroup(GroupOptions):
    """set-require-grad on matched floating parameters only; matched flags are ignored."""

    name = "set-require-grad-group"
    value: bool = True

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=self.value), group=self.selected())
