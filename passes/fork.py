"""fork pass."""

from __future__ import annotations

from dataclasses import dataclass

from .to_device import ToDevice


@dataclass(frozen=True)
class Fork(ToDevice):
    """Like to-device, but the moved values start their own autodiff graph (leaves the optimizer can train)."""

    name = "fork"
