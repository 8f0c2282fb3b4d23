"""set-require-grad pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import StatePass, map_state, request_grad


@dataclass(frozen=True)
class SetRequireGrad(StatePass):
    """Configure require-grad on every floating parameter; flags are untouched."""

    name = "set-require-grad"
    value: bool = True

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(request_grad, value=self.value))
