"""Reverse-mode gradient rules, one per op kind, written in IR ops.

A rule is registered with `@gradient("kind")` into `registry.lookup(kind).rules["grad"]`:

    rule(ctx: GradContext, op: Op, out_grads: tuple[Value | None, ...]) -> tuple[Value | None, ...]

`op` is an op of the function under construction (its operands and results may be used as operands of the ops
the rule emits); `out_grads[i]` is d loss / d op.results[i], or None where no gradient reaches that result. The
rule emits its backward ops through `ctx.fb` and returns one gradient per operand: a value of the operand's type
(a `?` dim may come back static and vice versa), or None where there is none (integer and bool operands, indices,
flags). `ctx.wanted(i)` says whether the caller needs operand i's gradient at all; rules skip the ops of unwanted
ones (the autodiff pass prunes whatever is left unused anyway).

The rules live in `kiln.ir.grad_rules`, one module per op family; importing that package registers them and
gives `rule_for`, so importing `kiln.ir` does not pay for them and this module never imports them. The helpers
below are the vocabulary the rules share: broadcasting and its inverse (`expand`, `unbroadcast`), unit axes
(`unsqueeze`, `squeeze`), filled tensors whose dynamic dims come from another value (`fill`), element counts
(`count`), zero padding and strided placement along an axis (`pad`, `place`) and matmuls along one axis
(`matmul_along`).

Dynamic dims: shapes are reasoned about statically from types. Where a `?` meets a `?`, the two are assumed equal
(as type inference assumes when broadcasting); a tensor of a shape with dynamic dims is made by broadcasting
against a value that has them (`where(equal(ref, ref), c, c)`), never by reading shapes at run time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from . import registry
from .builder import FunctionBuilder
from .dtypes import DType
from .errors import PassError
from .graph import Op, Operand, Value
from .types import Dim, TensorType


@dataclass(frozen=True)
class GradContext:
    """What a rule is given besides the op: where its backward ops go (it emits like the builder it wraps, so the
    helpers below take either) and which operands need gradients (passed explicitly, as TVM's Relax gradient
    rules get their block builder, rather than patched onto the builder)."""

    fb: FunctionBuilder
    wants: tuple[bool, ...]

    def emit(self, kind: str, *operands: Operand, **attrs: object) -> Value | tuple[Value, ...]:
        return self.fb.emit(kind, *operands, **attrs)

    def constant(self, value: np.ndarray | float, dtype: DType | None = None) -> Value:
        return self.fb.constant(value, dtype)

    def wanted(self, i: int) -> bool:
        """Whether the caller needs the gradient of operand i."""
        return i < len(self.wants) and self.wants[i]

    def wanted_float(self, op: Op, i: int) -> bool:
        """Whether op's operand i exists, is floating (only floats have gradients) and its gradient is wanted."""
        return i < len(op.operands) and op.operands[i].type.dtype.is_float and self.wanted(i)


Emitter = FunctionBuilder | GradContext  # what the helpers emit through
Grads = tuple[Value | None, ...]  # one gradient (or None) per operand or result
GradientRule = Callable[[GradContext, Op, Grads], Grads]

BIG = 2**62  # a slice end past any real dim: numpy slicing clamps it to the dim


def gradient(*kinds: str) -> Callable[[GradientRule], GradientRule]:
    """Register the decorated function as the gradient rule of each op kind in `kinds`."""
    def register(rule: GradientRule) -> GradientRule:
        for kind in kinds:
            rules = registry.lookup(kind).rules
            if "grad" in rules:
                raise ValueError(f"op {kind!r} already has a gradient rule")
            rules["grad"] = rule
        return rule
    return register


# ---------------------------------------------------------------------------------------------------------------
# small emitters


def emit(fb: Emitter, kind: str, *operands, **attrs) -> Value:
    """A single-result op."""
    out = fb.emit(kind, *operands, **attrs)
    assert isinstance(out, Value), f"{kind} has several results"
    return out


def scalar(fb: Emitter, value: float, dtype: DType) -> Value:
    return fb.constant(value, dtype)


def is_float(o: Operand) -> bool:
    return o.type.dtype.is_float


def known_bool(fb: Emitter, o: Operand) -> bool | None:
    """A bool scalar fixed forever (a `constant`), else None. Flags count as unknown on purpose: a later state pass
    (`train`, `valid`) may flip them, so rules select on a flag at run time (`select`) instead of baking its
    current value into the backward."""
    if isinstance(o, Value) and o.owner is not None and o.owner.kind == "constant":
        value = o.owner.attrs["value"]
        return bool(value) if value.size == 1 else None
    return None


