"""ONNX import of LSTM and GRU (static sequence length, unrolled) against onnxruntime's CPU provider (the ONNX
reference for layout = 1, which onnxruntime lacks).

LSTM: "it = f(Xt*(Wi^T) + Ht-1*(Ri^T) + Pi (.) Ct-1 + Wbi + Rbi) ... Ct = ft (.) Ct-1 + it (.) ct, Ht = ot (.) h(Ct)";
GRU: "ht = g(Xt*(Wh^T) + (rt (.) Ht-1)*(Rh^T) + Rbh + Wbh) # default, when linear_before_reset = 0",
"ht = g(Xt*(Wh^T) + (rt (.) (Ht-1*(Rh^T) + Rbh)) + Wbh) # when linear_before_reset != 0".
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

RNG = np.random.default_rng(3)
SEQ, BATCH, IN, HIDDEN = 4, 2, 3, 5


def f32(*shape: int) -> np.ndarray:
    return (RNG.standard_normal(shape) * 0.5).astype(np.float32)


def model(op_type: str, direction: str, bias: bool, initial: bool, layout: int = 0, **attrs):
    gates, dirs = (4 if op_type == "LSTM" else 3), (2 if direction == "bidirectional" else 1)
    inits = {"W": f32(dirs, gates * HIDDEN, IN), "R": f32(dirs, gates * HIDDEN, HIDDEN)}
    names = ["x", "W", "R", "", "", ""]
    if bias:
        inits["B"], names[3] = f32(dirs, 2 * gates * HIDDEN), "B"
    if initial:
        state = (BATCH, dirs, HIDDEN) if layout else (dirs, BATCH, HIDDEN)
        inits["h0"], names[5] = f32(*state), "h0"
        if op_type == "LSTM":
            inits["c0"] = f32(*state)
            names.append("c0")
    outputs = ["y", "y_h", "y_c"][:3 if op_type == "LSTM" else 2]
    node = helper.make_node(op_type, names, outputs, hidden_size=HIDDEN, direction=direction, layout=layout, **attrs)
    shape = [BATCH, SEQ, IN] if layout else [SEQ, BATCH, IN]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8), shape


CASES = [(op, direction, bias, initial, variant)
         for op in ("LSTM", "GRU") for direction in ("forward", "reverse", "bidirectional")
         for bias, initial in ((True, True), (False, False))
         for variant in ({}, {"layout": 1}, *([{"linear_before_reset": 1}] if op == "GRU" else []))]


@pytest.mark.parametrize(("op_type", "direction", "bias", "initial", "variant"), CASES)
def test_rnn_matches_onnxruntime(op_type: str, direction: str, bias: bool, initial: bool, variant: dict) -> None:
    m, shape = model(op_type, direction, bias, initial, **variant)
    x = f32(*shape)
    if variant.get("layout"):  # onnxruntime has no batch-major recurrent ops
        want = ReferenceEvaluator(m).run(None, {"x": x})
    else:
        want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = interpret(import_graph(m), [x])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_non_default_activations_are_refused() -> None:
    m, _ = model("GRU", "forward", True, False, activations=["Relu", "Tanh"])
    with pytest.raises(UnsupportedModel, match="activations"):
        import_graph(m)


def _with_inputs(m, **inputs: np.ndarray):
    """m with further LSTM/GRU inputs (by name: "sequence_lens" is input 4, "P" input 7) as initializers."""
    node = m.graph.node[0]
    names = list(node.input) + [""] * (8 - len(node.input))
    for name, value in inputs.items():
        names[{"sequence_lens": 4, "P": 7}[name]] = name
        m.graph.initializer.append(numpy_helper.from_array(value, name))
    del node.input[:]
    node.input.extend(names[:max(i for i, n in enumerate(names) if n) + 1])
    return m


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
def test_lstm_peepholes_and_full_sequence_lens_match_onnxruntime(direction: str) -> None:
    """"it = f(... + Pi (.) Ct-1 ...)", "ft = f(... + Pf (.) Ct-1 ...)", "ot = f(... + Po (.) Ct ...)"; P is
    [num_directions, 3*hidden_size] "in the order of iof"; sequence_lens that cover the sequence change nothing."""
    dirs = 2 if direction == "bidirectional" else 1
    m, shape = model("LSTM", direction, True, True)
    m = _with_inputs(m, sequence_lens=np.full(BATCH, SEQ, np.int32), P=f32(dirs, 3 * HIDDEN))
    x = f32(*shape)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for g, w in zip(interpret(import_graph(m), [x]), want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_sequence_lens_shorter_than_the_sequence_are_refused() -> None:
    m = _with_inputs(model("GRU", "forward", True, False)[0], sequence_lens=np.array([SEQ, SEQ - 1], np.int32))
    with pytest.raises(UnsupportedModel, match=r"sequence_lens = \[4, 3\] ends sequences before step 4"):
        import_graph(m)
