"""The module-state passes that are one transition each, as one family: a pass names the rule its parameters
take and the rule its flags take (`param_state`); its `-group` twin applies them to a ParamGroup only.

| pass | parameters | flags |
|---|---|---|
| train / valid | back on autodiff, configured grad applied / off autodiff | configured value / off |
| set-require-grad{value}, no-grad | configure require-grad (value / false) | untouched |
| freeze / unfreeze | require-grad off / on, persistently | off / on, persistently |
| to-device{device}, fork{device} | moved | untouched |
| freeze-group, unfreeze-group, set-require-grad-group | as above, matched only | as above, matched only |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kiln.ir import FlagNode, Graph, ParamNode, PassError
from kiln.ir.devices import device_name

from .param_state import (
    GroupOptions,
    Selection,
    StatePass,
    map_state,
    move_param,
    request_grad,
    set_flag,
    train_flag,
    train_param,
    valid_flag,
    valid_param,
)


@dataclass(frozen=True)
class Transition(StatePass):
    """Applies `param_rule` to every parameter and `flag_rule` to every flag (the defaults keep them)."""

    def param_rule(self, p: ParamNode) -> ParamNode:
        return p

    def flag_rule(self, f: FlagNode) -> FlagNode:
        return f

    def selected(self, graph: Graph) -> Selection | None:
        """Which nodes the rules apply to; None: all."""
        return None

    def apply(self, graph: Graph) -> Graph:
        return map_state(graph, self.param_rule, self.flag_rule, self.selected(graph))


@dataclass(frozen=True)
class Train(Transition):
    """Enable autodiff and restore the configured require-grad and flag values."""

    name = "train"
    param_rule = staticmethod(train_param)
    flag_rule = staticmethod(train_flag)


@dataclass(frozen=True)
class Valid(Transition):
    """Disable gradients, autodiff, checkpointing and flags, keeping what `train` restores."""

    name = "valid"
    param_rule = staticmethod(valid_param)
    flag_rule = staticmethod(valid_flag)


@dataclass(frozen=True)
class SetRequireGrad(Transition):
    """Configure require-grad on every floating parameter; flags are untouched."""

    name = "set-require-grad"
    value: bool = True
    """the require-grad state to set"""

    def param_rule(self, p: ParamNode) -> ParamNode:
        return request_grad(p, self.value)


@dataclass(frozen=True)
class NoGrad(Transition):
    """set-require-grad{value=false}: persistently no gradients; dropout and batch norm keep behaving."""

    name = "no-grad"

    def param_rule(self, p: ParamNode) -> ParamNode:
        return request_grad(p, False)


@dataclass(frozen=True)
class Freeze(Transition):
    """No gradients and every flag disabled, persistently (set, not restored)."""

    name = "freeze"
    enabled: ClassVar[bool] = False

    def param_rule(self, p: ParamNode) -> ParamNode:
        return request_grad(p, self.enabled)

    def flag_rule(self, f: FlagNode) -> FlagNode:
        return set_flag(f, self.enabled)


@dataclass(frozen=True)
class Unfreeze(Freeze):
    """Every floating parameter requires gradients and every flag is enabled (set, not restored)."""

    name = "unfreeze"
    enabled: ClassVar[bool] = True


@dataclass(frozen=True)
class ToDevice(Transition):
    """Move every parameter to `device`, keeping autodiff association and checkpointing."""

    name = "to-device"
    device: str = "cpu"
    """the target device, e.g. cpu or cuda:0"""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "device", device_name(self.device))  # the rule Device("...") applies
        except ValueError as e:
            raise PassError(f"pass {self.name!r}: {e}") from None

    def param_rule(self, p: ParamNode) -> ParamNode:
        return move_param(p, self.device)


@dataclass(frozen=True)
class Fork(ToDevice):
    """Like to-device, but the moved values start their own autodiff graph (leaves the optimizer can train)."""

    name = "fork"


@dataclass(frozen=True)
class SetRequireGradGroup(GroupOptions, SetRequireGrad):
    """set-require-grad on matched floating parameters only; matched flags are ignored."""

    name = "set-require-grad-group"


@dataclass(frozen=True)
class FreezeGroup(GroupOptions, Freeze):
    """freeze for matched parameters and flags only."""

    name = "freeze-group"


@dataclass(frozen=True)
class UnfreezeGroup(GroupOptions, Unfreeze):
    """unfreeze for matched parameters and flags only."""

    name = "unfreeze-group"
