"""train pass."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph

from .param_state import StatePass, map_state, train_flag, train_param


@dataclass(frozen=True)
class Train(StatePass):
    """Enable autodiff and restore the configured require-grad and flag values."""

    name = "train"

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, train_param, train_flag)