def select(fb: Emitter, cond: Operand, a: Value | None, b: Value | None) -> Value | None:
    """where(cond, a, b) for gradients; a missing side is zero, both missing is None."""
    if a is None and b is None:
        return None
    dtype = (a if a is not None else b).type.dtype  # type: ignore[union-attr]
    zero = scalar(fb, 0.0, dtype)
    return emit(fb, "where", cond, a if a is not None else zero, b if b is not None else zero)


def accumulate(fb: Emitter, a: Value | None, b: Value | None) -> Value | None:
    if a is None:
        return b
    return a if b is None else emit(fb, "add", a, b)


def transpose_last2(fb: Emitter, v: Operand) -> Value:
    r = v.type.rank
    return emit(fb, "transpose", v, perm=(*range(r - 2), r - 1, r - 2))


def reshape_target(shape: Sequence[Dim]) -> tuple[int, ...] | None:
    """A reshape target for `shape`, or None when it has more than one dynamic dim."""
    if sum(d is None for d in shape) > 1:
        return None
    return tuple(-1 if d is None else d for d in shape)


def reshape_to(fb: Emitter, v: Operand, shape: Sequence[Dim], what: str, like: Value | None = None) -> Value:
    """v reshaped to `shape`; with `like` (a value of that shape) its dynamic dims are copied from `like`, so any
    number of them is fine."""
    if like is not None and sum(d is None for d in shape) > 1:
        copy = tuple(a if d is None else -1 for a, d in enumerate(shape))
        return emit(fb, "reshape", v, like, shape=tuple(-1 if d is None else d for d in shape), copy=copy)
    target = reshape_target(shape)
    if target is None:
        raise PassError(f"{what}: the gradient needs a reshape to {TensorType(tuple(shape), v.type.dtype)}, which "
                        "has more than one dynamic dim and so no reshape target")
    return emit(fb, "reshape", v, shape=target)


def conform(fb: Emitter, v: Value, t: TensorType) -> Value:
    """v retyped to the static type t (a gradient computed with `?` dims for a value known to be static)."""
    if v.type == t or not t.is_static:
        return v
    return emit(fb, "reshape", v, shape=t.shape)


# ---------------------------------------------------------------------------------------------------------------
# broadcasting


def unbroadcast(fb: Emitter, grad: Value, target: TensorType) -> Value:
    """Sum a gradient of broadcast shape back to `target`'s shape: over the leading axes `target` lacks and, with
    kept dims, over axes where `target` has 1 and the gradient does not. `?` against `?` is assumed equal."""
    gs, ts = grad.type.shape, target.shape
    lead = len(gs) - len(ts)
    if lead < 0:
        raise PassError(f"unbroadcast: gradient {grad.type} has lower rank than its operand {target}")
    ones = tuple(lead + i for i, d in enumerate(ts) if d == 1 and gs[lead + i] != 1)
    out = grad
    if ones:
        out = emit(fb, "sum", out, axes=ones, keepdims=True)
    if lead:
        out = emit(fb, "sum", out, axes=tuple(range(lead)), keepdims=False)
    return out


def expand(fb: Emitter, g: Value, ref: Operand) -> Value:
    """Broadcast g (of rank <= ref's) to ref's shape, dynamic dims included; g keeps its dtype."""
    rs = ref.type.shape
    if tuple(g.type.shape) == rs:
        return g
    gs = (1,) * (len(rs) - g.type.rank) + tuple(g.type.shape)
    shape: list[int] = []
    dynamic = False
    for gd, rd in zip(gs, rs):
        if rd is None:
            dynamic |= gd == 1
            shape.append(-1)
        else:
            shape.append(rd)
    if not dynamic:
        return emit(fb, "broadcast_to", g, shape=tuple(shape))
    mask = emit(fb, "equal", ref, ref)  # true or false everywhere, either way selecting g: only its shape counts
    return emit(fb, "where", mask, g, g)


def fill(fb: Emitter, value: float, dtype: DType, shape: Sequence[Dim], ref: Operand | None = None
         ) -> Value:
    """A tensor of `shape` filled with `value`; its dynamic dims are those of `ref` (same rank) at the same axes."""
    shape = tuple(shape)
    if None not in shape:
        if value == 0:
            return emit(fb, "zeros", shape=shape, dtype=dtype)
        if value == 1:
            return emit(fb, "ones", shape=shape, dtype=dtype)
        return emit(fb, "full", shape=shape, dtype=dtype, value=float(value))
    if ref is None or ref.type.rank != len(shape):
        raise PassError(f"fill: no value of rank {len(shape)} to take the dynamic dims of {shape} from")
    r = ref
    cut = tuple(i for i, (d, rd) in enumerate(zip(shape, ref.type.shape)) if d is not None and rd not in (d, 1))
    if cut:
        r = emit(fb, "slice", r, starts=(0,) * len(cut), ends=(1,) * len(cut), axes=cut)
    c = scalar(fb, value, dtype)
    z = emit(fb, "where", emit(fb, "equal", r, r), c, c)
    if z.type.shape != shape:
        z = emit(fb, "broadcast_to", z, shape=tuple(-1 if d is None else d for d in shape))
    return z


