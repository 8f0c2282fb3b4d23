"""ONNX import of the convolution, pooling, normalization, pad and depth/space ops, and of Resize/Upsample.

Each case is a one-node model made with onnx.helper; kiln's import run through the interpreter must match
onnxruntime's CPU provider (or onnx.reference.ReferenceEvaluator where noted), the ONNX operator spec being what
both implement. Float initializers arrive as parameters, so weights are initializers here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_cases
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RNG = np.random.default_rng(12)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@dataclass
class Case:
    op_type: str
    x: np.ndarray
    attrs: dict[str, Any] = field(default_factory=dict)
    weights: tuple[np.ndarray | None, ...] = ()  # further inputs, as initializers (None: omitted)
    opset: int = 21
    outputs: int = 1
    oracle: str = "ort"
    tol: float = 1e-5
    dynamic_batch: bool = False
    int64_outputs: tuple[int, ...] = ()  # outputs of element type int64 (MaxPool's Indices)


def model(c: Case):
    names, inits = ["x"], []
    for i, w in enumerate(c.weights):
        if w is None:
            names.append("")
            continue
        names.append(f"w{i}")
        inits.append(numpy_helper.from_array(w, f"w{i}"))
    outs = [f"y{i}" for i in range(c.outputs)]
    node = helper.make_node(c.op_type, names, outs, **c.attrs)
    shape = [None if c.dynamic_batch else c.x.shape[0], *c.x.shape[1:]]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(o, TensorProto.INT64 if i in c.int64_outputs else
                                                             TensorProto.FLOAT, None) for i, o in enumerate(outs)],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.opset)], ir_version=8)


def oracle(c: Case) -> list[np.ndarray]:
    m = model(c)
    if c.oracle == "ort":
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(None, {"x": c.x})
    return ReferenceEvaluator(m).run(None, {"x": c.x})


K3 = f32(4, 3, 3, 3)
CASES = {
    # Conv: "pads ... [x1_begin, x2_begin...x1_end, x2_end,...]", auto_pad SAME_UPPER puts the odd pad at the end.
    "conv-2d-bias-pads": Case("Conv", f32(2, 3, 7, 6), {"pads": [1, 2, 1, 2], "strides": [2, 1]}, (K3, f32(4))),
    "conv-asymmetric-pads": Case("Conv", f32(1, 3, 6, 6), {"pads": [0, 1, 2, 1]}, (K3,)),
    "conv-same-upper": Case("Conv", f32(1, 3, 7, 8), {"auto_pad": "SAME_UPPER", "strides": [2, 3]}, (K3,)),
    "conv-same-lower": Case("Conv", f32(1, 3, 7, 8), {"auto_pad": "SAME_LOWER", "strides": [2, 2]}, (K3,)),
    "conv-valid-dilated-groups": Case("Conv", f32(2, 4, 9, 9), {"auto_pad": "VALID", "dilations": [2, 1],
                                                                "group": 2}, (f32(6, 2, 3, 2),)),
    "conv-1d": Case("Conv", f32(2, 4, 10), {"pads": [1, 2], "strides": [2], "group": 4}, (f32(8, 1, 3), f32(8))),
    "conv-opset-7": Case("Conv", f32(1, 3, 5, 5), {}, (K3,), opset=7, oracle="reference"),
    # ConvTranspose: "output_shape ... total_padding[i] = stride[i] * (input_size[i] - 1) + output_padding[i] +
    # ((kernel_shape[i] - 1) * dilations[i] + 1) - output_shape[i]".
    "convt-2d": Case("ConvTranspose", f32(2, 4, 4, 5), {"strides": [2, 2], "pads": [1, 0, 1, 0],
                                                         "output_padding": [1, 1]}, (f32(4, 3, 3, 2), f32(3))),
    "convt-asymmetric": Case("ConvTranspose", f32(1, 4, 3, 3), {"strides": [2, 2], "pads": [0, 1, 2, 0]},
                             (f32(4, 2, 3, 3), f32(2))),
    "convt-output-shape": Case("ConvTranspose", f32(1, 2, 3, 4), {"strides": [3, 2], "output_shape": [10, 8]},
                               (f32(2, 2, 3, 3),)),
    "convt-same-upper": Case("ConvTranspose", f32(1, 2, 3, 4), {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
                             (f32(2, 3, 3, 3),)),
    "convt-groups-dilations-1d": Case("ConvTranspose", f32(2, 4, 5), {"strides": [2], "dilations": [2],
                                                                      "group": 2}, (f32(4, 3, 3), f32(6))),
    "convt-asymmetric-output-padding": Case("ConvTranspose", f32(1, 2, 3, 3), {"strides": [2, 2],
                                                                               "pads": [1, 0, 0, 1],
                                                                               "output_padding": [1, 1]},
                                            (f32(2, 2, 2, 2), f32(2))),
    # Normalization.
    "batchnorm": Case("BatchNormalization", f32(2, 3, 4, 5), {"epsilon": 1e-3},
                      (f32(3), f32(3), f32(3), np.abs(f32(3)) + 0.5), dynamic_batch=True),
    "batchnorm-opset-9": Case("BatchNormalization", f32(2, 3, 4), {}, (f32(3), f32(3), f32(3), np.abs(f32(3)) + .5),
                              opset=9),
    # ONNX 15: "running_mean = input_mean * momentum + current_mean * (1 - momentum)", current_var the biased one
    "batchnorm-training": Case("BatchNormalization", f32(3, 2, 4, 5), {"training_mode": 1, "momentum": 0.8},
                               (f32(2), f32(2), f32(2), np.abs(f32(2)) + 0.5), opset=15, outputs=3,
                               oracle="reference", tol=1e-5, dynamic_batch=True),
    "batchnorm-training-y-only-2d": Case("BatchNormalization", f32(6, 3), {"training_mode": 1, "epsilon": 1e-2},
                                         (f32(3), f32(3), f32(3), np.abs(f32(3)) + 0.5), opset=15,
                                         oracle="reference", tol=1e-5),
    "instancenorm": Case("InstanceNormalization", f32(2, 3, 4, 5), {"epsilon": 1e-4}, (f32(3), f32(3)),
                         tol=1e-4),
    "layernorm-axis-1-stash": Case("LayerNormalization", f32(2, 3, 4), {"axis": 1}, (f32(3, 4), f32(3, 4)),
                                   outputs=3, tol=1e-4),
    "layernorm-broadcast-scale": Case("LayerNormalization", f32(2, 3, 4), {"axis": -2}, (f32(4),), tol=1e-4),
    "groupnorm-18": Case("GroupNormalization", f32(2, 6, 3, 3), {"num_groups": 3}, (f32(3), f32(3)), opset=18,
                         oracle="reference", tol=1e-4),
    "groupnorm-21": Case("GroupNormalization", f32(2, 6, 3, 3), {"num_groups": 2, "epsilon": 1e-3},
                         (f32(6), f32(6)), oracle="reference", tol=1e-4),
    "lrn": Case("LRN", f32(2, 6, 3, 4), {"size": 3, "alpha": 0.01, "beta": 0.6, "bias": 2.0}, tol=1e-4),
    # onnxruntime refuses an even size; the reference loops over range(N) for the channels, so N >= C here.
    "lrn-even-size": Case("LRN", f32(5, 5, 3, 3), {"size": 4, "alpha": 0.1}, oracle="reference", tol=1e-4),
    # Pooling: ceil_mode "use ceil ... to compute the output shape"; count_include_pad "whether include pad
    # pixels when calculating values for the edges".
    "maxpool": Case("MaxPool", f32(2, 3, 7, 6), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                    dynamic_batch=True),
    "maxpool-ceil-asymmetric": Case("MaxPool", f32(1, 2, 8, 7), {"kernel_shape": [3, 2], "strides": [2, 2],
                                                                 "pads": [0, 1, 1, 0], "ceil_mode": 1}),
    # SAME: "pad_shape[i] = (output_spatial_shape[i] - 1) * strides_spatial_shape[i] + ((kernel_spatial_shape[i]
    # - 1) * dilations[i] + 1) - input_spatial_shape[i]"; onnxruntime leaves the dilation out (one row short).
    "maxpool-same-dilated": Case("MaxPool", f32(1, 2, 7, 7), {"kernel_shape": [2, 3], "dilations": [2, 1],
                                                              "auto_pad": "SAME_UPPER"}, oracle="reference"),
    # MaxPool-12 Indices: "the indices are computed as flatten 1-D tensor ... storage_order ... row major (0) or
    # column major (1)"; ties go to the first maximum, as onnxruntime and ONNX's reference scan the window.
    "maxpool-indices-pads-ceil": Case("MaxPool", f32(2, 3, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 2],
                                                                   "pads": [1, 0, 0, 1], "ceil_mode": 1},
                                      outputs=2, int64_outputs=(1,), dynamic_batch=True),
    "maxpool-indices-column-major": Case("MaxPool", f32(2, 2, 5, 6), {"kernel_shape": [2, 3], "strides": [1, 2],
                                                                      "storage_order": 1}, outputs=2,
                                         int64_outputs=(1,)),
    "maxpool-indices-ties": Case("MaxPool", np.round(f32(1, 2, 5, 5)).clip(0, 1), {"kernel_shape": [2, 2],
                                                                                    "strides": [1, 1]},
                                 outputs=2, int64_outputs=(1,)),
    "maxpool-indices-1d": Case("MaxPool", f32(2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]},
                               outputs=2, int64_outputs=(1,)),
    "maxpool-indices-3d": Case("MaxPool", f32(1, 2, 4, 5, 4), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 1],
                                                               "pads": [0, 1, 1, 0, 0, 1]},
                               outputs=2, int64_outputs=(1,)),
    "maxpool-1d": Case("MaxPool", f32(2, 3, 9), {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}),
    "avgpool-exclude": Case("AveragePool", f32(2, 3, 7, 6), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
    "avgpool-include-asymmetric": Case("AveragePool", f32(1, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 2],
                                                                        "pads": [1, 0, 0, 1],
                                                                        "count_include_pad": 1}),
    "avgpool-ceil-include": Case("AveragePool", f32(1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2],
                                                                  "pads": [1, 1, 1, 1], "ceil_mode": 1,
                                                                  "count_include_pad": 1}),
    "avgpool-ceil-exclude": Case("AveragePool", f32(1, 2, 8, 7), {"kernel_shape": [2, 2], "strides": [3, 2],
                                                                  "ceil_mode": 1}),
    "avgpool-same-lower-1d": Case("AveragePool", f32(2, 2, 9), {"kernel_shape": [4], "strides": [2],
                                                                "auto_pad": "SAME_LOWER"}),
    # 3-D: "the operator expects ... (N x C x D1 x D2 ... Dn)" for Conv, ConvTranspose and the pools; AveragePool-19
    # dilations: "dilation value along each spatial axis of filter".
    "conv-3d": Case("Conv", f32(2, 4, 5, 6, 5), {"pads": [1, 0, 1, 1, 1, 0], "strides": [1, 2, 1], "group": 2,
                                                 "dilations": [1, 1, 2]}, (f32(6, 2, 3, 2, 2), f32(6)), tol=1e-4),
    "convt-3d": Case("ConvTranspose", f32(1, 2, 3, 4, 3), {"strides": [2, 1, 2], "pads": [1, 1, 0, 1, 1, 0],
                                                           "output_padding": [1, 0, 1]}, (f32(2, 3, 2, 3, 2),),
                     tol=1e-4),
    "maxpool-3d-ceil-dilated": Case("MaxPool", f32(1, 2, 6, 7, 5), {"kernel_shape": [3, 2, 2], "strides": [2, 1, 2],
                                                                    "dilations": [1, 2, 1], "ceil_mode": 1}),
    "avgpool-3d-asymmetric": Case("AveragePool", f32(1, 2, 5, 6, 4), {"kernel_shape": [3, 2, 3],
                                                                      "strides": [2, 2, 1],
                                                                      "pads": [1, 0, 1, 0, 1, 1]}),
    "avgpool-2d-dilated-include": Case("AveragePool", f32(1, 2, 7, 8), {"kernel_shape": [2, 3], "dilations": [2, 2],
                                                                        "pads": [1, 1, 1, 1], "count_include_pad": 1},
                                       oracle="reference"),
    "globalavgpool-3d": Case("GlobalAveragePool", f32(2, 3, 2, 4, 3)),
    "globalavgpool": Case("GlobalAveragePool", f32(2, 3, 4, 5), dynamic_batch=True),
    "globalmaxpool": Case("GlobalMaxPool", f32(2, 3, 4, 5)),
    # Depth and space: DCR "depth-column-row", CRD "column-row-depth".
    "depthtospace-dcr": Case("DepthToSpace", f32(2, 8, 2, 3), {"blocksize": 2}, dynamic_batch=True),
    "depthtospace-crd": Case("DepthToSpace", f32(1, 18, 2, 2), {"blocksize": 3, "mode": "CRD"}),
    "spacetodepth": Case("SpaceToDepth", f32(2, 3, 4, 6), {"blocksize": 2}),
    # Pad: "pads ... [x1_begin, x2_begin, ..., x1_end, x2_end,...]"; negative values remove elements.
    "pad-attr-opset-7": Case("Pad", f32(2, 3, 4), {"pads": [0, 1, 2, 0, 0, 1], "value": 1.5}, opset=7),
    "pad-reflect-opset-10": Case("Pad", f32(2, 3, 4), {"pads": [0, 0, 2, 0, 0, 3], "mode": "reflect"}, opset=10),
    "pad-inputs-negative": Case("Pad", f32(2, 3, 5), {}, (np.array([0, -1, 2, 0, 1, -2], np.int64),
                                                          np.array(-2.0, np.float32))),
    "pad-edge-axes": Case("Pad", f32(2, 3, 5), {"mode": "edge"}, (np.array([1, 2, 0, 3], np.int64), None,
                                                                 np.array([1, -1], np.int64))),
    # Pad-19: "wrap - wrap-around padding as if the data tensor's edges were connected to opposite edges"
    "pad-wrap": Case("Pad", f32(2, 3, 5), {"mode": "wrap"}, (np.array([0, 3, 2, 0, 1, 5], np.int64),), opset=19),
    # SpaceToDepth-25 mode: "CRD (column-row-depth) ... the inverse of DepthToSpace with mode CRD"
    "spacetodepth-crd": Case("SpaceToDepth", f32(1, 2, 4, 6), {"blocksize": 2, "mode": "CRD"}, opset=25,
                             oracle="reference"),  # onnxruntime knows no mode yet
}


@pytest.mark.parametrize("name", CASES)
def test_import_matches_the_onnx_oracle(name: str) -> None:
    c = CASES[name]
    graph = import_graph(model(c), name)
    got = interpret(graph, [c.x])
    want = oracle(c)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.reshape(g.shape) if w.size == g.size else w, rtol=c.tol, atol=c.tol)


def test_weights_become_parameters_named_by_initializer() -> None:
    graph = import_graph(model(CASES["conv-2d-bias-pads"]))
    assert sorted(graph.params) == ["w0", "w1"]


@pytest.mark.parametrize(("case", "reason"), [
    (Case("BatchNormalization", f32(2, 3, 4), {}, (f32(3), f32(3), f32(3), f32(3) ** 2), opset=9, outputs=3),
     "the training outputs"),  # before opset 14 the outputs, not training_mode, asked for training
    (Case("Conv", f32(1, 1, 3, 3, 3, 3), {}, (f32(1, 1, 2, 2, 2, 2),)), "4-D spatial input"),
    (Case("Pad", f32(2, 3), {"mode": "wrap"}, (np.array([0, 4, 0, 1], np.int64),), opset=19),
     "wrap pads 4, 1 on axis 1"),
    (Case("LRN", f32(1, 3, 2, 2)), "the required attribute 'size' is missing"),
    (Case("Pad", f32(2, 3), {}, (None,)), "the pads input is missing"),
])
def test_unsupported_forms_are_named(case: Case, reason: str) -> None:
    """The driver lists each node kiln cannot import with the reason (never a traceback or a wrong result)."""
    with pytest.raises(UnsupportedModel, match=reason):
        import_graph(model(case))


def test_max_pool_of_integers_f32_cannot_hold_is_refused() -> None:
    """MaxPool-12 takes int8 and uint8 (pooled as their exact f32 copies); wider integers are named, not rounded."""
    m = onnx_cases.model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2])],
                         {"x": (np.int32, [1, 1, 4, 4])}, ["y"], opset=12)
    with pytest.raises(UnsupportedModel, match="max pooling i32; kiln pools floats and the integers f32 holds"):
        import_graph(m)
