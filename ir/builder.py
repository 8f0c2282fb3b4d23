"""The Python graph-building API: every op is created here, so type inference runs in one place.

    b = Builder("MLP")
    x = b.input("x", TensorType((None, 784), DType.f32))
    w = b.param("fc1.weight", (784, 512), init=Init("kaiming_uniform"))
    b.ret(b.relu(b.matmul(x, w)))
    graph = b.build()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import init as initializers
from . import registry
from .attrs import validate_attrs
from .dtypes import DType
from .errors import ShapeError, VerifyError
from .graph import FlagNode, Function, Graph, Init, Node, Op, Operand, ParamNode, ReparamNode, SymRef, Value
from .location import Location, located
from .param_id import ParamId, new_param_id
from .types import TensorType

Operandish = Operand | np.ndarray | float | int | bool


class FunctionBuilder:
    """Appends ops to one function under construction; `symbols` resolves `@name` operands.

    `loc` is the location of ops made without one of their own: the rewriter sets it to the op being rewritten,
    the ONNX importer to the node being converted, so everything emitted on their behalf inherits it."""

    def __init__(self, name: str, symbols: Callable[[str], Node | None]):
        self.name, self.symbols = name, symbols
        self.args: list[Value] = []
        self.ops: list[Op] = []
        self.taken: set[str] = set()
        self.loc: Location | None = None
        self._counter = 0

    def fresh_name(self) -> str:
        """The next numeric name not taken in this function."""
        while str(self._counter) in self.taken:
            self._counter += 1
        self.taken.add(str(self._counter))
        return str(self._counter)

    def unique(self, name: str) -> str:
        """`name` when no value of this function has it yet, else a fresh numeric name; taken either way."""
        if name in self.taken:
            return self.fresh_name()
        self.taken.add(name)
        return name

    def input(self, name: str, type: TensorType) -> Value:
        v = Value(type, name)
        self.args.append(v)
        self.taken.add(name)
        return v

    def sym(self, name: str) -> SymRef:
        node = self.symbols(name)
        if node is None:
            raise VerifyError(f"no parameter, flag or derived parameter named @{name}")
        return SymRef(name, node.type)

    def emit(self, kind: str, *operands: Operandish, names: Sequence[str | None] = (), loc: Location | None = None,
             **attrs: Any) -> Value | tuple[Value, ...]:
        """Create an op, infer its result types, append it; one result comes back bare, several as a tuple."""
        results = self.append(kind, self.operands(kind, operands), attrs, names, loc)
        return results[0] if len(results) == 1 else results

    def make(self, kind: str, operands: tuple[Operand, ...], attrs: Mapping[str, Any],
             names: Sequence[str | None] = (), loc: Location | None = None,
             types: tuple[TensorType, ...] | None = None) -> Op:
        """An op with inferred result types, not yet appended; at `loc`, else at the builder's `loc`. A shape
        error names the location. `types`, when a rewrite knows them by construction (it keeps an op's result
        type), skip inference but not attribute validation; the verifier re-infers them."""
        loc = loc if loc is not None else self.loc
        try:
            if types is None:
                full, types = registry.infer(kind, [o.type for o in operands], attrs)
            else:
                full = validate_attrs(kind, registry.lookup(kind).attrs, attrs)
        except ShapeError as e:
            raise located(loc, e) from None
        if not names:  # what rewrites emit: every result takes a fresh name
            return Op(kind, operands, full, tuple([Value(t, self.fresh_name()) for t in types]), loc)
        names = list(names) + [None] * (len(types) - len(names))
        self.taken.update(n for n in names if n)
        return Op(kind, operands, full, tuple(Value(t, n or self.fresh_name()) for t, n in zip(types, names)), loc)

    def append(self, kind: str, operands: tuple[Operand, ...], attrs: Mapping[str, Any],
               names: Sequence[str | None] = (), loc: Location | None = None) -> tuple[Value, ...]:
        op = self.make(kind, operands, attrs, names, loc)
        self.ops.append(op)
        return op.results

    def constant(self, value: np.ndarray | float | int | bool, dtype: DType | None = None) -> Value:
        arr = np.asarray(value, dtype=dtype.numpy if dtype else None)
        return self.emit("constant", value=arr)  # type: ignore[return-value]

    def finish(self, results: Sequence[Operand]) -> Function:
        return Function(self.name, tuple(self.args), tuple(self.ops), tuple(results))

    def operands(self, kind: str, operands: Sequence[Operandish]) -> tuple[Operand, ...]:
        """Operands as values: Python and numpy literals become constants of the other operands' dtype."""
        if all(o.__class__ is Value or o.__class__ is SymRef for o in operands):  # what rewrites pass: no literal
            return tuple(operands)
        like = next((o.type.dtype for o in operands if isinstance(o, Value | SymRef)), None)
        out = []
        for i, o in enumerate(operands):
            if isinstance(o, Value | SymRef):
                out.append(o)
            elif isinstance(o, np.ndarray | float | int | bool | np.generic):
                out.append(self.constant(o, like if not isinstance(o, np.ndarray) else None))
            else:
                raise ShapeError(f"{kind}: operand {i} is a {type(o).__name__}, not a value")
        return tuple(out)