def split_zeros(fb: Emitter, x: Operand) -> tuple[Value, Value]:
    """x's zeros as 1.0s (to count them) and x with its zeros replaced by 1 (to multiply the other factors)."""
    dt = x.type.dtype
    is_zero = emit(fb, "equal", x, scalar(fb, 0.0, dt))
    return emit(fb, "cast", is_zero, dtype=dt), emit(fb, "where", is_zero, scalar(fb, 1.0, dt), x)


def product_of_others(fb: Emitter, zeros: Value, nonzero: Value, group_product: Value, group_zeros: Value
                      ) -> Value:
    """Each factor's co-factor in a product (d product / d factor), from `split_zeros` of the factors and their
    group's product of nonzero factors and count of zeros (broadcast against them): the nonzero product over the
    factor where no other factor is zero, else 0, so a zero factor is never divided by."""
    alone = emit(fb, "equal", group_zeros, zeros)  # the factor's own zero, if any, is the group's only one
    return emit(fb, "where", alone, emit(fb, "div", group_product, nonzero), scalar(fb, 0.0, zeros.type.dtype))


def count(fb: Emitter, x: Operand, axes: Sequence[int], dtype: DType) -> Value:
    """The number of elements of x over `axes`: a scalar constant when static, else a keepdims tensor."""
    dims = [x.type.shape[a] for a in axes]
    if None not in dims:
        return scalar(fb, float(math.prod(dims)), dtype)  # type: ignore[arg-type]
    shape = tuple(d if i in axes else 1 for i, d in enumerate(x.type.shape))
    return emit(fb, "sum", fill(fb, 1.0, dtype, shape, x), axes=tuple(axes), keepdims=True)


# ---------------------------------------------------------------------------------------------------------------
# unit axes


def unsqueeze(fb: Emitter, v: Operand, axes: Sequence[int]) -> Value:
    """Insert unit dims at `axes` (positions in the result). A reshape when it has a target; else (several
    dynamic dims) a broadcast_to adding leading unit dims and a transpose moving them into place."""
    out_rank = v.type.rank + len(axes)
    axes = sorted(a % out_rank for a in axes)
    dims = iter(v.type.shape)
    shape = [1 if i in axes else next(dims) for i in range(out_rank)]
    target = reshape_target(shape)
    if target is not None:
        return emit(fb, "reshape", v, shape=target)
    k = len(axes)
    b = emit(fb, "broadcast_to", v, shape=(1,) * k + (-1,) * v.type.rank)
    perm, unit, src = [], 0, k
    for i in range(out_rank):
        if i in axes:
            perm.append(unit)
            unit += 1
        else:
            perm.append(src)
            src += 1
    return emit(fb, "transpose", b, perm=tuple(perm))


def squeeze(fb: Emitter, v: Operand, axes: Sequence[int]) -> Value:
    """Drop unit dims at `axes`: a reshape when it has a target, else a sum over them (which keeps the values)."""
    axes = sorted(a % v.type.rank for a in axes)
    shape = [d for i, d in enumerate(v.type.shape) if i not in axes]
    target = reshape_target(shape)
    if target is not None:
        return emit(fb, "reshape", v, shape=target)
    return emit(fb, "sum", v, axes=tuple(axes), keepdims=False)


# ---------------------------------------------------------------------------------------------------------------
# along one axis


def move_last(fb: Emitter, v: Operand, axis: int) -> Value:
    r = v.type.rank
    if axis == r - 1:
        return v  # type: ignore[return-value]
    return emit(fb, "transpose", v, perm=(*(i for i in range(r) if i != axis), axis))


def move_back(fb: Emitter, v: Value, axis: int) -> Value:
    """Inverse of move_last."""
    r = v.type.rank
    if axis == r - 1:
        return v
    return emit(fb, "transpose", v, perm=(*range(axis), r - 1, *range(axis, r - 1)))


def matmul_along(fb: Emitter, v: Operand, axis: int, matrix: np.ndarray) -> Value:
    """v's `axis` (length m) mapped through a constant [m, n] matrix M: out[.., j, ..] = sum_i v[.., i, ..] M[i, j]."""
    m = fb.constant(matrix.astype(v.type.dtype.numpy))
    moved = move_last(fb, v, axis)
    return move_back(fb, emit(fb, "matmul", moved, m), axis)


