"""ONNX Loop unrolled at import (convert_control.py): outputs against onnxruntime, refusals named.

Loop-16: "the loop-carried dependencies ... are passed as inputs to the body ... scan_outputs are concatenated
along a new leading axis"; "cond ... terminate the loop" when false.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

X = np.random.default_rng(3).standard_normal((2, 3)).astype(np.float32)


def loop_model(trips: int | None, *, stop_after: int | None = None, grow: bool = False, runtime_cond: bool = False,
               from_weight: bool = False):
    """y, ys = Loop(x): each iteration carries acc * 0.5 + x + i and scans acc + 1; with `stop_after`, the body's
    condition turns false at that iteration; with `grow`, acc gains a row per iteration; with `from_weight`, acc
    starts at an initializer `w` instead of x."""
    f, info = TensorProto.FLOAT, helper.make_tensor_value_info
    body_nodes = [
        helper.make_node("Cast", ["i"], ["i_f"], to=f),
        helper.make_node("Mul", ["acc_in", "half"], ["scaled"]),
        helper.make_node("Add", ["scaled", "x"], ["plus_x"]),
        helper.make_node("Add", ["plus_x", "i_f"], ["acc_next"]),
        helper.make_node("Add", ["acc_in", "one"], ["scan"]),
    ]
    if grow:
        body_nodes.append(helper.make_node("Concat", ["acc_next", "x"], ["acc_out"], axis=0))
    else:
        body_nodes.append(helper.make_node("Identity", ["acc_next"], ["acc_out"]))
    if runtime_cond:
        body_nodes.append(helper.make_node("ReduceSum", ["acc_next"], ["total"], keepdims=0))
        body_nodes.append(helper.make_node("Less", ["total", "limit"], ["cond_out"]))
    else:
        last = -1 if stop_after is None else stop_after
        body_nodes.append(helper.make_node("Constant", [], ["last"], value=numpy_helper.from_array(np.int64(last))))
        body_nodes.append(helper.make_node("Equal", ["i", "last"], ["stop"]))
        body_nodes.append(helper.make_node("Not", ["stop"], ["cond_out"]))
    inits = [numpy_helper.from_array(np.float32(v), n) for n, v in (("half", 0.5), ("one", 1.0), ("limit", 1e9))]
    body = helper.make_graph(
        body_nodes, "body",
        [info("i", TensorProto.INT64, []), info("c", TensorProto.BOOL, []), info("acc_in", f, None)],
        [info("cond_out", TensorProto.BOOL, []), info("acc_out", f, None), info("scan", f, None)], inits)
    graph_inits = [numpy_helper.from_array(np.array(True), "cond")]
    if trips is not None:
        graph_inits.append(numpy_helper.from_array(np.int64(trips), "M"))
    if from_weight:
        graph_inits.append(numpy_helper.from_array(X[::-1].copy(), "w"))
    node = helper.make_node("Loop", ["M" if trips is not None else "", "cond", "w" if from_weight else "x"],
                            ["y", "ys"], name="loop", body=body)
    graph = helper.make_graph([node], "g", [info("x", f, X.shape)], [info("y", f, None), info("ys", f, None)],
                              graph_inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)], ir_version=8)


@pytest.mark.parametrize(("trips", "stop_after", "from_weight"), [(3, None, False), (5, 1, False), (2, None, True)])
def test_unrolled_loop_matches_onnxruntime(trips: int, stop_after: int | None, from_weight: bool) -> None:
    """A float initializer carried into the loop stays a parameter (it is not folded into the unrolled body)."""
    m = loop_model(trips, stop_after=stop_after, from_weight=from_weight)
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": X})
    graph = import_graph(m)
    assert sorted(graph.params) == (["w"] if from_weight else [])
    got = interpret(graph, [X])
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"trips": None}, "a Loop without a trip count"),
    ({"trips": 3, "runtime_cond": True}, "the body's condition at iteration 0 is computed at run time"),
    ({"trips": 3, "grow": True}, r"loop-carried value 0 changes from \(2, 3\) to \(4, 3\) at iteration 0"),
])
def test_loops_kiln_cannot_unroll_are_named(kwargs: dict, reason: str) -> None:
    with pytest.raises(UnsupportedModel, match=r"loop \(Loop, opset 16\): " + reason):
        import_graph(loop_model(**kwargs))
