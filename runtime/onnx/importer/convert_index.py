"""Converters of ONNX's indexing and contraction ops: Tile, ScatterND (every reduction), ScatterElements, Trilu
and Einsum.

Einsum in general: an ellipsis becomes letters of its own, a letter repeated in one operand takes that operand's
diagonal first (a strided slice of the two axes merged); operands are then contracted left to right as batched
matmuls (transpose, reshape, matmul), and a letter only one operand has and nothing later needs is summed first
(traces, inner products and scalar outputs included). Ellipsis dims broadcast as numpy's do (1 against n; a
letter of the equation must agree in size): a batch dim through matmul's broadcasting, a summed one by summing
each operand over it first (the 1 drops out).
"""

from __future__ import annotations

import math
import string

import numpy as np

from kiln.ir import DType, Value

from .call import NodeCall
from .convert_shape import ones_like
from .registry import Unsupported, converts


@converts("Tile", since=6)
def _tile(call: NodeCall) -> Value:
    repeats = call.value(1, "the repeats")
    return call.emit("tile", call.input(0), repeats=tuple(int(r) for r in np.asarray(repeats).reshape(-1)))


@converts("Trilu", since=14)
def _trilu(call: NodeCall) -> Value:
    """x kept on and above (upper) or below diagonal k of its last two axes, zero elsewhere: the keep mask compares
    column minus row (exclusive cumsums of ones, so `?` dims work, as torch's causal `triu(ones(t, t))` needs)."""
    x = call.input(0)
    if x.type.rank < 2:
        raise Unsupported(f"Trilu of {x.type}: it needs rank 2 or more")
    k = call.value(1, "k")
    k = 0 if k is None else int(np.reshape(k, -1)[0])
    ones = ones_like(call, x, DType.i64)
    rows, cols = (call.emit("cumsum", ones, axis=x.type.rank - a, exclusive=True) for a in (2, 1))
    offset = call.emit("sub", cols, rows)
    keep = (call.emit("greater", offset, call.constant(k - 1, like=offset)) if call.attr("upper", 1)
            else call.emit("less", offset, call.constant(k + 1, like=offset)))
    return call.emit("where", keep, x, call.constant(0, like=x))


@converts("ScatterND", since=11)
def _scatter_nd(call: NodeCall) -> Value:
    return _scatter(call, call.input(1))


def _scatter(call: NodeCall, indices: Value) -> Value:
    """scatter_nd (reduction none: replace) or scatter_nd_reduce (add, mul, max, min) of the node's updates."""
    reduction = call.attr("reduction", "none")
    if reduction == "none":
        return call.emit("scatter_nd", call.input(0), indices, call.input(2))
    if reduction not in ("add", "mul", "max", "min"):
        raise Unsupported(f"reduction = {reduction!r}")
    return call.emit("scatter_nd_reduce", call.input(0), indices, call.input(2), reduction=reduction)


@converts("ScatterElements", since=11)
@converts("Scatter", since=9, until=10)
def _scatter_elements(call: NodeCall) -> Value:
    """A ScatterND whose index tuples are each update's own position with the axis coordinate taken from the
    indices (a compile-time coordinate grid for the other axes, so the indices' shape must be static)."""
    data, idx = call.input(0), call.input(1)
    axis = call.attr("axis", 0) % max(data.type.rank, 1)
    if any(d is None for d in idx.type.shape):
        raise Unsupported(f"dynamic indices shape {idx.type}")
    grid = np.indices(idx.type.shape, dtype=idx.type.dtype.numpy)
    columns = [call.emit("reshape", idx, shape=(*idx.type.shape, 1)) if d == axis else
               call.constant(grid[d][..., None]) for d in range(idx.type.rank)]
    return _scatter(call, call.emit("concat", *columns, axis=-1))


def _parse(equation: str, ranks: list[int]) -> tuple[list[str], str, str]:
    """The operands' subscripts and the output's, each "..." spelled out as letters the equation does not use
    (aligned from the right, as numpy broadcasts them), and those letters; implicit output: the ellipsis dims, then
    the letters used once, sorted."""
    text = equation.replace(" ", "")
    lhs, arrow, out = text.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported(f"Einsum {equation!r} names {len(terms)} operands but the node has {len(ranks)}")
    spare = [c for c in string.ascii_letters if c not in text]
    widths = [rank - len(term.replace("...", "")) if "..." in term else 0 for term, rank in zip(terms, ranks)]
    ellipsis = "".join(spare[:max(widths, default=0)])
    terms = [term.replace("...", ellipsis[len(ellipsis) - w:] if w else "") for term, w in zip(terms, widths)]
    letters = "".join(terms)
    out = out.replace("...", ellipsis) if arrow else ellipsis + "".join(
        sorted(c for c in set(letters) if letters.count(c) == 1 and c not in ellipsis))
    for term, rank in zip(terms, ranks):
        if not all(c.isalpha() for c in term) or len(term) != rank:
            raise Unsupported(f"Einsum {equation!r}: subscripts {term!r} do not match the rank {rank} of its operand")
    if not all(c.isalpha() for c in out) or len(set(out)) != len(out):
        raise Unsupported(f"Einsum {equation!r}: the output {out!r} names each letter at most once")
    if set(out) - set(letters):
        raise Unsupported(f"Einsum {equation!r}: output letters {sorted(set(out) - set(letters))} name no input dim")
    return terms, out, ellipsis


