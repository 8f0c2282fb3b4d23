"""The op registry: each op kind is registered once with its schema, type inference and numpy semantics.

Later layers attach more per-kind rules (gradients, Relax and ONNX lowerings) to the same `OpDef`. The built-in
ops register when `kiln.ir` is imported (its `__init__` imports `kiln.ir.ops`); this module imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .attrs import Attr, validate_attrs
from .errors import ShapeError
from .traits import Trait, closure
from .types import TensorType

InferFn = Callable[[Sequence[TensorType], Mapping[str, Any]], tuple[TensorType, ...]]
ReferenceFn = Callable[[Sequence[np.ndarray], Mapping[str, Any]], tuple[np.ndarray, ...]]


@dataclass
class OpDef:
    """Everything kiln knows about one op kind.

    `operands` names each operand; a name ending in `*` takes any number (at least one) of trailing ones,
    and a name ending in `?` is optional. `infer` raises ShapeError naming the operand at fault. `traits` are
    closed under the traits they imply (see `kiln.ir.traits`).
    """

    name: str
    operands: tuple[str, ...]
    attrs: Mapping[str, Attr]
    infer: InferFn
    reference: ReferenceFn
    doc: str = ""
    traits: frozenset[Trait] = frozenset()
    rules: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.traits = closure(self.traits)
        fixed = sum(not o.endswith(("*", "?")) for o in self.operands)
        variadic = any(o.endswith("*") for o in self.operands)
        # the fewest and most operands (None: no most), counted once here since every op built checks them
        self._arity = (fixed + variadic, None if variadic else fixed + sum(o.endswith("?") for o in self.operands))

    def has(self, trait: Trait) -> bool:
        """Whether this op kind has `trait`, declared or implied."""
        return trait in self.traits

    def check_arity(self, n: int) -> None:
        least, most = self._arity
        if n < least or (most is not None and n > most):
            want = ", ".join(self.operands)
            raise ShapeError(f"{self.name}: takes operands ({want}) but got {n}")


_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    if opdef.name in _REGISTRY:
        raise ValueError(f"op {opdef.name!r} is already registered")
    _REGISTRY[opdef.name] = opdef
    return opdef


def lookup(kind: str) -> OpDef:
    """The registered definition of `kind`; an unknown kind is a ShapeError."""
    try:
        return _REGISTRY[kind]
    except KeyError:
        raise ShapeError(f"unknown op {kind!r}") from None


def registered() -> dict[str, OpDef]:
    return dict(_REGISTRY)


def ops_with(trait: Trait) -> frozenset[str]:
    """The registered op kinds that have `trait`."""
    return frozenset(name for name, opdef in _REGISTRY.items() if opdef.has(trait))


def infer(kind: str, operand_types: Sequence[TensorType], attrs: Mapping[str, Any]
          ) -> tuple[dict[str, Any], tuple[TensorType, ...]]:
    """Validate an op's operands and attributes; return the normalized attrs and the result types."""
    opdef = lookup(kind)
    opdef.check_arity(len(operand_types))
    full = validate_attrs(kind, opdef.attrs, attrs)
    return full, opdef.infer(operand_types, full)
