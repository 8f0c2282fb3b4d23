"""The graph IR: SSA values and ops in functions, plus parameter, flag and derived-parameter nodes.

A `Graph` is a value: passes return new graphs and never mutate the one they were given. Ops refer to
parameters, flags and derived parameters by symbol (`SymRef`), so changing a node's state never touches
the functions that use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import numpy as np

from .layout import Layout
from .location import Location
from .types import DType, TensorType

FLAG_TYPE = TensorType((), DType.bool)


class Value:
    """An SSA value: a function argument or an op result."""

    __slots__ = ("type", "name", "owner")

    def __init__(self, type: TensorType, name: str | None = None, owner: Op | None = None):
        self.type, self.name, self.owner = type, name, owner

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


@dataclass(frozen=True, slots=True)
class SymRef:
    """An operand naming a parameter, flag or derived parameter of the enclosing graph."""

    name: str
    type: TensorType

    def __repr__(self) -> str:
        return f"@{self.name}: {self.type}"


Operand = Value | SymRef


class Op:
    """One operation: a registered kind applied to operands with attributes, defining result values.

    `loc` says where it came from (`kiln.ir.location`); metadata only, never compared or hashed."""

    __slots__ = ("kind", "operands", "attrs", "results", "loc")

    def __init__(self, kind: str, operands: tuple[Operand, ...], attrs: dict[str, Any],
                 results: tuple[Value, ...], loc: Location | None = None):
        self.kind, self.operands, self.attrs, self.results, self.loc = kind, operands, attrs, results, loc
        for r in results:
            r.owner = self

    def __repr__(self) -> str:
        return f"Op({self.kind}, {list(self.operands)}, {self.attrs})"


@dataclass(frozen=True)
class Function:
    """A straight-line SSA function: arguments, ops in definition order, and returned operands."""

    name: str
    args: tuple[Value, ...]
    ops: tuple[Op, ...]
    results: tuple[Operand, ...]

    @property
    def result_types(self) -> tuple[TensorType, ...]:
        return tuple(r.type for r in self.results)


@dataclass(frozen=True)
class Init:
    """A lazy initializer: a registered kind and its arguments, evaluated only when a value is needed."""

    kind: str
    args: tuple[tuple[str, Any], ...] = ()

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)


class _Replaceable:
    """Nodes and graphs are immutable; `replace` gives a copy with some fields changed."""

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True)
class ParamNode(_Replaceable):
    """A parameter: its path, type, Burn ParamId, lazy initializer or data, and gradient state.

    `grad` is the effective require-grad state; `configured_grad` is what `train` restores. `autodiff`
    says whether the value lives on an autodiff device, with `checkpointing` its strategy (or None). `layout`
    is the parameter's file form in records (None: the live form), kept by every state pass.
    """

    name: str
    type: TensorType
    id: int
    init: Init | None = None
    data: np.ndarray | None = field(default=None, compare=False)
    grad: bool = False
    configured_grad: bool = False
    device: str = "cpu"
    autodiff: bool = False
    checkpointing: str | None = None
    buffer: bool = False  # running state (batch-norm statistics): recorded, never requires gradients
    layout: Layout | None = None

    def tied_to(self, other: ParamNode) -> bool:
        """Whether `other`, which shares this node's ParamId, is the same parameter at another path (tied
        weights): the same type, state and value (one array, or equal arrays). Anything else is two parameters
        claiming one id, which the parser and the verifier refuse."""
        state = (self.type, self.init, self.grad, self.configured_grad, self.buffer, self.layout)
        if state != (other.type, other.init, other.grad, other.configured_grad, other.buffer, other.layout):
            return False
        if self.data is None or other.data is None:
            return self.data is other.data
        return self.data is other.data or bool(np.array_equal(self.data, other.data))


def untied_id_claims(nodes: Iterable[ParamNode]) -> Iterator[tuple[ParamNode, ParamNode]]:
    """(first node with a ParamId, a later one claiming it without being tied to it), in order: the one rule the
    parser, the verifier and record loading apply (one id is one parameter)."""
    owners: dict[int, ParamNode] = {}
    for node in nodes:
        first = owners.setdefault(node.id, node)
        if first is not node and not first.tied_to(node):
            yield first, node



@dataclass(frozen=True)
class FlagNode(_Replaceable):
    """A module-owned control flag (dropout, batch-norm statistics): effective and configured value."""

    name: str
    id: int
    value: bool
    configured: bool

    @property
    def type(self) -> TensorType:
        return FLAG_TYPE



@dataclass(frozen=True)
class ReparamNode(_Replaceable):
    """A derived parameter: a registered op kind applied to stored parameters (e.g. LoRA, dequantize)."""

    name: str
    type: TensorType
    kind: str
    operands: tuple[str, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)



Node = ParamNode | FlagNode | ReparamNode


@dataclass(frozen=True)
class Graph(_Replaceable):
    """One module: its parameter, flag and derived-parameter nodes (one symbol namespace) and functions."""

    name: str
    params: Mapping[str, ParamNode] = field(default_factory=dict)
    flags: Mapping[str, FlagNode] = field(default_factory=dict)
    reparams: Mapping[str, ReparamNode] = field(default_factory=dict)
    functions: Mapping[str, Function] = field(default_factory=dict)
    printer: ClassVar[Callable[[Graph], str]]
    """What `str(graph)` gives: `kiln.ir.printer` installs its `.kir` printer here when imported (as `kiln.ir`
    always does), since the printer imports this module and this module must not import it back."""

    def symbol(self, name: str) -> Node | None:
        """The node a `@name` refers to, or None."""
        return self.params.get(name) or self.flags.get(name) or self.reparams.get(name)

    def reads(self, names: Iterable[str]) -> set[str]:
        """The symbols `names` and every symbol their derivations read, through derived operands."""
        seen: set[str] = set()
        pending = list(names)
        while pending:
            name = pending.pop()
            if name not in seen:
                seen.add(name)
                reparam = self.reparams.get(name)
                pending.extend(reparam.operands if reparam is not None else ())
        return seen

    def nodes(self) -> Iterator[Node]:
        yield from self.params.values()
        yield from self.flags.values()
        yield from self.reparams.values()

    def with_function(self, fn: Function) -> Graph:
        return self.replace(functions={**self.functions, fn.name: fn})

    def __str__(self) -> str:
        return Graph.printer(self)
