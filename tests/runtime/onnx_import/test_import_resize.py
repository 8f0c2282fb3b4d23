"""ONNX import of Resize (opsets 10 to 19) and Upsample (7 to 9) against onnxruntime's CPU provider.

"Each dimension value of the output tensor is: output_dimension = floor(input_dimension * (roi_end - roi_start)
* scale)" with the roi ignored outside tf_crop_and_resize; "x_original = (x_resized + 0.5) / scale - 0.5" for
half_pixel, "x_resized / scale" for asymmetric, "x_resized * (length_original - 1) / (length_resized - 1)" for
align_corners.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RNG = np.random.default_rng(5)
X = RNG.standard_normal((2, 3, 5, 6)).astype(np.float32)


def floats(*v: float) -> np.ndarray:
    return np.asarray(v, np.float32)


def ints(*v: int) -> np.ndarray:
    return np.asarray(v, np.int64)


def model(op_type: str, opset: int, inputs: list[np.ndarray | None], x: np.ndarray = X, **attrs: Any):
    names, inits = ["x"], []
    for i, v in enumerate(inputs):
        names.append("" if v is None else f"in{i}")
        if v is not None:
            inits.append(numpy_helper.from_array(v, f"in{i}"))
    graph = helper.make_graph([helper.make_node(op_type, names, ["y"], **attrs)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


NO_ROI = floats()
CASES = {
    # opset 19 (half_pixel and round_prefer_floor by default), by scales and by sizes
    "nearest-scales": ("Resize", 19, [None, floats(1, 1, 2, 1.5)], {}),
    "nearest-sizes-round-prefer-ceil": ("Resize", 19, [None, None, ints(2, 3, 8, 4)],
                                        {"nearest_mode": "round_prefer_ceil"}),
    "nearest-asymmetric-floor": ("Resize", 19, [None, floats(1, 1, 0.6, 2.5)],
                                 {"coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}),
    "nearest-tf-half-pixel-ceil": ("Resize", 19, [None, None, ints(2, 3, 9, 11)],
                                   {"coordinate_transformation_mode": "tf_half_pixel_for_nn", "nearest_mode": "ceil"}),
    "linear-half-pixel-down": ("Resize", 19, [None, floats(1, 1, 0.5, 0.7)], {"mode": "linear"}),
    "linear-pytorch-half-pixel": ("Resize", 19, [None, None, ints(2, 3, 1, 9)],
                                  {"mode": "linear", "coordinate_transformation_mode": "pytorch_half_pixel"}),
    "linear-align-corners": ("Resize", 19, [None, None, ints(2, 3, 7, 4)],
                             {"mode": "linear", "coordinate_transformation_mode": "align_corners"}),
    "linear-asymmetric-axes": ("Resize", 18, [None, floats(1.7, 2.0)],
                               {"mode": "linear", "coordinate_transformation_mode": "asymmetric", "axes": [2, 3]}),
    # cubic: "cubic_coeff_a ... -0.5 (in some cases of TensorFlow) or -0.75 (in PyTorch)"; exclude_outside: "the
    # weight of sampling locations outside the tensor will be set to 0 and the weight will be renormalized";
    # antialias: "an antialiasing filter when downscaling ... the filter is scaled by max(1, 1 / scale)".
    "cubic-up": ("Resize", 19, [None, floats(1, 1, 1.6, 2)], {"mode": "cubic"}),
    "cubic-down-exclude-outside": ("Resize", 19, [None, floats(1, 1, 0.6, 0.5)],
                                   {"mode": "cubic", "cubic_coeff_a": -0.5, "exclude_outside": 1}),
    "cubic-align-corners-sizes": ("Resize", 19, [None, None, ints(2, 3, 8, 4)],
                                  {"mode": "cubic", "coordinate_transformation_mode": "align_corners"}),
    "linear-antialias-down": ("Resize", 18, [None, floats(1, 1, 0.4, 0.7)], {"mode": "linear", "antialias": 1}),
    "cubic-antialias-down-up": ("Resize", 18, [None, floats(1, 1, 0.5, 1.5)], {"mode": "cubic", "antialias": 1}),
    "sizes-not-larger": ("Resize", 18, [None, None, ints(10, 20)],
                         {"axes": [2, 3], "keep_aspect_ratio_policy": "not_larger"}),
    # opsets 13 and 11: roi and scales are inputs (an empty scales when sizes are given)
    "opset-13-roi-ignored": ("Resize", 13, [floats(0, 0, 0, 0, 1, 1, 1, 1), floats(1, 1, 1.5, 2)],
                             {"mode": "linear"}),
    "opset-11-sizes": ("Resize", 11, [NO_ROI, floats(), ints(2, 3, 3, 12)], {"mode": "nearest"}),
    # tf_crop_and_resize: "x_original = start_x * (length_original - 1) + x_resized * (end_x - start_x) *
    # (length_original - 1) / (length_resized - 1)"; "extrapolation_value: When coordinate_transformation_mode is
    # "tf_crop_and_resize" and x_original is outside the range [0, length_original - 1], this value is used"
    "tf-crop-linear-sizes": ("Resize", 19, [floats(0, 0, -0.3, 0.2, 1, 1, 0.8, 1.4), None, ints(2, 3, 4, 7)],
                             {"mode": "linear", "coordinate_transformation_mode": "tf_crop_and_resize",
                              "extrapolation_value": -2.5}),
    # (scales giving whole sizes: onnxruntime takes length_resized as the integer size, ONNX's reference and kiln
    # as input * scale)
    "tf-crop-nearest-scales-axes": ("Resize", 18, [floats(0.7, 0.1, -0.2, 0.9), floats(0.5, 1.6)],
                                    {"coordinate_transformation_mode": "tf_crop_and_resize", "axes": [3, 2]}),
    "tf-crop-cubic-13": ("Resize", 13, [floats(0, 0, 0.2, 0.1, 1, 1, 0.9, 0.6), floats(1, 1, 1.6, 1.5)],
                         {"mode": "cubic", "coordinate_transformation_mode": "tf_crop_and_resize"}),
    # opset 10 and Upsample: asymmetric, nearest floors when enlarging
    "opset-10-nearest": ("Resize", 10, [floats(1, 1, 2, 2.5)], {}),
    "opset-10-linear-down": ("Resize", 10, [floats(1, 1, 0.6, 0.5)], {"mode": "linear"}),
    "upsample-9-nearest": ("Upsample", 9, [floats(1, 1, 2, 3)], {}),
    "upsample-9-linear": ("Upsample", 9, [floats(1, 1, 1.5, 2)], {"mode": "linear"}),
    "upsample-7-attribute": ("Upsample", 7, [], {"scales": [1.0, 1.0, 3.0, 2.0], "mode": "nearest"}),
}


@pytest.mark.parametrize("name", CASES)
def test_resize_matches_onnxruntime(name: str) -> None:
    op_type, opset, inputs, attrs = CASES[name]
    m = model(op_type, opset, inputs, **attrs)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    (got,) = interpret(import_graph(m, name), [X])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("attrs", "reason"), [
    ({"mode": "lanczos"}, "mode = 'lanczos'"),
    ({"coordinate_transformation_mode": "tf_crop_and_resize"}, "tf_crop_and_resize"),
])
def test_unsupported_resize_forms_are_named(attrs: dict, reason: str) -> None:
    with pytest.raises(UnsupportedModel, match=reason):
        import_graph(model("Resize", 19, [None, floats(1, 1, 0.5, 0.5)], **attrs))


def test_resizing_channels_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="batch or channel"):
        import_graph(model("Resize", 19, [None, floats(1, 2, 1, 1)]))
