"""Spatial ops no composition of others expresses well: `pad` (constant, reflect or edge; a negative pad crops)
and `resize` (nearest, linear or cubic over the spatial dims of NC... input, with ONNX's coordinate transformations
and antialiasing)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..attrs import BOOL, FLOAT, INTS, Attr, one_of, optional
from ..errors import ShapeError
from ..traits import Trait
from ..types import TensorType
from .common import any_dtype, define, floating, one

# --- pad

PAD_MODES = ("constant", "reflect", "edge")


def _pad_infer(ts: list[TensorType], attrs: dict[str, Any]) -> tuple[TensorType]:
    """One (before, after) pair per axis; each axis keeps what the crops leave, then grows by the pads."""
    x = ts[0]
    any_dtype("pad", 0, x)
    before, after, mode = attrs["before"], attrs["after"], attrs["mode"]
    if len(before) != x.rank or len(after) != x.rank:
        raise ShapeError(f"pad: before = {list(before)} and after = {list(after)} must hold one int per axis of "
                         f"operand 0 (x), {x}")
    shape = []
    for axis, (d, b, a) in enumerate(zip(x.shape, before, after)):
        if d is None:
            shape.append(None)
            continue
        kept = d + min(b, 0) + min(a, 0)
        if kept < 0:
            raise ShapeError(f"pad: axis {axis} crops {-min(b, 0) - min(a, 0)} elements of operand 0 (x), {x}")
        grow = max(b, 0) + max(a, 0)
        if grow and mode == "reflect" and max(b, a) >= kept:
            raise ShapeError(f"pad: reflect pads {max(b, a)} along axis {axis}, which needs more than {kept} "
                             "elements there")
        if grow and mode == "edge" and kept == 0:
            raise ShapeError(f"pad: edge mode has no element to repeat along axis {axis} of operand 0 (x), {x}")
        shape.append(kept + grow)
    return (x.with_shape(tuple(shape)),)


def crop_and_widths(shape: tuple[int, ...], before: tuple[int, ...], after: tuple[int, ...]
                    ) -> tuple[tuple[slice, ...], list[tuple[int, int]]]:
    """What a pad keeps of x (negative pads) and the (before, after) widths it then adds (positive pads)."""
    crop = tuple(slice(max(-b, 0), d - max(-a, 0)) for d, b, a in zip(shape, before, after))
    return crop, [(max(b, 0), max(a, 0)) for b, a in zip(before, after)]


def _pad(x: np.ndarray, *, before, after, mode, value) -> np.ndarray:
    crop, widths = crop_and_widths(x.shape, before, after)
    kept = x[crop]
    if mode == "constant":
        return np.pad(kept, widths, constant_values=np.asarray(value).astype(x.dtype))
    return np.pad(kept, widths, mode=mode)


define("pad", ("x",), _pad_infer, one(_pad),
       {"before": Attr(INTS, doc="per axis; negative crops"), "after": Attr(INTS, doc="per axis; negative crops"),
        "mode": Attr(one_of(*PAD_MODES), "constant"), "value": Attr(FLOAT, 0.0, "the constant mode's fill")},
       doc="pad each axis before and after (constant value, reflection without the edge, or the edge repeated); "
           "negative pads crop first", traits={Trait.DATA_MOVEMENT})


# --- resize

RESIZE_MODES = ("nearest", "linear", "cubic")
COORDINATE_MODES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn",
                    "half_pixel_symmetric", "tf_crop_and_resize")
NEAREST_MODES = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def _resize_infer(ts: list[TensorType], attrs: dict[str, Any]) -> tuple[TensorType]:
    """x [N, C, *S] with static S -> [N, C, *size]."""
    x = ts[0]
    floating("resize", 0, x)
    nd = x.rank - 2
    if nd < 1:
        raise ShapeError(f"resize: operand 0 (x) must be [N, C, *spatial], got {x}")
    size, scales = attrs["size"], attrs["scales"]
    if len(size) != nd or any(s < 1 for s in size):
        raise ShapeError(f"resize: size = {list(size)} must hold {nd} positive ints, one per spatial dim of {x}")
    if scales is not None and (len(scales) != nd or any(not s > 0 for s in scales)):
        raise ShapeError(f"resize: scales = {list(scales)} must hold {nd} positive numbers")
    if (attrs["coordinate_mode"] == "tf_crop_and_resize") != (attrs["roi"] is not None) or (
            attrs["roi"] is not None and len(attrs["roi"]) != 2 * nd):
        raise ShapeError(f"resize: coordinate_mode {attrs['coordinate_mode']} takes roi = {attrs['roi']} (tf_crop_and_"
                         f"resize needs {2 * nd} numbers, the starts then the ends of the spatial dims; others none)")
    if any(d is None or d < 1 for d in x.shape[2:]):
        raise ShapeError(f"resize: operand 0 (x) needs static, non-empty spatial dims, got {x}")
    return (x.with_shape((*x.shape[:2], *size)),)


def _source(i: np.ndarray, n_in: int, n_out: int, scale: float, coordinate_mode: str,
            roi: tuple[float, float] | None) -> np.ndarray:
    """The input coordinate each output index i samples (ONNX's coordinate_transformation_mode; its "resized
    length" is n_in * scale, which a scale that does not hit an integer size makes fractional)."""
    if coordinate_mode == "align_corners":
        length = n_in * scale
        return i * (n_in - 1) / (length - 1) if n_out > 1 else np.zeros_like(i)
    if coordinate_mode == "tf_crop_and_resize":  # the roi [start, end] (fractions of n_in - 1) spread over the length
        start, end = roi  # type: ignore[misc]
        length = n_in * scale
        step = i * (end - start) / (length - 1) if n_out > 1 else np.full_like(i, (end - start) / 2)
        return (start + step) * (n_in - 1)
    if coordinate_mode == "half_pixel_symmetric":  # half_pixel, re-centred on the part of the length kept
        return n_in / 2 * (1 - n_out / (n_in * scale)) + (i + 0.5) / scale - 0.5
    if coordinate_mode == "asymmetric":
        return i / scale
    if coordinate_mode == "tf_half_pixel_for_nn":
        return (i + 0.5) / scale
    if coordinate_mode == "pytorch_half_pixel" and n_out == 1:
        return np.zeros_like(i)
    return (i + 0.5) / scale - 0.5


def _cubic(d: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel with coefficient a at distances d (zero from 2 on)."""
    d = np.abs(d)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def resize_taps(attrs: dict[str, Any], k: int, n_in: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Along spatial axis k (of n_in elements), for each output index: the input indices it reads and their
    weights, both [taps, n_out] (nearest: one tap of weight 1; linear: two; cubic: four; antialias widens a
    shrinking axis's filter by 1 / scale), and which outputs take the extrapolation value instead
    (tf_crop_and_resize's samples outside the input; None in other modes). The one statement of resize's
    arithmetic: the reference, the gradient and the lowerings all read it. Taps beyond the edges read the edge
    element, or under exclude_outside get weight 0 (the rest rescaled)."""
    n_out, nd, roi = attrs["size"][k], len(attrs["size"]), attrs["roi"]
    scale = (attrs["scales"][k] if attrs["scales"] is not None else None) or n_out / n_in
    x = _source(np.arange(n_out, dtype=np.float64), n_in, n_out, scale, attrs["coordinate_mode"],
                None if roi is None else (roi[k], roi[nd + k]))
    outside = None if roi is None else (x < 0) | (x > n_in - 1)
    idx, w = _taps(x, n_in, n_out, scale, attrs)
    return idx, w, outside


def _taps(x: np.ndarray, n_in: int, n_out: int, scale: float, attrs: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The indices and weights sampling source coordinates x."""
    mode = attrs["mode"]
    if mode == "nearest":
        rounding = {"round_prefer_floor": lambda v: np.ceil(v - 0.5), "round_prefer_ceil": lambda v: np.floor(v + 0.5),
                    "floor": np.floor, "ceil": np.ceil}[attrs["nearest_mode"]]
        return np.clip(rounding(x), 0, n_in - 1).astype(np.int64)[None], np.ones((1, n_out))
    if mode == "linear" and not (attrs["antialias"] and scale < 1):
        x = np.clip(x, 0, n_in - 1)
        lo = np.floor(x).astype(np.int64)
        w = x - lo
        return np.stack([lo, np.minimum(lo + 1, n_in - 1)]), np.stack([1 - w, w])
    # a window of taps around x; ONNX takes the ratio in (0, 1], so an integral x sits at the window's right
    ratio = np.where(x == np.floor(x), 1.0, x - np.floor(x))
    base = np.round(x - ratio).astype(np.int64)
    shrink = min(scale, 1.0) if attrs["antialias"] else 1.0
    reach = 1 if mode == "linear" else 2  # the kernel's support
    start = int(np.floor(-reach / shrink)) + 1
    offsets = np.arange(start, 1 - start + 1)[:, None]
    d = (offsets - ratio[None]) * shrink
    w = np.clip(1 - np.abs(d), 0, 1) if mode == "linear" else _cubic(d, attrs["cubic_coeff_a"])
    w = w / w.sum(axis=0)
    idx = base[None] + offsets
    if attrs["exclude_outside"]:
        w = np.where((idx >= 0) & (idx < n_in), w, 0.0)
        w = w / w.sum(axis=0)
    return np.clip(idx, 0, n_in - 1), w


def resize_matrix(attrs: dict[str, Any], k: int, n_in: int) -> np.ndarray:
    """The [n_in, n_out] matrix spatial axis k multiplies by, extrapolated outputs' columns zero (its gradient
    multiplies by the transpose)."""
    idx, w, outside = resize_taps(attrs, k, n_in)
    if outside is not None:
        w = np.where(outside, 0.0, w)
    m = np.zeros((n_in, w.shape[1]))
    np.add.at(m, (idx, np.broadcast_to(np.arange(w.shape[1]), idx.shape)), w)
    return m


def _resize(xs, attrs):
    """Axis by axis: gather the taps, then blend them with their weights in x's dtype (nearest only gathers);
    extrapolated outputs then take the extrapolation value."""
    y = xs[0]
    for axis, n_out in enumerate(attrs["size"], 2):
        idx, w, outside = resize_taps(attrs, axis - 2, y.shape[axis])
        shape = [1] * y.ndim
        shape[axis] = n_out
        if attrs["mode"] == "nearest":
            y = np.take(y, idx[0], axis=axis)
        else:
            total = None
            for i, wi in zip(idx, w):
                term = np.take(y, i, axis=axis) * wi.reshape(shape).astype(y.dtype)
                total = term if total is None else total + term
            y = total
        if outside is not None:
            y = np.where(outside.reshape(shape), np.asarray(attrs["extrapolation"], y.dtype), y)
    return (y,)


define("resize", ("x",), _resize_infer, _resize,
       {"size": Attr(INTS, doc="output spatial dims"),
        "scales": Attr(optional(lambda v: tuple(FLOAT(s) for s in v)), None,
                       "the coordinate scale per spatial dim; absent means size / input size"),
        "mode": Attr(one_of(*RESIZE_MODES), "nearest"),
        "coordinate_mode": Attr(one_of(*COORDINATE_MODES), "half_pixel"),
        "nearest_mode": Attr(one_of(*NEAREST_MODES), "round_prefer_floor"),
        "cubic_coeff_a": Attr(FLOAT, -0.75, "the cubic kernel's coefficient (-0.5: Keys, -0.75: torch's bicubic)"),
        "exclude_outside": Attr(BOOL, False, "taps beyond the edges weigh 0 (the others rescaled to sum 1)"),
        "antialias": Attr(BOOL, False, "linear and cubic widen their filter by 1 / scale on a shrinking axis"),
        "roi": Attr(optional(lambda v: tuple(FLOAT(s) for s in v)), None,
                    "tf_crop_and_resize's region: starts then ends per spatial dim, fractions of (size - 1)"),
        "extrapolation": Attr(FLOAT, 0.0, "tf_crop_and_resize's value where a sample falls outside x")},
       doc="nearest, linear or cubic resampling of the spatial dims of x [N, C, *S] to `size`, axis by axis")
