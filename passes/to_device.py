"""to-device pass."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kiln.ir import Graph

from .param_state import StatePass, map_state, move_param


@dataclass(frozen=True)
class ToDevice(StatePass):
    """Move every parameter to `device`, keeping autodiff association and checkpointing."""

    name = "to-device"
    device: str = "cpu"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, partial(move_param, device=self.device))
