"""numpy indexing (`x[0]`, `x[:, 1:3]`, `x[..., None]`, `x[mask]`) planned as registered ops on a static shape.

A plan is one `slice` op, a `take` per integer index and a `reshape` for new axes, or, for a boolean mask whose
value is known now, a flattening `reshape` and one `take` of the True positions. Planning only reads the shape,
so an index at fault is named before anything runs; `Tensor.__getitem__` emits the plan.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir.ops.shape import OPEN_END
from kiln.ir.types import Dim


@dataclass(frozen=True)
class IndexPlan:
    """The ops indexing emits, in order; an empty part emits nothing."""

    slice: dict[str, tuple[int, ...]] | None  # attributes of the one slice op
    takes: tuple[tuple[int, int], ...]  # (axis, index) in emission order, highest axis first
    reshape: tuple[int, ...] | None  # the target of the final reshape (-1 for the one dynamic dim)
    mask: np.ndarray | None = None  # flat i64 positions taken along axis 0 after `reshape` (a boolean mask)


def reshape_target(shape: tuple[Dim, ...], why: str) -> tuple[int, ...]:
    """`shape` as a reshape target: its one dynamic dim becomes -1; more than one is an error."""
    if sum(d is None for d in shape) > 1:
        raise IndexError(f"{why} reshapes to {list(shape)}, which has more than one dynamic dim")
    return tuple(-1 if d is None else d for d in shape)


def plan_mask(shape: tuple[Dim, ...], mask: np.ndarray) -> IndexPlan:
    """`x[mask]` for a boolean mask over x's leading dims: the result has one dim of mask.sum() entries."""
    lead = shape[:mask.ndim]
    if mask.ndim == 0 or mask.ndim > len(shape) or lead != mask.shape:
        raise IndexError(f"boolean mask of shape {list(mask.shape)} does not match the leading dims of a tensor of "
                         f"shape {list(shape)}")
    flat = reshape_target((math.prod(mask.shape), *shape[mask.ndim:]), "a boolean mask")
    return IndexPlan(None, (), flat if mask.ndim > 1 else None, np.flatnonzero(mask).astype(np.int64))


def _expand(shape: tuple[Dim, ...], key: tuple) -> tuple:
    """The key with its ellipsis (or the trailing axes it leaves out) spelled as full slices."""
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(k is not None and k is not Ellipsis for k in key)
    if used > len(shape):
        raise IndexError(f"too many indices for a tensor of rank {len(shape)}: {used} given")
    fill = (slice(None),) * (len(shape) - used)
    at = next((i for i, k in enumerate(key) if k is Ellipsis), None)  # by identity: a Tensor's == builds a tensor
    if at is None:
        return (*key, *fill)
    return (*key[:at], *fill, *key[at + 1:])


def _integer(k: Any) -> int | None:
    """`k` as an integer index, None for a slice or None; anything else is refused."""
    if k is None or isinstance(k, slice):
        return None
    if isinstance(k, (bool, np.bool_)):
        raise IndexError(f"a boolean scalar index ({k!r}) is not supported; index with a boolean mask array")
    try:
        return operator.index(k)
    except TypeError:
        raise IndexError(f"unsupported index {k!r}: use integers, slices, '...' or None "
                         "(a boolean mask must be the whole index)") from None


def plan(shape: tuple[Dim, ...], key: Any) -> IndexPlan:
    """The ops for `x[key]` with x of `shape` (basic numpy indexing: integers, slices, '...', None)."""
    starts, ends, axes, steps = [], [], [], []
    takes: list[tuple[int, int]] = []
    out: list[Dim] = []
    axis = 0
    items = _expand(shape, key if isinstance(key, tuple) else (key,))
    for k in items:
        if k is None:
            out.append(1)
            continue
        d, i = shape[axis], _integer(k)
        if i is not None:
            if d is not None and not -d <= i < d:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {d}")
            if d is None and i < 0:  # a negative index on a dynamic dim: slice one element, then take it
                starts.append(i), ends.append(i + 1 if i != -1 else OPEN_END), axes.append(axis), steps.append(1)
                i = 0
            takes.append((axis, i % d if d is not None else i))
        elif k != slice(None):
            step = 1 if k.step is None else operator.index(k.step)
            if step == 0:
                raise IndexError(f"slice step cannot be zero (axis {axis})")
            start = (0 if step > 0 else -1) if k.start is None else operator.index(k.start)
            end = (OPEN_END if step > 0 else -OPEN_END) if k.stop is None else operator.index(k.stop)
            starts.append(start), ends.append(end), axes.append(axis), steps.append(step)
            out.append(None if d is None else len(range(*slice(start, end, step).indices(d))))
        else:
            out.append(d)
        axis += 1
    cut = dict(starts=tuple(starts), ends=tuple(ends), axes=tuple(axes), steps=tuple(steps)) if starts else None
    new_axes = any(k is None for k in items)
    return IndexPlan(cut, tuple(reversed(takes)),
                     reshape_target(tuple(out), "indexing with None") if new_axes else None)
