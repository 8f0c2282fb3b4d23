"""ONNX lowerings of pad and resize (transposed convolutions are with the convolutions in `nn_ops`)."""

from __future__ import annotations

import numpy as np

from .rule import OnnxCall, OnnxResult, onnx_rule


@onnx_rule("pad")
def _pad(call: OnnxCall) -> OnnxResult:
    """Negative pads as a Slice (ONNX's reflect and edge modes are not defined on crops), then Pad."""
    a, x = call.attrs, call.inputs[0]
    cut = [i for i, (b, e) in enumerate(zip(a["before"], a["after"])) if b < 0 or e < 0]
    if cut:
        ends = [-a["after"][i] if a["after"][i] < 0 else np.iinfo(np.int64).max for i in cut]
        x = call.node("Slice", x, call.ints([max(-a["before"][i], 0) for i in cut]), call.ints(ends), call.ints(cut))
    pads = [max(b, 0) for b in a["before"]] + [max(e, 0) for e in a["after"]]
    if not any(pads):
        return call.node("Identity", x)
    if a["mode"] != "constant":
        return call.node("Pad", x, call.ints(pads), mode=a["mode"])
    return call.node("Pad", x, call.ints(pads), call.scalar(a["value"]))


@onnx_rule("resize")
def _resize(call: OnnxCall) -> OnnxResult:
    """Resize over the spatial axes: by scales where the op has them (ONNX then derives the size as
    floor(input * scale)), else by sizes."""
    a, t = call.attrs, call.types[0]
    axes = list(range(2, t.rank))
    modes = {"mode": a["mode"], "coordinate_transformation_mode": a["coordinate_mode"], "axes": axes}
    roi = "" if a["roi"] is None else call.const(np.asarray(a["roi"], np.float32))
    if roi:
        modes["extrapolation_value"] = a["extrapolation"]
    if a["mode"] == "nearest":
        modes["nearest_mode"] = a["nearest_mode"]
    else:
        modes.update(cubic_coeff_a=a["cubic_coeff_a"], exclude_outside=int(a["exclude_outside"]),
                     antialias=int(a["antialias"]))
    if a["scales"] is None:
        return call.node("Resize", call.inputs[0], roi, "", call.ints(a["size"]), **modes)
    if any(int(np.floor(n * s)) != out for n, s, out in zip(t.shape[2:], a["scales"], a["size"])):
        raise call.unsupported(f"size {list(a['size'])} is not floor(input * scales {list(a['scales'])}), the only "
                               "size ONNX's Resize makes from scales")
    return call.node("Resize", call.inputs[0], roi, call.const(np.asarray(a["scales"], np.float32)), **modes)
