"""The contract between the ONNX export driver and the per-op rules registered under `OpDef.rules["onnx"]`.

A rule receives an `OnnxCall` (the op's operands as ONNX value names with their kiln types, compile-time values
where known, the attributes and the result types), adds the nodes computing the op through it, and returns one
ONNX value name per result. Rules of ops without `Trait.EXACT` never see f16 or bf16: those operands are cast to
their `DType.compute` (f32) and the results rounded back to their declared dtypes, as the interpreter computes.
Exact ops (data movement, `where`, `cast`, sources) run in their operands' own dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from onnx import NodeProto, helper, numpy_helper

from kiln.ir import DType, KilnError, TensorType, Trait, registry

from .tensors import onnx_dtype

OnnxResult = str | tuple[str, ...]
OnnxRule = Callable[["OnnxCall"], OnnxResult]


class NodeSink:
    """The nodes of the ONNX graph being built, in order, and the value names taken so far."""

    def __init__(self, taken: Iterable[str] = ()):
        self.nodes: list[NodeProto] = []
        self.taken = set(taken)

    def fresh(self, hint: str) -> str:
        """`hint`, or `hint_N` for the least N that makes it unique."""
        name, n = hint, 0
        while name in self.taken:
            n += 1
            name = f"{hint}_{n}"
        self.taken.add(name)
        return name

    def node(self, op_type: str, inputs: Sequence[str], outputs: Sequence[str] = (), **attrs: Any) -> tuple[str, ...]:
        """Append a node writing `outputs`, or one freshly named output."""
        names = list(outputs) or [self.fresh(op_type)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], **attrs))
        return tuple(names)


@dataclass
class OnnxCall:
    """One op being exported: everything a rule may use."""

    kind: str
    sink: NodeSink
    inputs: Sequence[str]
    types: Sequence[TensorType]
    known: Sequence[np.ndarray | None]
    attrs: Mapping[str, Any]
    results: Sequence[TensorType]

    def node(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        """Append a one-output node; its output's name."""
        return self.sink.node(op_type, inputs, **attrs)[0]

    def const(self, value: Any) -> str:
        """A Constant node holding a numpy array or scalar."""
        return self.node("Constant", value=numpy_helper.from_array(np.asarray(value)))

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant, as shape, axes and index operands take."""
        return self.const(np.asarray(values, np.int64))

    def scalar(self, value: float | int, i: int = 0) -> str:
        """A scalar constant of operand i's dtype."""
        return self.const(np.asarray(value, self.types[i].dtype.numpy))

    def cast(self, name: str, dtype: DType) -> str:
        """kiln's cast; to a float8 it does not saturate (overflow is NaN, or inf for f8e5m2), so `saturate=0`; to
        f8e8m0fnu it rounds as ml_dtypes does, which ONNX's Cast (default `round_mode="up"`) does not state."""
        if dtype is DType.f8e8m0fnu:
            raise KilnError("cast to f8e8m0fnu: kiln's rounding (ml_dtypes') has no ONNX Cast; cast to f32 instead")
        if dtype.is_float8:
            return self.node("Cast", name, to=onnx_dtype(dtype), saturate=0)
        return self.node("Cast", name, to=onnx_dtype(dtype))

    def dim(self, i: int, axis: int) -> int | str:
        """Operand i's length along `axis`: an int when static, else a [1] int64 tensor read at run time."""
        size = self.types[i].shape[axis]
        return size if size is not None else self.node("Shape", self.inputs[i], start=axis, end=axis + 1)

    def static_shape(self, i: int) -> tuple[int, ...]:
        """Operand i's shape, which the lowering needs known at export time."""
        t = self.types[i]
        if not t.is_static:
            raise self.unsupported(f"operand {i} has dynamic shape {t}; it needs a static one")
        return t.shape  # type: ignore[return-value]

    def flag(self, i: int) -> bool | None:
        """The export-time value of a flag operand, or None when it is only known at run time."""
        value = self.known[i]
        return None if value is None else bool(value)

    def unsupported(self, why: str) -> KilnError:
        return KilnError(f"{self.kind}: cannot export to ONNX: {why}")


def _widened(rule: OnnxRule) -> OnnxRule:
    """`rule` run in each dtype's `compute` dtype (f32 for f16 and bf16), its results rounded back to their
    declared dtypes."""
    def low(t: TensorType) -> bool:
        return t.dtype.compute is not t.dtype

    def wide(t: TensorType) -> TensorType:
        return t.with_dtype(t.dtype.compute)

    def lower(call: OnnxCall) -> OnnxResult:
        if not any(low(t) for t in (*call.types, *call.results)):
            return rule(call)
        inputs = [call.cast(n, t.dtype.compute) if low(t) else n for n, t in zip(call.inputs, call.types)]
        out = as_names(rule(dataclasses.replace(call, inputs=inputs, types=[wide(t) for t in call.types],
                                                results=[wide(t) for t in call.results])))
        return tuple(call.cast(n, t.dtype) if low(t) else n for n, t in zip(out, call.results))
    return lower


def as_names(result: OnnxResult) -> tuple[str, ...]:
    return (result,) if isinstance(result, str) else tuple(result)


def onnx_rule(*kinds: str) -> Callable[[OnnxRule], OnnxRule]:
    """Register the decorated function as the ONNX lowering of each op kind, widened unless the op is exact."""
    def register(fn: OnnxRule) -> OnnxRule:
        widened = _widened(fn)
        for kind in kinds:
            opdef = registry.lookup(kind)
            opdef.rules["onnx"] = fn if opdef.has(Trait.EXACT) else widened
        return fn
    return register
