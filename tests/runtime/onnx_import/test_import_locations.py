"""Imported ops name the ONNX node they came from (issue 17, "Locations": "Every op carries a location: ... the
ONNX node name it was imported from"; "locations surviving ... an ONNX import, checked in the printed IR and in
error messages")."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx_cases import model

import kiln
from kiln.ir import NameLoc, print_graph
from kiln.passes import PassManager
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph

F32 = np.float32


def _mlp():
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], name="/fc1/Gemm", transB=1, alpha=0.5),
             helper.make_node("Relu", ["h"], ["a"], name="/act/Relu"),
             helper.make_node("Softmax", ["a"], ["y"], axis=-1)]  # unnamed: known by its op type
    return model(nodes, {"x": (F32, ["batch", 3])}, ["y"],
                 initializers={"w": np.ones((2, 3), F32), "b": np.zeros(2, F32)})


def test_every_imported_op_names_its_node():
    """Each op a converter emits for a node, however many, is at that node: its name over its op type."""
    graph = import_graph(_mlp())
    locs = {op.loc for op in graph.functions["forward"].ops}
    assert locs == {NameLoc("/fc1/Gemm", NameLoc("Gemm")), NameLoc("/act/Relu", NameLoc("Relu")),
                    NameLoc("Softmax")}
    gemm = [op for op in graph.functions["forward"].ops if op.loc == NameLoc("/fc1/Gemm", NameLoc("Gemm"))]
    assert len(gemm) > 1  # alpha and transB make more than one op of the one node
    shown = print_graph(PassManager.parse("canonicalize,cse,dce").run(graph), locations=True)
    assert 'loc("/fc1/Gemm"("Gemm"))' in shown and 'loc("/act/Relu"("Relu"))' in shown


def test_a_shape_error_inside_a_converter_names_the_node():
    """A node whose inputs do not fit is refused with its node named, the op's error prefixed by its location."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="/proj/MatMul")]
    bad = model(nodes, {"x": (F32, [2, 3])}, ["y"], initializers={"w": np.ones((4, 2), F32)})
    with pytest.raises(UnsupportedModel, match=r"/proj/MatMul \(MatMul, opset 17\): ShapeError: /proj/MatMul "
                                                r"\(MatMul\): matmul"):
        import_graph(bad)


def test_a_traced_onnx_module_keeps_the_node_locations():
    """`kiln.import_onnx` gives a module that replays the imported ops; tracing it keeps each op at its node,
    not at the line of kiln's replay loop."""
    module = kiln.import_onnx(_mlp())
    traced = kiln.trace(module, ((None, 3), "f32"))
    assert ({op.loc for op in traced.functions["forward"].ops if op.kind != "constant"}
            == {op.loc for op in import_graph(_mlp()).functions["forward"].ops if op.kind != "constant"})
