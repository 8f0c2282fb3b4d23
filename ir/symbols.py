"""The one symbol resolver: what a `@name` operand becomes in a target (interpreter, Relax, ONNX, a step function).

A stored parameter and a flag become whatever the target makes of them (`param`, `flag`); a derived parameter is
its derivation emitted by the target (`derive`) from its operands, themselves resolved, recursively (a
`dequantize` may be the base of a `lora`). Each symbol is resolved once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from .errors import VerifyError
from .graph import FlagNode, Graph, ParamNode, ReparamNode
from .types import TensorType

T = TypeVar("T")


class SymbolResolver(Generic[T]):
    """Resolves symbols of `graph` to target values, memoized; `known` presets some (overrides)."""

    def __init__(self, graph: Graph, param: Callable[[ParamNode], T], flag: Callable[[FlagNode], T],
                 derive: Callable[[ReparamNode, list[T], list[TensorType]], T], known: Mapping[str, T] | None = None):
        self.graph, self._param, self._flag, self._derive = graph, param, flag, derive
        self.values: dict[str, T] = dict(known or {})

    def __call__(self, name: str) -> T:
        """The target value of `@name`; derivations get their operands' values and types."""
        if name not in self.values:
            node = self.graph.symbol(name)
            if isinstance(node, ParamNode):
                self.values[name] = self._param(node)
            elif isinstance(node, FlagNode):
                self.values[name] = self._flag(node)
            elif isinstance(node, ReparamNode):
                operands = [self(o) for o in node.operands]
                types = [self.graph.symbol(o).type for o in node.operands]  # type: ignore[union-attr]
                self.values[name] = self._derive(node, operands, types)
            else:
                raise VerifyError(f"@{name} is not a symbol of module @{self.graph.name}")
        return self.values[name]
