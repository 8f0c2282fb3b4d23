"""`Unsupported`: the error a converter raises for a node kiln cannot import (its own module, so the registry
and the `NodeCall` converters receive can both name it without importing each other)."""

from __future__ import annotations

from kiln.ir import KilnError


class Unsupported(KilnError):
    """A node kiln cannot import: the reason, which the driver reports with the node's name, op type and opset;
    `needs` names the ONNX value whose compile-time value the node lacks, where that is why."""

    def __init__(self, reason: str, *, needs: str | None = None):
        super().__init__(reason)
        self.needs = needs