class Builder:
    """Builds a whole `Graph`: parameters, flags, derived parameters and functions."""

    def __init__(self, name: str, function: str = "forward"):
        self.name = name
        self.params: dict[str, ParamNode] = {}
        self.flags: dict[str, FlagNode] = {}
        self.reparams: dict[str, ReparamNode] = {}
        self.functions: dict[str, Function] = {}
        self.fn = FunctionBuilder(function, self.symbol)

    def symbol(self, name: str) -> Node | None:
        return self.params.get(name) or self.flags.get(name) or self.reparams.get(name)

    def _declare(self, name: str) -> None:
        if self.symbol(name) is not None:
            raise VerifyError(f"symbol @{name} is declared twice")

    def param(self, name: str, shape: Sequence[int], dtype: DType | str = DType.f32, *, id: int | None = None,
              init: Init | None = None, data: np.ndarray | None = None, grad: bool = True,
              configured_grad: bool | None = None, device: str = "cpu", autodiff: bool = False,
              checkpointing: str | None = None) -> SymRef:
        self._declare(name)
        dtype = DType(dtype) if isinstance(dtype, str) else dtype
        init = initializers.check(init) if init is not None else None
        pid = new_param_id() if id is None else ParamId(id)
        node = ParamNode(name, TensorType(tuple(shape), dtype), pid, init, data, grad,
                         grad if configured_grad is None else configured_grad, device, autodiff, checkpointing)
        self.params[name] = node
        return SymRef(name, node.type)

    def flag(self, name: str, value: bool = True, *, configured: bool | None = None, id: int | None = None
             ) -> SymRef:
        self._declare(name)
        node = FlagNode(name, new_param_id() if id is None else ParamId(id), value, value if configured is None
                        else configured)
        self.flags[name] = node
        return SymRef(name, node.type)

    def reparam(self, name: str, kind: str, *operands: str, **attrs: Any) -> SymRef:
        """Declare `@name` as derived from stored parameters by op `kind`."""
        self._declare(name)
        types = []
        for o in operands:
            node = self.symbol(o)
            if node is None:
                raise VerifyError(f"reparam @{name}: no parameter @{o}")
            types.append(node.type)
        full, (result,) = registry.infer(kind, types, attrs)
        self.reparams[name] = ReparamNode(name, result, kind, tuple(operands), full)
        return SymRef(name, result)

    def input(self, name: str, type: TensorType | tuple[Sequence[int | None], DType | str]) -> Value:
        if not isinstance(type, TensorType):
            shape, dtype = type
            type = TensorType(tuple(shape), DType(dtype) if isinstance(dtype, str) else dtype)
        return self.fn.input(name, type)

    def sym(self, name: str) -> SymRef:
        return self.fn.sym(name)

    def op(self, kind: str, *operands: Operandish, **attrs: Any) -> Value | tuple[Value, ...]:
        return self.fn.emit(kind, *operands, **attrs)

    def constant(self, value: np.ndarray | float | int | bool, dtype: DType | None = None) -> Value:
        return self.fn.constant(value, dtype)

    def ret(self, *results: Operand) -> Function:
        """Finish the current function; a later `begin` starts another."""
        fn = self.fn.finish(results)
        if fn.name in self.functions:
            raise VerifyError(f"function @{fn.name} is defined twice")
        self.functions[fn.name] = fn
        return fn

    def begin(self, function: str) -> None:
        self.fn = FunctionBuilder(function, self.symbol)

    def build(self) -> Graph:
        return Graph(self.name, dict(self.params), dict(self.flags), dict(self.reparams), dict(self.functions))

    def __getattr__(self, kind: str) -> Callable[..., Value | tuple[Value, ...]]:
        """`b.matmul(x, w)` is `b.op("matmul", x, w)` for every registered op kind."""
        if kind.startswith("_") or kind not in registry.registered():
            raise AttributeError(kind)
        return lambda *operands, **attrs: self.fn.emit(kind, *operands, **attrs)
