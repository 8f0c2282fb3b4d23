"""Data movement ops: transpose, reshape, broadcast_to, concat, slice, take, gather, tile and scatter_nd; and
scatter_nd_reduce, which combines its updates into data (add, mul, max, min) and so computes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..attrs import INT, INTS, Attr, one_of, optional
from ..dtypes import DType
from ..errors import ShapeError
from ..traits import Trait
from ..types import TensorType, broadcast_axes
from .common import any_dtype, define, norm_axis, one, same_dtype

_MOVES = {Trait.DATA_MOVEMENT}


def transpose_perm(perm: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    """A transpose's permutation of `rank` dims: its `perm`, or the dims reversed when `perm` is absent (the one
    place that default is read, so inference, passes and lowerings agree)."""
    return tuple(reversed(range(rank))) if perm is None else tuple(perm)


def _transpose_infer(ts, attrs):
    any_dtype("transpose", 0, ts[0])
    rank = ts[0].rank
    perm = transpose_perm(attrs["perm"], rank)
    if sorted(perm) != list(range(rank)):
        raise ShapeError(f"transpose: perm {list(perm)} is not a permutation of rank {rank}")
    return (ts[0].with_axes(ts[0].axes[p] for p in perm),)


define("transpose", ("x",), _transpose_infer, one(lambda x, perm: np.transpose(x, perm)),
       {"perm": Attr(optional(INTS), None, "absent reverses the dims")}, traits=_MOVES)


def reshape_dims(attrs, like: tuple | None) -> list:
    """The reshape target with each `copy` dim replaced by that dim of `like` (an int, None or a run-time size):
    the one place the `copy` attribute is read, so inference, reference and lowerings agree."""
    shape, copy = attrs["shape"], attrs["copy"]
    if not copy:
        if like is not None:
            raise ShapeError("reshape: operand `like` is given but `copy` is empty")
        return list(shape)
    if like is None:
        raise ShapeError(f"reshape: copy {list(copy)} needs operand `like`")
    if len(copy) != len(shape):
        raise ShapeError(f"reshape: copy {list(copy)} needs one entry per dim of shape {list(shape)}")
    out = []
    for d, c in zip(shape, copy):
        if c < -1 or c >= len(like):
            raise ShapeError(f"reshape: copy axis {c} is out of range for `like` of rank {len(like)}")
        if c >= 0 and d != -1:
            raise ShapeError(f"reshape: a copied dim must be -1 in shape {list(shape)}, not {d}")
        out.append(like[c] if c >= 0 else d)
    return out


def _reshape_infer(ts, attrs):
    any_dtype("reshape", 0, ts[0])
    dims = reshape_dims(attrs, ts[1].axes if len(ts) > 1 else None)  # copied dims are never negative
    if dims.count(-1) > 1 or any(isinstance(d, int) and d < -1 for d in dims):
        raise ShapeError(f"reshape: shape {list(attrs['shape'])} may hold one -1 (besides copied dims) and no "
                         "other negative dim")
    if not all(isinstance(d, int) for d in dims):  # a copied run-time dim (and its name): the inferred one is
        return (ts[0].with_axes(None if d == -1 else d for d in dims),)  # known only at run time too
    known = 1
    for d in dims:
        known *= d if d >= 0 else 1
    if ts[0].is_static:
        n = ts[0].numel()
        if -1 in dims:
            if known == 0 or n % known:
                raise ShapeError(f"reshape: cannot reshape {ts[0]} to {dims}")
            return (ts[0].with_shape(n // known if d == -1 else d for d in dims),)
        if n != known:
            raise ShapeError(f"reshape: {ts[0]} has {n} elements but shape {dims} has {known}")
    return (ts[0].with_shape(None if d == -1 else d for d in dims),)


def _reshape(xs, attrs):
    return (np.reshape(xs[0], reshape_dims(attrs, xs[1].shape if len(xs) > 1 else None)),)


define("reshape", ("x", "like?"), _reshape_infer, _reshape,
       {"shape": Attr(INTS, doc="target shape; one -1 is inferred"),
        "copy": Attr(INTS, (), "per target dim, the axis of `like` whose size it takes (-1: from shape), so a "
                               "target may keep several run-time dims")},
       traits=_MOVES)


def _broadcast_target(x: tuple, shape: tuple[int, ...]) -> tuple:
    """-1 in the target keeps the (right-aligned) input dim, so a dynamic batch can broadcast."""
    if len(shape) < len(x):
        raise ShapeError(f"broadcast_to: target rank {len(shape)} is below input rank {len(x)}")
    pad = (1,) * (len(shape) - len(x)) + tuple(x)
    return tuple(p if d == -1 else d for d, p in zip(shape, pad))


def _broadcast_infer(ts, attrs):
    any_dtype("broadcast_to", 0, ts[0])
    target = _broadcast_target(ts[0].axes, attrs["shape"])  # a kept (-1) dim keeps its name
    if any(isinstance(d, int) and d < 0 for d in target):
        raise ShapeError(f"broadcast_to: invalid target shape {list(attrs['shape'])}")
    pad = (1,) * (len(target) - ts[0].rank) + tuple(ts[0].shape)
    for i, (d, t) in enumerate(zip(pad, target)):
        if d is not None and isinstance(t, int) and d not in (1, t):  # a dim of n > 1 can only stay n
            raise ShapeError(f"broadcast_to: input {ts[0]} cannot broadcast to {list(attrs['shape'])} "
                             f"(dim {i}: {d} vs {t})")
    return (ts[0].with_axes(broadcast_axes(ts[0].axes, target, what="broadcast_to")),)


define("broadcast_to", ("x",), _broadcast_infer,
       one(lambda x, shape: np.broadcast_to(x, _broadcast_target(x.shape, shape)).copy()),
       {"shape": Attr(INTS, doc="target shape; -1 keeps the input's dim")}, traits=_MOVES)


def _concat_infer(ts, attrs):
    for i, t in enumerate(ts):
        any_dtype("concat", i, t)
        if t.rank != ts[0].rank:
            raise ShapeError(f"concat: operand {i} has rank {t.rank} but operand 0 has {ts[0].rank}")
    same_dtype("concat", ts)
    axis = norm_axis("concat", attrs["axis"], ts[0].rank)
    shape = list(ts[0].axes)
    for d in range(ts[0].rank):
        dims = [t.axes[d] for t in ts]
        if d == axis:
            shape[d] = sum(dims) if all(isinstance(x, int) for x in dims) else None
        else:  # every operand's dim is the result's: an int, else the one name given (two names: anonymous)
            known = {x for x in dims if isinstance(x, int)}
            if len(known) > 1:
                raise ShapeError(f"concat: operands differ in dim {d}: {[t.shape[d] for t in ts]}")
            names = {x for x in dims if isinstance(x, str)}
            shape[d] = known.pop() if known else names.pop() if len(names) == 1 else None
    return (TensorType.of(shape, ts[0].dtype),)


define("concat", ("xs*",), _concat_infer, lambda xs, attrs: (np.concatenate(xs, axis=attrs["axis"]),),
       {"axis": Attr(INT, 0)}, traits=_MOVES)


OPEN_END = 2**31 - 1  # a slice bound this far out (either sign) is an open end: "to the end" of any dim, dynamic too


def _bound(b: int) -> int | None:
    """A slice bound, or None (the open end) for one at or beyond OPEN_END."""
    return None if abs(b) >= OPEN_END else b


def slice_cuts(op: str, rank: int, attrs) -> dict[int, slice]:
    """The slice op's cut per normalized axis, open ends as None, so every consumer reads "to the end" of a
    dim of any size (a dynamic one too) the same way."""
    starts, ends = attrs["starts"], attrs["ends"]
    axes = attrs["axes"] if attrs["axes"] is not None else tuple(range(len(starts)))
    steps = attrs["steps"] if attrs["steps"] is not None else (1,) * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ShapeError(f"{op}: starts, ends, axes and steps must have the same length")
    if 0 in steps:
        raise ShapeError(f"{op}: a step of 0 is not allowed")
    out = {norm_axis(op, a, rank): slice(_bound(s), _bound(e), st) for a, s, e, st in zip(axes, starts, ends, steps)}
    if len(out) != len(axes):
        raise ShapeError(f"{op}: repeated axis in {list(axes)}")
    return out


def _slice_infer(ts, attrs):
    any_dtype("slice", 0, ts[0])
    cuts = slice_cuts("slice", ts[0].rank, attrs)
    shape = tuple(d if i not in cuts or d is None else len(range(*cuts[i].indices(d)))
                  for i, d in enumerate(ts[0].shape))
    return (ts[0].with_shape(shape),)


def _slice(x, **attrs):
    cuts = slice_cuts("slice", x.ndim, attrs)
    return x[tuple(cuts.get(i, slice(None)) for i in range(x.ndim))]


define("slice", ("x",), _slice_infer, one(_slice),
       {"starts": Attr(INTS), "ends": Attr(INTS), "axes": Attr(optional(INTS), None),
        "steps": Attr(optional(INTS), None)},
       doc="numpy basic slicing along the given axes (clamped, negative indices count from the end)", traits=_MOVES)


def _index_dtype(op: str, t: TensorType) -> None:
    if t.dtype not in (DType.i64, DType.i32):
        raise ShapeError(f"{op}: operand 1 (indices) has dtype {t.dtype.value}, expected i64 or i32")


def _take_infer(ts, attrs):
    any_dtype("take", 0, ts[0])
    _index_dtype("take", ts[1])
    axis = norm_axis("take", attrs["axis"], ts[0].rank)
    return (ts[0].with_axes((*ts[0].axes[:axis], *ts[1].axes, *ts[0].axes[axis + 1:])),)


define("take", ("x", "indices"), _take_infer,
       one(lambda x, i, axis: np.take(x, i, axis=axis, mode="raise")), {"axis": Attr(INT, 0)},
       doc="select slices along axis by index, numpy.take (embedding lookup): indices in [-n, n), negatives from "
           "the end as ONNX Gather counts them; the reference refuses others, TVM's kernel clamps them", traits=_MOVES)


def _gather_infer(ts, attrs):
    any_dtype("gather", 0, ts[0])
    _index_dtype("gather", ts[1])
    if ts[1].rank != ts[0].rank:
        raise ShapeError(f"gather: indices rank {ts[1].rank} differs from input rank {ts[0].rank}")
    axis = norm_axis("gather", attrs["axis"], ts[0].rank)
    for d, (n, m) in enumerate(zip(ts[0].shape, ts[1].shape)):
        if d != axis and n is not None and m is not None and n != m:  # the reference does not broadcast them
            raise ShapeError(f"gather: operand 1 (indices) has dim {d} = {m} but input has {n}")
    return (ts[0].with_axes(ts[1].axes),)


define("gather", ("x", "indices"), _gather_infer,
       one(lambda x, i, axis: np.take_along_axis(x, i, axis=axis)), {"axis": Attr(INT, 0)},
       doc="pick one element along axis per index position, torch.gather", traits=_MOVES)


def _tile_infer(ts, attrs):
    any_dtype("tile", 0, ts[0])
    repeats = attrs["repeats"]
    if len(repeats) != ts[0].rank or any(r < 0 for r in repeats):
        raise ShapeError(f"tile: repeats {list(repeats)} must hold one count >= 0 per dim of {ts[0]}")
    return (ts[0].with_shape(None if d is None else d * r for d, r in zip(ts[0].shape, repeats)),)


define("tile", ("x",), _tile_infer, one(lambda x, repeats: np.tile(x, repeats)),
       {"repeats": Attr(INTS, doc="copies along each dim")}, doc="numpy.tile with one count per dim (ONNX Tile)",
       traits=_MOVES)


def _scatter_nd_infer(op: str):
    """Typing of ONNX's ScatterND: data [*D], indices [*I, q] (q <= rank, static), updates [*I, *D[q:]]."""
    def infer(ts, attrs):
        data, idx, updates = ts
        any_dtype(op, 0, data)
        _index_dtype(op, idx)
        if updates.dtype is not data.dtype:
            raise ShapeError(f"{op}: operand 2 (updates) has dtype {updates.dtype.value} but data has "
                             f"{data.dtype.value}; insert a cast")
        q = idx.shape[-1] if idx.rank else None
        if q is None or q > data.rank:
            raise ShapeError(f"{op}: operand 1 (indices) {idx} needs a static last dim of at most the rank of "
                             f"data {data}")
        want = (*idx.shape[:-1], *data.shape[q:])
        if len(want) != updates.rank or any(a is not None and b is not None and a != b
                                            for a, b in zip(want, updates.shape)):
            raise ShapeError(f"{op}: operand 2 (updates) is {updates} but indices {idx} into data {data} "
                             f"need shape {['?' if d is None else d for d in want]}")
        return (data,)
    return infer


