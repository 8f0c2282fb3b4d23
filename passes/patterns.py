"""Small matchers the program passes share: what is known about an operand at compile time."""

from __future__ import annotations

import numpy as np

from kiln.ir import FlagNode, Graph, Operand, SymRef, Value


def constant_of(o: Operand) -> np.ndarray | None:
    """The value of an operand defined by a `constant` op, else None."""
    if isinstance(o, Value) and o.owner is not None and o.owner.kind == "constant":
        return o.owner.attrs["value"]
    return None


def is_splat(o: Operand, scalar: float) -> bool:
    """Whether the operand is a constant whose every element equals `scalar`."""
    value = constant_of(o)
    return value is not None and value.size > 0 and bool(np.all(value == scalar))


def known_bool(graph: Graph, o: Operand) -> bool | None:
    """A boolean scalar known at compile time: a flag's effective value or a constant; else None."""
    if isinstance(o, SymRef):
        node = graph.symbol(o.name)
        return node.value if isinstance(node, FlagNode) else None
    value = constant_of(o)
    return bool(value) if value is not None and value.size == 1 else None
