"""canonicalize: algebraic identities and dead training behaviour, rewritten to simpler equivalent IR.

Each rule fires only when the replacement has exactly the op's result type, so broadcasting is never lost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kiln.ir import Graph, Op, Operand, Rewriter, rewrite
from kiln.ir.ops.shape import transpose_perm

from .base import Pass
from .patterns import is_splat, known_bool

Match = Callable[[Rewriter, Op], Operand | tuple[Operand, ...] | None]


def _same_type(op: Op, o: Operand) -> Operand | None:
    return o if o.type == op.results[0].type else None


def _identity_element(kinds: dict[str, float], commutative: bool) -> Match:
    """x op e -> x (and e op x -> x when commutative) for the op's identity element e."""
    def match(rw: Rewriter, op: Op) -> Operand | None:
        e = kinds[op.kind]
        lhs, rhs = op.operands
        if is_splat(rhs, e):
            return _same_type(op, lhs)
        if commutative and is_splat(lhs, e):
            return _same_type(op, rhs)
        return None
    return match


def _involution(rw: Rewriter, op: Op) -> Operand | None:
    """neg(neg(x)) -> x."""
    inner = op.operands[0]
    owner = getattr(inner, "owner", None)
    return owner.operands[0] if owner is not None and owner.kind == op.kind else None


def _dead_dropout(rw: Rewriter, op: Op) -> Operand | None:
    """dropout with p = 0 or a training flag known to be false is the identity."""
    if op.attrs["p"] == 0.0 or known_bool(rw.graph, op.operands[1]) is False:
        return op.operands[0]
    return None


def _noop_transpose(rw: Rewriter, op: Op) -> Operand | None:
    """transpose by the identity permutation -> x; transpose of transpose -> one composed transpose."""
    x = op.operands[0]
    perm = transpose_perm(op.attrs["perm"], x.type.rank)
    if perm == tuple(range(x.type.rank)):
        return x
    owner = getattr(x, "owner", None)
    if owner is not None and owner.kind == "transpose":
        inner = transpose_perm(owner.attrs["perm"], owner.operands[0].type.rank)
        return rw.emit("transpose", owner.operands[0], perm=tuple(inner[p] for p in perm))
    return None


def _noop_reshape(rw: Rewriter, op: Op) -> Operand | None:
    """reshape to its own static type -> x; reshape of reshape -> one reshape."""
    x = op.operands[0]
    if x.type == op.results[0].type and x.type.is_static:
        return x
    owner = getattr(x, "owner", None)
    like = op.operands[1:]  # the outer reshape's dims come from its shape and `like`, never from the inner one
    if owner is not None and owner.kind == "reshape" and all(v is not x for v in like):
        return rw.emit("reshape", owner.operands[0], *like, shape=op.attrs["shape"], copy=op.attrs["copy"])
    return None


def _same_type_noop(rw: Rewriter, op: Op) -> Operand | None:
    """cast to the same dtype, broadcast_to its own static shape -> x."""
    x = op.operands[0]
    return x if x.type == op.results[0].type and x.type.is_static else None


def _eval_batch_norm(rw: Rewriter, op: Op) -> tuple[Operand, ...] | None:
    """batch_norm with a training flag known false -> x * scale + shift from the running stats, which it returns.

    x's channel dim must be static, so that broadcasting the [C, 1, ...] scale and shift keeps x's type.
    """
    x, gamma, beta, mean, var, training = op.operands
    if known_bool(rw.graph, training) is not False or x.type.shape[1] is None:
        return None
    scale = rw.emit("mul", gamma, rw.emit("rsqrt", rw.emit("add", var, op.attrs["eps"])))
    shift = rw.emit("sub", beta, rw.emit("mul", mean, scale))
    channels = (-1, *(1,) * (x.type.rank - 2))
    y = rw.emit("add", rw.emit("mul", x, rw.emit("reshape", scale, shape=channels)),
                rw.emit("reshape", shift, shape=channels))
    return y, mean, var


_MATCHES: dict[str, Match] = {
    "add": _identity_element({"add": 0.0}, commutative=True),
    "mul": _identity_element({"mul": 1.0}, commutative=True),
    "sub": _identity_element({"sub": 0.0}, commutative=False),
    "div": _identity_element({"div": 1.0}, commutative=False),
    "pow": _identity_element({"pow": 1.0}, commutative=False),
    "neg": _involution,
    "dropout": _dead_dropout,
    "transpose": _noop_transpose,
    "reshape": _noop_reshape,
    "cast": _same_type_noop,
    "broadcast_to": _same_type_noop,
    "batch_norm": _eval_batch_norm,
}


def canonicalize_rule(rw: Rewriter, op: Op) -> Sequence[Operand] | None:
    match = _MATCHES.get(op.kind)
    result = match(rw, op) if match is not None else None
    return result if result is None or isinstance(result, tuple) else (result,)


@dataclass(frozen=True)
class Canonicalize(Pass):
    """Simplify by algebraic identities; drop dropout and fold batch_norm whose training flag is off."""

    name = "canonicalize"

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: [canonicalize_rule])
