"""Functional ops on kiln tensors (the same registry ops the layers use)."""

from __future__ import annotations

from kiln.frontend.param import Flag
from kiln.frontend.tensor import Tensor, apply


def relu(x: Tensor) -> Tensor:
    return apply("relu", x)


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    return apply("gelu", x, approximate=approximate)


def silu(x: Tensor) -> Tensor:
    return apply("silu", x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply("softmax", x, axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    return apply("log_softmax", x, axis=axis)


def dropout(x: Tensor, training: Flag, p: float) -> Tensor:
    """Zero elements with probability p while the flag is enabled; identity otherwise."""
    return apply("dropout", x, training.tensor(), p=p)
