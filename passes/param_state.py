"""The state transitions of parameters and flags, one function per rule, shared by the module-state passes.

Only floating parameters that are not buffers (running statistics) carry gradient state. `grad` is the
effective state, `configured_grad` what `train` applies; a parameter off an autodiff device stores a request
and keeps `grad` false. A group selects a node by the path the user sees for it (`kiln.ir.naming`): the stored
base of a LoRA'd or quantized weight `w` (node `w.base` or `w.codes`) by `w`, as `visit` and records see it,
and its factors by their own paths (`w.lora.a`, `w.lora.b`, `w.scales`), as in Burn.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.ir import FlagNode, Graph, ParamGroupWarning, ParamNode
from kiln.ir.naming import user_paths

from .base import Pass
from .group import ParamGroup

ParamFn = Callable[[ParamNode], ParamNode]
FlagFn = Callable[[FlagNode], FlagNode]
Selection = Callable[[ParamNode | FlagNode], bool]


def request_grad(p: ParamNode, value: bool) -> ParamNode:
    """Configure require-grad; it takes effect now on an autodiff device, else at `train`."""
    if not p.type.dtype.is_float or p.buffer:
        return p
    return p.replace(configured_grad=value, grad=value and p.autodiff)


def set_flag(f: FlagNode, value: bool) -> FlagNode:
    """Set a flag's effective and configured value (freeze/unfreeze: no restoring)."""
    return f.replace(value=value, configured=value)


def valid_param(p: ParamNode) -> ParamNode:
    """Leave autodiff: no gradient, no checkpointing; the configured state stays for `train`."""
    return p.replace(grad=False, autodiff=False, checkpointing=None)


def train_param(p: ParamNode) -> ParamNode:
    """Back on autodiff, applying the configured require-grad (a dropped checkpointing stays dropped)."""
    return p.replace(autodiff=True, grad=p.configured_grad and p.type.dtype.is_float and not p.buffer)


def valid_flag(f: FlagNode) -> FlagNode:
    return f.replace(value=False)


def train_flag(f: FlagNode) -> FlagNode:
    return f.replace(value=f.configured)


def move_param(p: ParamNode, device: str) -> ParamNode:
    """A device move keeps the autodiff association and checkpointing strategy."""
    return p.replace(device=device)


def selection(graph: Graph, group: ParamGroup) -> Selection:
    """Whether `group` selects a parameter or flag node of `graph`, matched by its user path."""
    paths = user_paths(graph)
    return lambda node: group.matches(node.id, paths.get(node.name, node.name), node)


def map_state(graph: Graph, param: ParamFn | None = None, flag: FlagFn | None = None,
              hit: Selection | None = None) -> Graph:
    """Apply transitions to the parameters and flags `hit` selects (all when None)."""
    hit = hit or (lambda node: True)
    params = {n: param(p) if param and hit(p) else p for n, p in graph.params.items()}
    flags = {n: flag(f) if flag and hit(f) else f for n, f in graph.flags.items()}
    if params == dict(graph.params) and flags == dict(graph.flags):
        return graph
    return graph.replace(params=params, flags=flags)


@dataclass(frozen=True)
class StatePass(Pass):
    """A module-state pass: it changes parameter and flag state, so behaviour may change on purpose."""

    preserves_semantics = False


@dataclass(frozen=True)
class GroupOptions(StatePass):
    """Options selecting a ParamGroup: `paths` (globs, `re:REGEX`, `id:0xHEX`, ORed), `exclude` likewise;
    `group` is the same selection given as an object from Python."""

    paths: tuple[str, ...] = ()
    """the parameters and flags selected: globs, re:REGEX or id:0xHEX, ORed"""
    exclude: tuple[str, ...] = ()
    """terms like those of paths, removed from the selection"""
    group: ParamGroup | None = field(default=None, metadata={"text": "use paths=… / exclude=…"})

    def selected(self, graph: Graph) -> Selection:
        """What the options select in `graph`; warns (ParamGroupWarning) for each explicit part of the
        selection (a `paths` term, or the Python group) that selects no parameter or flag."""
        if self.group is not None:
            parts = [(f"group {self.group}", self.group)]
        else:
            parts = [(f"paths={term}", ParamGroup.from_option_text([term], self.exclude)) for term in self.paths]
        nodes = [*graph.params.values(), *graph.flags.values()]
        for label, part in parts:
            if not any(map(selection(graph, part), nodes)):
                warnings.warn(f"pass {self.name!r}: {label} matches no parameter or flag", ParamGroupWarning,
                              stacklevel=2)
        whole = self.group if self.group is not None else ParamGroup.from_option_text(self.paths, self.exclude)
        return selection(graph, whole)
