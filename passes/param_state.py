"""The state transitions of parameters and flags, one function per rule, shared by the module-state passes.

Only floating parameters that are not buffers (running statistics) carry gradient state. `grad` is the
effective state, `configured_grad` what `train` applies; a parameter off an autodiff device stores a request
and keeps `grad` false.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiln.ir import FlagNode, Graph, ParamNode

from .base import Pass
from .group import ParamGroup

ParamFn = Callable[[ParamNode], ParamNode]
FlagFn = Callable[[FlagNode], FlagNode]


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


def map_state(graph: Graph, param: ParamFn | None = None, flag: FlagFn | None = None,
              group: ParamGroup | None = None) -> Graph:
    """Apply transitions to the parameters and flags `group` matches (all when None)."""
    def hit(node: ParamNode | FlagNode) -> bool:
        return group is None or group.matches(node.id, node.name, node)

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
    exclude: tuple[str, ...] = ()
    group: ParamGroup | None = None

    def selected(self) -> ParamGroup:
        return self.group if self.group is not None else ParamGroup.from_option_text(self.paths, self.exclude)