def _diagonal(call: NodeCall, x: Value, term: str, equation: str) -> tuple[Value, str]:
    """x's diagonal over each letter its term repeats: the two axes moved last, merged, and every (n + 1)-th
    element sliced out, which moves values and computes nothing."""
    while len(set(term)) != len(term):
        c = next(c for c in term if term.count(c) > 1)
        i, j = term.index(c), term.index(c, term.index(c) + 1)
        n = x.type.shape[i]
        if n is None or x.type.shape[j] != n:
            raise Unsupported(f"Einsum {equation!r}: the diagonal over {c!r} needs equal static dims in {x.type}")
        keep = [k for k in range(len(term)) if k not in (i, j)]
        rest = "".join(term[k] for k in keep)
        perm = (*keep, i, j)
        moved = x if perm == tuple(range(len(term))) else call.emit("transpose", x, perm=perm)
        flat = call.emit("reshape", moved, shape=(*(-1 if d is None else d for d in moved.type.shape[:-2]), n * n))
        x = call.emit("slice", flat, starts=(0,), ends=(n * n,), axes=(-1,), steps=(n + 1,))
        term = rest + c
    return x, term


def _permute(call: NodeCall, x: Value, have: str, want: str) -> Value:
    return x if have == want else call.emit("transpose", x, perm=tuple(have.index(c) for c in want))


def _merge(dims: list[int | None]) -> int | None:
    return None if None in dims else math.prod(dims)  # type: ignore[arg-type]


def _reshape(call: NodeCall, x: Value, shape: list[int | None], equation: str) -> Value:
    if tuple(shape) == x.type.shape:
        return x
    if shape.count(None) > 1:
        raise Unsupported(f"Einsum {equation!r}: merging dims of {x.type} needs at most one dynamic dim per reshape")
    return call.emit("reshape", x, shape=tuple(-1 if d is None else d for d in shape))


def _sum_unused(call: NodeCall, x: Value, term: str, keep: set[str]) -> tuple[Value, str]:
    """Sum the letters of `term` that nothing later reads."""
    gone = tuple(i for i, c in enumerate(term) if c not in keep)
    if not gone:
        return x, term
    return call.emit("sum", x, axes=gone), "".join(c for c in term if c in keep)


def _one_against_other(a: int | None, b: int | None) -> bool:
    """Whether a dim of 1 meets another size (n, or `?`, which must then be 1 or broadcast)."""
    return a != b and 1 in (a, b)


def _wider(a: int | None, b: int | None) -> int | None:
    """The size a dim of `a` against one of `b` broadcasts to (a 1 takes the other's size)."""
    return b if a == 1 else a if b == 1 or b is None else b


def _contract(call: NodeCall, a: Value, ta: str, b: Value, tb: str, needed: set[str], ellipsis: str,
              equation: str) -> tuple[Value, str]:
    """a and b as one batched matmul: [batch, left, contracted] @ [batch, contracted, right]."""
    for c in set(ta) & set(tb):
        da, db = a.type.shape[ta.index(c)], b.type.shape[tb.index(c)]
        if da is not None and db is not None and da != db and not (c in ellipsis and _one_against_other(da, db)):
            raise Unsupported(f"Einsum {equation!r}: {c!r} is {da} in one operand and {db} in another "
                              "(only ellipsis dims broadcast)")
    # a summed dim of 1 against another size (n or `?`): each operand summed over it alone (the 1 drops out)
    spread = {c for c in ta if c in tb and c not in needed
              and _one_against_other(a.type.shape[ta.index(c)], b.type.shape[tb.index(c)])}
    a, ta = _sum_unused(call, a, ta, set(ta) - spread)
    b, tb = _sum_unused(call, b, tb, set(tb) - spread)
    batch = [c for c in ta if c in tb and c in needed]
    summed = [c for c in ta if c in tb and c not in needed]
    left = [c for c in ta if c not in tb]
    right = [c for c in tb if c not in ta]
    sa, sb = dict(zip(ta, a.type.shape)), dict(zip(tb, b.type.shape))
    a3 = _reshape(call, _permute(call, a, ta, "".join(batch + left + summed)),
                  [*(sa[c] for c in batch), _merge([sa[c] for c in left]), _merge([sa[c] for c in summed])], equation)
    b3 = _reshape(call, _permute(call, b, tb, "".join(batch + summed + right)),
                  [*(sb[c] for c in batch), _merge([sb[c] for c in summed]), _merge([sb[c] for c in right])], equation)
    y = call.emit("matmul", a3, b3)  # batch dims of 1 broadcast here
    shape = [*(_wider(sa[c], sb[c]) for c in batch), *(sa[c] for c in left), *(sb[c] for c in right)]
    return _reshape(call, y, shape, equation), "".join(batch + left + right)


@converts("Einsum", since=12)
def _einsum(call: NodeCall) -> Value:
    equation = call.attr("equation", "")
    operands = [call.input(i) for i in range(len(call.node.input))]
    terms, out, ellipsis = _parse(equation, [x.type.rank for x in operands])
    for i, (x, term) in enumerate(zip(operands, terms)):
        operands[i], terms[i] = _diagonal(call, x, term, equation)

    def later(i: int) -> set[str]:
        return set(out).union(*terms[i + 1:])

    acc, term = _sum_unused(call, operands[0], terms[0], later(0))
    for i in range(1, len(operands)):
        needed = later(i)
        b, tb = _sum_unused(call, operands[i], terms[i], needed | set(term))
        acc, term = _contract(call, acc, term, b, tb, needed, ellipsis, equation)
    acc, term = _sum_unused(call, acc, term, set(out))
    return _permute(call, acc, term, out)
