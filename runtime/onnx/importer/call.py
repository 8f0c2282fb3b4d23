"""`NodeCall`: the view of one ONNX node a converter receives, and the helpers it builds kiln ops with."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto

from kiln.ir import FunctionBuilder, Value

from .errors import Unsupported
from .symbolic import ShapeVector

Output = Value | ShapeVector | np.ndarray | None
"""What a converter gives per node output: a kiln value, a shape vector, a compile-time array, or nothing."""


@dataclass
class NodeCall:
    """One node being converted.

    `inputs` has one entry per node input, None where an optional input is omitted (""); `known` the compile-time
    value of each input where the driver knows it (initializers of no parameter, constants, folded sub-graphs);
    `attrs` the node's attributes decoded to Python values (strings as str, tensors as numpy arrays); `vectors`
    the element-wise shape vector of each input where the driver tracks one; `inline` converts a subgraph (an
    `If` branch, a `Loop` body) in place, its inputs bound to the given outputs, and gives its outputs. `inputs`
    may be lazy: a compile-time value enters the graph (as a constant or parameter) only when a converter asks for
    it with `input`.
    """

    node: NodeProto
    opset: int
    inputs: Sequence[Value | None]
    known: Sequence[np.ndarray | None]
    attrs: Mapping[str, Any]
    builder: FunctionBuilder
    vectors: Sequence[ShapeVector | None] = ()
    inline: Callable[..., Sequence[Output]] | None = None

    @property
    def name(self) -> str:
        return self.node.name

    def input(self, i: int) -> Value:
        """Input i, which must be present."""
        if i >= len(self.inputs) or self.inputs[i] is None:
            raise Unsupported(f"input {i} is missing")
        return self.inputs[i]  # type: ignore[return-value]

    def optional(self, i: int) -> Value | None:
        """Input i, or None where the node omits it."""
        return self.inputs[i] if i < len(self.inputs) else None

    def present(self, i: int) -> bool:
        """Whether the node gives input i (without bringing a compile-time value into the graph)."""
        return i < len(self.inputs) and i < len(self.node.input) and bool(self.node.input[i])

    def value(self, i: int, what: str) -> np.ndarray | None:
        """Input i's compile-time value; None where the input is omitted; `Unsupported` where it is only known at
        run time (`what` names it in the error, e.g. "the shape")."""
        if not self.present(i):
            return None
        known = self.known[i] if i < len(self.known) else None
        if known is None:
            raise Unsupported(f"{what} (input {i}) is computed at run time; kiln needs it at compile time",
                              needs=self.node.input[i])
        return known

    def vector(self, i: int) -> ShapeVector | None:
        """Input i as a shape vector (known ints and run-time dims) where it is one, else None."""
        if i < len(self.vectors) and self.vectors[i] is not None:
            return self.vectors[i]
        known = self.known[i] if i < len(self.known) else None
        return ShapeVector.known(known) if known is not None else None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def required(self, name: str) -> Any:
        """An attribute the op requires; `Unsupported` naming it where the node lacks it."""
        if name not in self.attrs:
            raise Unsupported(f"the required attribute {name!r} is missing")
        return self.attrs[name]

    def emit(self, kind: str, *operands: Value | np.ndarray | float | int | bool, **attrs: Any) -> Value:
        """A kiln op of one result appended to the function being built (literals become constants)."""
        return self.builder.emit(kind, *operands, **attrs)  # type: ignore[return-value]

    def emit_many(self, kind: str, *operands: Value | np.ndarray | float | int | bool, **attrs: Any
                  ) -> tuple[Value, ...]:
        result = self.builder.emit(kind, *operands, **attrs)
        return result if isinstance(result, tuple) else (result,)

    def constant(self, value: np.ndarray | float | int | bool, like: Value | None = None) -> Value:
        """A constant; a Python scalar takes the dtype of `like` where given."""
        if like is not None and not isinstance(value, np.ndarray):
            value = np.asarray(value, like.type.dtype.numpy)
        return self.builder.constant(value)


def decoded_attrs(node: NodeProto) -> dict[str, Any]:
    """A node's attributes as Python values: bytes as str, tensors as numpy arrays, lists as tuples."""
    from onnx import helper, numpy_helper

    out: dict[str, Any] = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode("utf-8", "replace")
        elif hasattr(v, "data_type") and hasattr(v, "dims"):
            v = numpy_helper.to_array(v)
        elif isinstance(v, list):
            v = tuple(x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v)
        out[a.name] = v
    return out

