"""The lazy DAG behind Tensors: nodes, their topological order, and lowering into an IR function.

It knows nothing of Tensor itself (any `Output`, a node and a result index, lowers), so eager evaluation
(`tensor`), reverse mode (`autograd`) and tracing (`trace`) all build on it without importing each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kiln.ir import FunctionBuilder, TensorType
from kiln.ir.location import Location


class Node:
    """One DAG node: a leaf ("data", "input", "symbol") or an op over input nodes.

    A data leaf read from a parameter carries its `param_id`, so `backward` can key gradients by ParamId, and its
    `autodiff_node`, the leaf's identity (a parameter and its fork share the ParamId, not the leaf). An op
    recorded while tracing carries its `loc` (the user's line and module path), which its IR op takes.
    """

    __slots__ = ("kind", "inputs", "attrs", "types", "data", "name", "autodiff", "require_grad", "param_id",
                 "autodiff_node", "loc")

    def __init__(self, kind: str, inputs: tuple[tuple[Node, int], ...], attrs: dict[str, Any],
                 types: tuple[TensorType, ...], data: np.ndarray | None = None, name: str | None = None,
                 autodiff: bool = False, require_grad: bool = False, param_id: int | None = None,
                 autodiff_node: int | None = None, loc: Location | None = None):
        self.kind, self.inputs, self.attrs, self.types = kind, inputs, attrs, types
        self.data, self.name, self.autodiff, self.require_grad = data, name, autodiff, require_grad
        self.param_id, self.autodiff_node, self.loc = param_id, autodiff_node, loc


class Output(Protocol):
    """One result of a DAG node, as a Tensor holds it."""

    node: Node
    index: int

    @property
    def type(self) -> TensorType: ...


def topological(roots: Sequence[Node]) -> list[Node]:
    """Nodes reachable from `roots`, inputs before users (iterative, so deep chains don't recurse)."""
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((i, False) for i, _ in reversed(node.inputs) if id(i) not in seen)
    return order


def lower(fb: FunctionBuilder, outputs: Sequence[Output], data_as_inputs: bool,
          bound: dict[int, tuple] | None = None) -> list:
    """Emit the DAG behind `outputs` into `fb`; data leaves become arguments or constants.

    `bound` maps id(node) to values already declared (a trace's arguments). Returns [results, feeds].
    """
    values: dict[int, tuple] = dict(bound or {})
    feeds: list[np.ndarray] = []
    for node in topological([t.node for t in outputs]):
        if id(node) in values:
            continue
        if node.kind == "data":
            arrays = node.data if isinstance(node.data, tuple) else (node.data,)
            if data_as_inputs:
                values[id(node)] = tuple(fb.input(f"in{len(feeds) + k}", t) for k, t in enumerate(node.types))
                feeds.extend(arrays)
            else:
                values[id(node)] = tuple(fb.constant(a) for a in arrays)
        elif node.kind == "input":
            values[id(node)] = (fb.input(node.name, node.types[0]),)  # type: ignore[arg-type]
        elif node.kind == "symbol":
            values[id(node)] = (fb.sym(node.name),)  # type: ignore[arg-type]
        else:
            operands = tuple(values[id(i)][k] for i, k in node.inputs)
            values[id(node)] = fb.append(node.kind, operands, node.attrs, loc=node.loc)
    results = [values[id(t.node)][t.index] for t in outputs]
    return [results, feeds]
