"""Layer size arguments, checked at construction so a bad size fails where it was written, not at the first
forward: a one-line ValueError naming the layer, the argument and the value."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _ints(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, Sequence) else (value,)


def _check(layer: object, least: int, sizes: dict[str, int | Sequence[int]]) -> None:
    kind = "positive" if least == 1 else "non-negative"
    for name, value in sizes.items():
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= least for v in _ints(value)):
            raise ValueError(f"{type(layer).__name__}: {name} must be a {kind} int (or ints), got {value!r}")


def positive(layer: object, **sizes: int | Sequence[int]) -> None:
    """Raise ValueError unless every size (an int or a sequence of ints) is at least 1."""
    _check(layer, 1, sizes)


def non_negative(layer: object, **sizes: int | Sequence[int]) -> None:
    """Raise ValueError unless every size (an int or a sequence of ints) is at least 0 (paddings)."""
    _check(layer, 0, sizes)
