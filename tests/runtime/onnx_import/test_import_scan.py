"""ONNX Scan unrolled at import (convert_control.py): outputs against onnxruntime, refusals named.

Scan-16: "the scan_inputs ... are sliced along the scan axis ... the state variables ... are passed as inputs to
the body", "scan_input_directions ... 0 indicates forward direction and 1 indicates reverse", "scan_output_axes
... the axis along which the k-th scan_output is accumulated", "scan_output_directions ... 1 indicates ...
prepending a value to the scan_output in each iteration".
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.ir import interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

F = TensorProto.FLOAT


def scan_model(x_dims: list, axis: int, backwards: int, out_axis: int, out_backwards: int, scan8: bool = False):
    """h, ys = Scan(h0, x): h carries h * 0.5 + x_t, and each step scans (h * 0.5 + x_t) * 2 (x_dims without the
    scan axis are h0's dims); `scan8`: Scan-8, batch axis 0 and scan axis 1, `backwards` its `directions`."""
    info = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Mul", ["h", "half"], ["scaled"]), helper.make_node("Add", ["scaled", "x_t"], ["h_out"]),
         helper.make_node("Mul", ["h_out", "two"], ["y_t"])], "body",
        [info("h", F, None), info("x_t", F, None)], [info("h_out", F, None), info("y_t", F, None)],
        [numpy_helper.from_array(np.float32(0.5), "half"), numpy_helper.from_array(np.float32(2.0), "two")])
    if scan8:
        node = helper.make_node("Scan", ["", "h0", "x"], ["h", "ys"], name="scan", body=body, num_scan_inputs=1,
                                directions=[backwards])
        axis = 1
    else:
        node = helper.make_node("Scan", ["h0", "x"], ["h", "ys"], name="scan", body=body, num_scan_inputs=1,
                                scan_input_axes=[axis], scan_input_directions=[backwards],
                                scan_output_axes=[out_axis], scan_output_directions=[out_backwards])
    h_dims = [d for i, d in enumerate(x_dims) if i != axis % max(len(x_dims), 1)]
    graph = helper.make_graph([node], "g", [info("h0", F, h_dims), info("x", F, x_dims)],
                              [info("h", F, None), info("ys", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 8 if scan8 else 16)], ir_version=8)


def _assert_matches_onnxruntime(model, feeds: dict[str, np.ndarray]) -> None:
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = interpret(import_graph(model), list(feeds.values()))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis, backwards, out_axis, out_backwards",
                         [(0, 0, 0, 0), (1, 1, 0, 0), (1, 0, -1, 1), (-1, 1, 1, 0)])
def test_unrolled_scan_matches_onnxruntime(axis: int, backwards: int, out_axis: int, out_backwards: int) -> None:
    rng = np.random.default_rng(axis + 2 * backwards)
    x = rng.standard_normal((4, 5, 3)).astype(np.float32)
    h0 = rng.standard_normal(np.delete(x.shape, axis % 3)).astype(np.float32)
    _assert_matches_onnxruntime(scan_model(list(x.shape), axis, backwards, out_axis, out_backwards),
                                {"h0": h0, "x": x})


def test_scan_over_a_static_length_keeps_a_dynamic_batch() -> None:
    """The scan axis must be known at import; another axis may be a `?` dim (one import serves every batch)."""
    model = scan_model(["batch", 5, 3], 1, 0, 1, 0)
    for batch in (1, 3):
        rng = np.random.default_rng(batch)
        _assert_matches_onnxruntime(model, {"h0": rng.standard_normal((batch, 3)).astype(np.float32),
                                            "x": rng.standard_normal((batch, 5, 3)).astype(np.float32)})


@pytest.mark.parametrize("x_dims, reason", [
    ([4, "seq", 3], r"the sequence length is known only at run time"),
    ([], r"scan input 0 is a scalar; a scan input needs an axis to slice"),
])
def test_scans_kiln_cannot_unroll_are_named(x_dims: list, reason: str) -> None:
    with pytest.raises(UnsupportedModel, match=r"scan \(Scan, opset 16\): " + reason):
        import_graph(scan_model(x_dims, 1, 0, 0, 0))



def test_a_run_time_scan_length_names_the_input_to_fix_and_that_fix_works() -> None:
    """kiln's IR has no loop op, so a Scan is unrolled: a `?` sequence length is refused naming the scan input, its
    type and axis and the `input_shapes` entry that fixes it; importing with that entry matches onnxruntime."""
    model = scan_model([4, "seq", 3], 1, 0, 0, 0)
    with pytest.raises(UnsupportedModel, match=r"scan \(Scan, opset 16\): the sequence length is known only at run "
                                               r"time \(scan input 0, 'x': tensor<4x\?\{seq\}x3xf32>, axis 1\); "
                                               r"kiln's IR has no loop, .* input_shapes=\{'x': \[\.\.\.\]\}"):
        import_graph(model)
    rng = np.random.default_rng(5)
    feeds = {"h0": rng.standard_normal((4, 3)).astype(np.float32),
             "x": rng.standard_normal((4, 6, 3)).astype(np.float32)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = interpret(import_graph(model, input_shapes={"x": [4, 6, 3]}), list(feeds.values()))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backwards", [0, 1])
def test_scan_8_scans_each_batch_row(backwards: int) -> None:
    """Scan-8: "All inputs and outputs have a batch axis ... the first axis", the scan axis the second; with
    `directions` 1 a row is scanned from its end; `sequence_lens` omitted: every row has the full length."""
    rng = np.random.default_rng(8 + backwards)
    _assert_matches_onnxruntime(scan_model([2, 4, 3], 0, backwards, 0, 0, scan8=True),
                                {"h0": rng.standard_normal((2, 3)).astype(np.float32),
                                 "x": rng.standard_normal((2, 4, 3)).astype(np.float32)})


@pytest.mark.parametrize("attr, value, reason", [
    ("num_scan_inputs", 3, r"num_scan_inputs = 3 for a Scan of 2 state and scan inputs"),
    ("scan_input_axes", [0, 1], r"scan_input_axes has 2 entries for 1 scan inputs or outputs"),
    ("scan_input_axes", [3], r"scan axis 3 of scan input 0, of rank 3"),
    ("scan_output_axes", [-4], r"scan output axis -4 for outputs of rank 3"),
])
def test_scan_attributes_that_do_not_fit_are_named(attr: str, value, reason: str) -> None:
    """Every attribute list has "one value for each scan input" (output), and an axis "in the range [-r, r-1]"."""
    model = scan_model([4, 5, 3], 0, 0, 0, 0)
    node = model.graph.node[0]
    (old,) = [a for a in node.attribute if a.name == attr]
    node.attribute.remove(old)
    node.attribute.append(helper.make_attribute(attr, value))
    with pytest.raises(UnsupportedModel, match=r"scan \(Scan, opset 16\): " + reason):
        import_graph(model)


def test_scan_8_with_sequence_lens_is_named() -> None:
    model = scan_model([2, 4, 3], 0, 0, 0, 0, scan8=True)
    model.graph.node[0].input[0] = "lens"
    model.graph.initializer.append(numpy_helper.from_array(np.array([4, 2], np.int32), "lens"))
    with pytest.raises(UnsupportedModel, match=r"scan \(Scan, opset 8\): Scan-8 with sequence_lens"):
        import_graph(model)
