"""Named dims in the Relax lowering and ONNX (issue 12: "a `batch`/`height`/`width` dim becomes a `?` dim and a TVM
symbolic shape"): inputs sharing a dim name (ONNX's dim_param) start as one TVM symbolic var, so Relax can prove
shapes built from both agree; unrelated `?` dims stay vars of their own; the name goes back out as the dim_param."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.ir import Builder, DType, ShapeError, TensorType
from kiln.runtime.onnx.export import export_graph
from kiln.runtime.onnx.importer.driver import import_graph
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lower import lower


def three_inputs():
    b = Builder("M")
    x = b.input("x", TensorType.of(("batch", 4), DType.f32))
    y = b.input("y", TensorType.of(("batch", None), DType.f32))
    z = b.input("z", TensorType.of((None, 4), DType.f32))
    b.ret(b.tanh(x), b.tanh(y), b.tanh(z))
    return b.build()


def test_inputs_sharing_a_name_are_one_tvm_var_and_unrelated_dims_are_not():
    params = lower(three_inputs()).module["forward"].params
    (bx, _), (by, y1), (z0, _) = (p.ty.shape.values for p in params)
    assert bx.same_as(by) and bx.name == "batch"
    assert not z0.same_as(bx) and not y1.same_as(bx) and not z0.same_as(y1)


def test_the_build_runs_and_refuses_inputs_that_disagree_on_a_name():
    exe = compile_graph(three_inputs(), cache=False)
    xs = [np.full((2, 4), 0.5, np.float32), np.full((2, 5), 1.0, np.float32), np.full((3, 4), 2.0, np.float32)]
    for got, x in zip(exe(*xs), xs):
        np.testing.assert_allclose(np.asarray(got), np.tanh(x), rtol=1e-6)
    with pytest.raises(ShapeError, match=r"dim \?\{batch\} is 2 in @forward input %x dim 0 but 3 in @forward input "
                                         r"%y dim 0"):
        exe(xs[0], np.ones((3, 5), np.float32), xs[2])


def test_the_dim_param_imports_as_a_name_and_exports_back(tmp_path: Path):
    """Two inputs with dim_param `batch` import as `?{batch}` (a dim_param kiln cannot spell, with a space,
    stays an anonymous `?`), their sum keeps it, and the export writes `batch` on inputs and output."""
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"])], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", "odd name"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 1])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["batch", None])]),
        opset_imports=[helper.make_opsetid("", 17)])
    graph = import_graph(model)
    fn = graph.functions["forward"]
    assert [str(a.type) for a in fn.args] + [str(fn.results[0].type)] == [
        "tensor<?{batch}x?xf32>", "tensor<?{batch}x1xf32>", "tensor<?{batch}x?xf32>"]
    back = onnx.load(export_graph(graph, tmp_path / "m.onnx"))
    dims = [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in (*back.graph.input,
                                                                                      *back.graph.output)]
    assert dims[0][0] == dims[1][0] == dims[2][0] == "batch"
    assert dims[0][1] not in ("batch", "")  # the anonymous dim gets a name of its own
