"""Device names and checkpointing strategies: the one rule the frontend's Device, the to-device/fork passes and
the `.kir` parser all apply, so a device one of them accepts is a device every one of them accepts."""

from __future__ import annotations

import re

__all__ = ["CHECKPOINTING", "checkpointing_name", "device_name"]

CHECKPOINTING = ("none", "balanced", "all")
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def device_name(name: str) -> str:
    """The canonical name of a device (`cuda` is `cuda:0`), or a ValueError naming the unknown one."""
    if not isinstance(name, str) or not _DEVICE.fullmatch(name):
        raise ValueError(f"unknown device {name!r}: expected 'cpu', 'cuda' or 'cuda:N'")
    return "cuda:0" if name == "cuda" else name


def checkpointing_name(strategy: str | None) -> str | None:
    """A gradient-checkpointing strategy (None: no strategy set), or a ValueError naming the unknown one."""
    if strategy is not None and strategy not in CHECKPOINTING:
        raise ValueError(f"checkpointing {strategy!r} is not one of {', '.join(CHECKPOINTING)}")
    return strategy