def slice_axis(fb: Emitter, v: Operand, axis: int, start: int, stop: int, step: int = 1) -> Value:
    return emit(fb, "slice", v, starts=(start,), ends=(stop,), axes=(axis,), steps=(step,))


def flip(fb: Emitter, v: Operand, axes: Sequence[int]) -> Value:
    n = len(axes)
    return emit(fb, "slice", v, starts=(-1,) * n, ends=(-BIG,) * n, axes=tuple(axes), steps=(-1,) * n)


def pad(fb: Emitter, v: Value, axis: int, before: int, after: int, value: float = 0.0) -> Value:
    """v with `before` and `after` constant elements added along `axis`."""
    if not before and not after:
        return v
    parts: list[Value] = []
    for n in (before, after):
        shape = list(v.type.shape)
        shape[axis] = n
        parts.append(fill(fb, value, v.type.dtype, shape, v) if n else None)  # type: ignore[arg-type]
    pieces = [p for p in (parts[0], v, parts[1]) if p is not None]
    return emit(fb, "concat", *pieces, axis=axis)


def dilate(fb: Emitter, v: Value, axis: int, stride: int) -> Value:
    """v[i] moved to i * stride along `axis` (length n * stride), zeros between."""
    n = v.type.shape[axis]
    if stride == 1:
        return v
    if n is None:
        raise PassError(f"dilate: the gradient needs a static length along axis {axis} of {v.type}")
    merged = list(v.type.shape)
    merged[axis] = n * stride
    if reshape_target(merged) is not None:
        u = unsqueeze(fb, v, [axis + 1])
        zshape = list(u.type.shape)
        zshape[axis + 1] = stride - 1
        z = fill(fb, 0.0, v.type.dtype, zshape, u)
        return reshape_to(fb, emit(fb, "concat", u, z, axis=axis + 1), merged, "dilate")
    matrix = np.zeros((n, n * stride))
    matrix[np.arange(n), np.arange(n) * stride] = 1
    return matmul_along(fb, v, axis, matrix)


def place(fb: Emitter, v: Value, axis: int, stride: int, offset: int, length: int) -> Value:
    """A zero tensor of `length` along `axis` holding v's elements at offset + i * stride (all inside)."""
    n = v.type.shape[axis]
    if n is None:
        raise PassError(f"place: the gradient needs a static length along axis {axis} of {v.type}")
    out = dilate(fb, v, axis, stride) if n > 0 else v
    cur = n * stride if n > 0 else 0
    out = pad(fb, out, axis, offset, 0)
    cur += offset
    if cur > length:
        out = slice_axis(fb, out, axis, 0, length)
    elif cur < length:
        out = pad(fb, out, axis, 0, length - cur)
    return out


# ---------------------------------------------------------------------------------------------------------------
# matmul


def matmul_grads(fb: Emitter, a: Operand, b: Operand, g: Value, want_a: bool, want_b: bool
                 ) -> tuple[Value | None, Value | None]:
    """Gradients of numpy-semantics `a @ b` (1-D operands promoted, batch dims broadcast) for output gradient g."""
    ra, rb = a.type.rank, b.type.rank
    if ra == 1 and rb == 1:  # a dot product: g is a scalar
        return (emit(fb, "mul", g, b) if want_a else None, emit(fb, "mul", g, a) if want_b else None)
    a2 = a if ra > 1 else reshape_to(fb, a, (1, a.type.shape[0]), "matmul")
    b2 = b if rb > 1 else reshape_to(fb, b, (b.type.shape[0], 1), "matmul")
    g2 = g
    if ra == 1:
        g2 = unsqueeze(fb, g2, [g2.type.rank - 1])
    if rb == 1:
        g2 = unsqueeze(fb, g2, [g2.type.rank])
    da = db = None
    if want_a:
        da = unbroadcast(fb, emit(fb, "matmul", g2, transpose_last2(fb, b2)), a2.type)
        if ra == 1:
            da = reshape_to(fb, da, a.type.shape, "matmul")
    if want_b:
        k, n = a2.type.shape[-1], g2.type.shape[-1]
        if rb == 2 and a2.type.rank > 2 and k is not None and n is not None:
            # [..., m, k] x [..., m, n] contracted over all leading dims at once: one [k, M] @ [M, n]
            flat_a = emit(fb, "reshape", a2, shape=(-1, k))
            flat_g = emit(fb, "reshape", g2, shape=(-1, n))
            db = emit(fb, "matmul", transpose_last2(fb, flat_a), flat_g)
        else:
            db = unbroadcast(fb, emit(fb, "matmul", transpose_last2(fb, a2), g2), b2.type)
        if rb == 1:
            db = reshape_to(fb, db, b.type.shape, "matmul")
    return da, db
