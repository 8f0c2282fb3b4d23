"""Converters of ONNX's Resize (opsets 10 to 19) and Upsample (7 to 9) into kiln's `resize`.

kiln resizes the spatial dims (all but N and C), nearest, linear or cubic; `roi` only matters to
tf_crop_and_resize (it becomes the op's `roi` over the spatial dims), so other modes ignore it. Resize-10 and
Upsample sample asymmetrically and round nearest as ONNX Runtime's "simple" mode does: down when enlarging, up
when shrinking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.ir import Value
from kiln.ir.ops.spatial import COORDINATE_MODES, NEAREST_MODES

from .call import NodeCall
from .registry import Unsupported, converts


def _spatial_scales(x: Value, scales: Sequence[float]) -> tuple[float, ...]:
    """The scales of x's spatial dims; N and C must keep their size."""
    if len(scales) != x.type.rank:
        raise Unsupported(f"scales = {list(scales)} does not hold one value per dim of {x.type}")
    if any(float(s) != 1.0 for s in scales[:2]):
        raise Unsupported(f"scales = {list(scales)} resizes the batch or channel dim")
    return tuple(float(s) for s in scales[2:])


def _by_scales(call: NodeCall, x: Value, scales: Sequence[float], **modes: str) -> Value:
    size = tuple(int(np.floor(n * s)) for n, s in zip(_static(x), scales))
    return call.emit("resize", x, size=size, scales=tuple(scales), **modes)


def _static(x: Value) -> tuple[int, ...]:
    dims = x.type.shape[2:]
    if x.type.rank < 3 or any(d is None for d in dims):
        raise Unsupported(f"input {x.type} needs static spatial dims")
    return tuple(dims)  # type: ignore[arg-type]


def _mode(call: NodeCall, modes: Sequence[str] = ("nearest", "linear", "bilinear")) -> str:
    mode = call.attr("mode", "nearest")
    if mode not in modes:
        raise Unsupported(f"mode = {mode!r}; kiln resizes {', '.join(m for m in modes if m != 'bilinear')} here")
    return "linear" if mode == "bilinear" else mode


def _simple(call: NodeCall, x: Value, scales: Sequence[float]) -> Value:
    """Resize-10 and Upsample: asymmetric coordinates; nearest as ONNX Runtime's simple rounding."""
    spatial = _spatial_scales(x, scales)
    mode = _mode(call)
    if mode == "linear":
        return _by_scales(call, x, spatial, mode=mode, coordinate_mode="asymmetric")
    if len({s >= 1 for s in spatial}) > 1:
        raise Unsupported(f"scales = {list(scales)} both enlarge and shrink, which ONNX Runtime rounds differently")
    rounding = "floor" if spatial[0] >= 1 else "ceil"
    return _by_scales(call, x, spatial, coordinate_mode="asymmetric", nearest_mode=rounding)


@converts("Upsample", since=7, until=9)
def _upsample(call: NodeCall) -> Value:
    x = call.input(0)
    scales = call.attr("scales") if call.opset < 9 else call.value(1, "the scales")
    return _simple(call, x, list(np.asarray(scales, np.float64)))


@converts("Resize", since=10, until=10)
def _resize_10(call: NodeCall) -> Value:
    return _simple(call, call.input(0), list(np.asarray(call.value(1, "the scales"), np.float64)))


def _roi(call: NodeCall, rank: int, axes: Sequence[int]) -> tuple[float, ...]:
    """tf_crop_and_resize's roi (starts then ends of `axes`) as the op's starts then ends of the spatial dims;
    N and C must be whole ([0, 1])."""
    roi = call.value(1, "the roi")
    if roi is None or roi.size != 2 * len(axes):
        got = "none" if roi is None else list(roi.tolist())
        raise Unsupported(f"tf_crop_and_resize needs a roi of {2 * len(axes)} numbers, got {got}")
    starts, ends = [0.0] * rank, [1.0] * rank
    for a, lo, hi in zip(axes, roi[:len(axes)].tolist(), roi[len(axes):].tolist()):
        starts[a], ends[a] = lo, hi
    if starts[:2] != [0.0, 0.0] or ends[:2] != [1.0, 1.0]:
        raise Unsupported(f"roi = {roi.tolist()} crops the batch or channel dim")
    return (*starts[2:], *ends[2:])


@converts("Resize", since=11)
def _resize(call: NodeCall) -> Value:
    """Inputs X, roi, scales, sizes (one of the last two); opset 18's axes, keep_aspect_ratio_policy and
    antialias; cubic's cubic_coeff_a and exclude_outside."""
    x = call.input(0)
    mode = _mode(call, ("nearest", "linear", "cubic"))
    coordinate = call.attr("coordinate_transformation_mode", "half_pixel")
    nearest = call.attr("nearest_mode", "round_prefer_floor")
    if coordinate not in COORDINATE_MODES:
        raise Unsupported(f"coordinate_transformation_mode = {coordinate!r}")
    if mode == "nearest" and nearest not in NEAREST_MODES:
        raise Unsupported(f"nearest_mode = {nearest!r}")
    modes = {"mode": mode, "coordinate_mode": coordinate, "nearest_mode": nearest,
             "cubic_coeff_a": call.attr("cubic_coeff_a", -0.75),
             "exclude_outside": bool(call.attr("exclude_outside", 0)), "antialias": bool(call.attr("antialias", 0))}
    rank, spatial = x.type.rank, _static(x)
    axes = [int(a) % rank for a in call.attr("axes", range(rank))]
    if coordinate == "tf_crop_and_resize":
        modes.update(roi=_roi(call, rank, axes), extrapolation=call.attr("extrapolation_value", 0.0))
    scales, sizes = call.value(2, "the scales"), call.value(3, "the sizes")
    if scales is not None and scales.size:
        full = [1.0] * rank
        for a, s in zip(axes, scales.tolist()):
            full[a] = s
        return _by_scales(call, x, _spatial_scales(x, full), **modes)
    if sizes is None or not sizes.size:
        raise Unsupported("neither scales nor sizes is given")
    full_sizes = list(x.type.shape)
    for a, n in zip(axes, sizes.tolist()):
        full_sizes[a] = int(n)
    if full_sizes[:2] != list(x.type.shape[:2]):
        raise Unsupported(f"sizes = {sizes.tolist()} resizes the batch or channel dim")
    policy = call.attr("keep_aspect_ratio_policy", "stretch")
    if policy == "stretch":
        return call.emit("resize", x, size=tuple(full_sizes[2:]), **modes)
    if policy not in ("not_larger", "not_smaller"):
        raise Unsupported(f"keep_aspect_ratio_policy = {policy!r}")
    ratios = [full_sizes[a] / spatial[a - 2] for a in axes if a >= 2]
    scale = min(ratios) if policy == "not_larger" else max(ratios)
    size = tuple(int(np.floor(n * scale + 0.5)) if a in axes else n for a, n in enumerate(spatial, 2))
    return call.emit("resize", x, size=size, scales=tuple(scale if a in axes else 1.0 for a in range(2, rank)),
                     **modes)
