"""valid pass."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph

from .param_state import StatePass, map_state, valid_flag, valid_param


@dataclass(frozen=True)
class Valid(StatePass):
    """Disable gradients, autodiff, checkpointing and flags, keeping what `train` restores."""

    name = "valid"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, valid_param, valid_flag)
