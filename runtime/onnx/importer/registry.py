"""The converters from ONNX op types to kiln ops: each states the opset range it implements.

    @converts("Relu", since=6)
    def _relu(call: NodeCall) -> Value:
        return call.emit("relu", call.input(0))

A converter returns one kiln value per node output (a bare value for one output), or raises `Unsupported` with
the reason, which the driver collects with every other unsupported node into one error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import Unsupported

__all__ = ["Converter", "Unsupported", "converter", "converters", "converts"]

if TYPE_CHECKING:
    from kiln.ir import Value

    from .call import NodeCall

ConvertFn = Callable[["NodeCall"], "Value | Sequence[Value | None]"]


@dataclass(frozen=True)
class Converter:
    """One converter: the ONNX op type (in `domain`, "" being ai.onnx) it converts for opsets since..until;
    `type_only`: the inputs it reads only the type of (CastLike's target), so a node folds whatever they hold."""

    op_type: str
    since: int
    until: int | None
    fn: ConvertFn
    domain: str = ""
    type_only: tuple[int, ...] = ()

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset <= self.until)

    @property
    def range(self) -> str:
        return f"opsets {self.since}..{self.until}" if self.until is not None else f"opsets {self.since} and later"


_CONVERTERS: dict[tuple[str, str], list[Converter]] = {}


def converts(*op_types: str, since: int = 1, until: int | None = None, domain: str = "",
             type_only: tuple[int, ...] = ()) -> Callable[[ConvertFn], ConvertFn]:
    """Register `fn` as the converter of each op type for opsets since..until (inclusive; None: open), reading
    only the types of the inputs `type_only`."""
    def register(fn: ConvertFn) -> ConvertFn:
        for op_type in op_types:
            known = _CONVERTERS.setdefault((domain, op_type), [])
            new = Converter(op_type, since, until, fn, domain, type_only)
            if any(c.covers(since) or new.covers(c.since) for c in known):
                raise ValueError(f"{op_type}: two converters cover one opset")
            known.append(new)
        return fn
    return register


def converter(op_type: str, opset: int, domain: str = "") -> Converter:
    """The converter of `op_type` at `opset`; `Unsupported` says why there is none."""
    known = _CONVERTERS.get((domain, op_type))
    if not known:
        where = f" in domain {domain!r}" if domain else ""
        raise Unsupported(f"no converter for {op_type}{where}")
    for c in known:
        if c.covers(opset):
            return c
    ranges = ", ".join(c.range for c in sorted(known, key=lambda c: c.since))
    raise Unsupported(f"opset {opset} is outside the {ranges} kiln implements")


def converters() -> list[Converter]:
    """Every registered converter, by domain and op type."""
    return [c for key in sorted(_CONVERTERS) for c in _CONVERTERS[key]]