def _scatter_nd(data, idx, updates):
    out = data.copy()
    for pos in np.ndindex(*idx.shape[:-1]):
        out[tuple(idx[pos])] = updates[pos]  # later positions win, as ONNX's reference loop writes them
    return out


define("scatter_nd", ("data", "indices", "updates"), _scatter_nd_infer("scatter_nd"), one(_scatter_nd),
       doc="data with the slices indices[..., :] (negatives from the end) replaced by updates (ONNX ScatterND, "
           "reduction none; with repeated indices the last update wins)", traits=_MOVES)

_COMBINE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_nd_reduce(data, idx, updates, *, reduction):
    """Each update combined into the slice its index names, repeated indices one after another (numpy's ufunc.at)."""
    out = data.copy()
    q = idx.shape[-1]
    at = tuple(np.where(i < 0, i + n, i) for i, n in zip(np.moveaxis(idx, -1, 0), data.shape[:q]))
    _COMBINE[reduction].at(out, at, updates)
    return out


define("scatter_nd_reduce", ("data", "indices", "updates"), _scatter_nd_infer("scatter_nd_reduce"),
       one(_scatter_nd_reduce), {"reduction": Attr(one_of(*_COMBINE))},
       doc="data with updates combined into the slices indices[..., :] names (ONNX ScatterND's reduction add, mul, "
           "max or min; repeated indices combine every update)")
