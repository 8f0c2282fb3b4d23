"""The ONNX import driver: initializers, constant folding, symbolic shapes, If, opsets, one error for a model.

Each case quotes issue 12 ("ONNX import"), whose Semantics section these check.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from onnx_cases import assert_matches_reference, filecheck, model

from kiln.ir import RecordError, interpret
from kiln.runtime.onnx.importer.driver import UnsupportedModel, import_graph, import_model, sanitized
from kiln.runtime.onnx.tensors import PARAM_ID_KEY

F32, I64 = np.float32, np.int64


def _torch_style_reshape(batch) -> onnx.ModelProto:
    """torch.onnx.export's flatten of a batch: Shape -> Gather -> Unsqueeze -> Concat -> Reshape, then MatMul."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["b"]),
             helper.make_node("Unsqueeze", ["b", "axes"], ["bu"]),
             helper.make_node("Concat", ["bu", "rest"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("MatMul", ["r", "/fc/MatMul_weight"], ["y"])]
    return model(nodes, {"x": (F32, [batch, 3, 4])}, ["y"],
                 initializers={"zero": np.array(0, I64), "axes": np.array([0], I64), "rest": np.array([12], I64),
                               "/fc/MatMul_weight": np.arange(24, dtype=F32).reshape(12, 2)})


def test_dynamic_batch_shape_subgraph_becomes_one_reshape(tmp_path: Path):
    """ "Dynamic dims stay symbolic (a `batch` dim becomes a `?` dim) ... Shape sub-graphs ... kept symbolic where
    not [static]": the Shape/Gather/Unsqueeze/Concat chain over a `?` batch is a reshape with -1, no constants (the
    input's dim_param names its `?`: `?{batch}`)."""
    onnx_model = _torch_style_reshape("batch")
    graph = import_graph(onnx_model)
    filecheck(str(graph), """
// CHECK-LABEL: func @forward(%x: tensor<?{batch}x3x4xf32>)
// CHECK-NEXT: reshape %x {shape = [-1, 12]} : tensor<?x12xf32>
// CHECK-NEXT: matmul %{{.*}}, @fc.MatMul_weight : tensor<?x2xf32>
// CHECK-NEXT: return
""", tmp_path)
    for batch in (1, 5):
        assert_matches_reference(graph, onnx_model, {"x": np.random.default_rng(batch).random((batch, 3, 4), F32)})


def test_static_shape_subgraph_folds(tmp_path: Path):
    """ "Shape sub-graphs (`Shape`, `Gather` on shapes, `Concat`, `Range`, `ConstantOfShape`, `Expand`, `Reshape`
    with a computed shape) are folded where static": nothing of the chain is left but the reshape."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Cast", ["s"], ["sf"], to=1),
             helper.make_node("Range", ["start", "limit", "delta"], ["r"]),
             helper.make_node("ConstantOfShape", ["two"], ["ones"], value=onnx.numpy_helper.from_array(
                 np.array([1], I64))),
             helper.make_node("Mul", ["ones", "r"], ["m"]), helper.make_node("Identity", ["m"], ["m2"]),
             helper.make_node("Expand", ["x", "m2"], ["e"]),
             helper.make_node("Reshape", ["e", "flat"], ["y"])]
    onnx_model = model(nodes, {"x": (F32, [2, 1, 1])}, ["y"],
                       initializers={"start": np.array(2, I64), "limit": np.array(4, I64), "delta": np.array(2, I64),
                                     "two": np.array([3], I64), "flat": np.array([2, -1], I64)})
    graph = import_graph(onnx_model)
    filecheck(str(graph), """
// CHECK-LABEL: func @forward(%x: tensor<2x1x1xf32>)
// CHECK-NEXT: broadcast_to %x {shape = [2, 2, 2]} : tensor<2x2x2xf32>
// CHECK-NEXT: reshape %{{.*}} {shape = [2, -1]} : tensor<2x4xf32>
// CHECK-NEXT: return
""", tmp_path)
    assert_matches_reference(graph, onnx_model, {"x": np.random.default_rng(0).random((2, 1, 1), F32)})


def test_weights_from_constant_nodes_are_folded_into_parameters():
    """ "a model whose weights come from `ConstantOfShape`/`Constant` nodes is constant-folded into parameters":
    a float value of more than one element a run-time node reads is a parameter; a scalar stays a constant."""
    w = np.arange(6, dtype=F32).reshape(3, 2)
    nodes = [helper.make_node("Constant", [], ["w"], value=onnx.numpy_helper.from_array(w)),
             helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
             helper.make_node("ConstantOfShape", ["bias_shape"], ["bias"],
                              value=onnx.numpy_helper.from_array(np.array([0.5], F32))),
             helper.make_node("Constant", [], ["two"], value_float=2.0),
             helper.make_node("MatMul", ["x", "wt"], ["h"]), helper.make_node("Add", ["h", "bias"], ["hb"]),
             helper.make_node("Mul", ["hb", "two"], ["y"])]
    onnx_model = model(nodes, {"x": (F32, ["n", 2])}, ["y"], initializers={"bias_shape": np.array([3], I64)})
    graph = import_graph(onnx_model)
    assert sorted(graph.params) == ["bias", "wt"]
    np.testing.assert_array_equal(graph.params["wt"].data, w.T)
    assert_matches_reference(graph, onnx_model, {"x": np.ones((4, 2), F32)})


def test_compile_time_initializers_are_no_parameters():
    """ "Integer initializers and initializers only read as compile-time values (shapes, axes) are known values,
    not parameters" (the brief): only the float weight a run-time op reads is a parameter."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Mul", ["r", "scale"], ["y"]),
             helper.make_node("Range", ["f0", "f3", "f1"], ["unused"])]
    onnx_model = model(nodes, {"x": (F32, [2, 3])}, ["y"],
                       initializers={"shape": np.array([3, 2], I64), "scale": np.full((3, 2), 2, F32),
                                     "f0": np.array(0, F32), "f3": np.array(3, F32), "f1": np.array(1, F32)})
    graph = import_graph(onnx_model)
    assert list(graph.params) == ["scale"]


def test_if_on_a_known_condition_is_inlined_and_a_run_time_one_refused():
    """ "`If` whose condition folds to a constant is inlined"; one whose condition is an input is refused."""
    def branch(op: str) -> onnx.GraphProto:
        return helper.make_graph([helper.make_node(op, ["x"], ["out"])], op,
                                 [], [helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, None)])

    def with_condition(cond_nodes, inputs):
        nodes = [*cond_nodes, helper.make_node("If", ["c"], ["y"], then_branch=branch("Relu"),
                                               else_branch=branch("Neg"))]
        return model(nodes, inputs, ["y"], initializers={"k": np.array([4], I64)})

    shape_is_4 = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Equal", ["s", "k"], ["c2"]),
                  helper.make_node("Squeeze", ["c2", "ax"], ["c"])]
    onnx_model = with_condition(shape_is_4, {"x": (F32, [4])})
    onnx_model.graph.initializer.append(onnx.numpy_helper.from_array(np.array([0], I64), "ax"))
    graph = import_graph(onnx_model)
    assert [op.kind for op in graph.functions["forward"].ops] == ["relu"]
    assert_matches_reference(graph, onnx_model, {"x": np.array([-1, 2, -3, 4], F32)})
    with pytest.raises(UnsupportedModel, match=r"\(If, opset 17\): the If condition \(input 0\) is computed at run"):
        import_graph(with_condition([], {"x": (F32, [4]), "c": (np.bool_, [])}))


def test_castlike_of_a_constant_folds_whatever_its_target_holds(tmp_path: Path):
    """CastLike: "the output tensor has the same type as the target_type input" (its type alone), so a CastLike of a
    constant folds at import even when the target is computed at run time: Pad's constant value, cast to the run-time
    x's dtype, is known and becomes the pad's attribute (no cast left)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Constant", [], ["v"], value=onnx.numpy_helper.from_array(np.array(2.5, np.float64))),
             helper.make_node("CastLike", ["v", "r"], ["vc"]), helper.make_node("Pad", ["r", "pads", "vc"], ["y"])]
    onnx_model = model(nodes, {"x": (F32, ["n", 3])}, ["y"], initializers={"pads": np.array([0, 1, 0, 2], I64)})
    graph = import_graph(onnx_model)
    filecheck(str(graph), """
// CHECK-LABEL: func @forward(%x: tensor<?{n}x3xf32>)
// CHECK-NEXT: relu %x
// CHECK-NEXT: pad %{{.*}} {before = [0, 1], after = [0, 2], value = 2.5} : tensor<?x6xf32>
// CHECK-NEXT: return
""", tmp_path)
    assert_matches_reference(graph, onnx_model, {"x": np.random.default_rng(3).standard_normal((2, 3), F32)})


def test_one_error_lists_every_root_refusal():
    """ "Anything kiln cannot import is reported in one error that lists every unsupported node (name, op type,
    opset, the reason), never one at a time": a node downstream of a refused one is listed only when it has no
    converter of its own."""
    nodes = [helper.make_node("FancyOp", ["x"], ["a"], name="fancy"),
             helper.make_node("Relu", ["a"], ["b"], name="after"),
             helper.make_node("OtherOp", ["b"], ["c"], name="other"),
             helper.make_node("Reshape", ["x", "x_shape"], ["d"], name="dyn"),
             helper.make_node("Add", ["c", "d"], ["y"], name="sum")]
    onnx_model = model(nodes, {"x": (F32, [2]), "x_shape": (I64, [1])}, ["y"])
    with pytest.raises(UnsupportedModel) as caught:
        import_graph(onnx_model)
    assert [str(r) for r in caught.value.refusals] == [
        "fancy (FancyOp, opset 17): no converter for FancyOp",
        "other (OtherOp, opset 17): no converter for OtherOp",
        "dyn (Reshape, opset 17): the shape (input 1) is computed at run time; kiln needs it at compile time"]
    assert str(caught.value).startswith("<model>: 3 node(s) kiln cannot import:\n  fancy (FancyOp")


@pytest.mark.parametrize("opset", [6, onnx.defs.onnx_opset_version() + 1])
def test_opsets_outside_7_to_newest_are_refused(opset: int):
    """ "Opsets 7 through the newest the installed onnx knows ... a model outside it is refused"."""
    onnx_model = model([helper.make_node("Relu", ["x"], ["y"])], {"x": (F32, [2])}, ["y"], opset=opset)
    with pytest.raises(UnsupportedModel, match=rf"\(model, opset {opset}\): kiln imports opsets 7\.\."):
        import_graph(onnx_model)


def test_input_shapes_override_the_file_dims():
    """`input_shapes={name: shape}` overrides input dims (None for a dynamic one); an unknown name is an error."""
    onnx_model = model([helper.make_node("Relu", ["x"], ["y"])], {"x": (F32, ["n", 3])}, ["y"])
    assert import_graph(onnx_model).functions["forward"].args[0].type.shape == (None, 3)
    assert import_graph(onnx_model, input_shapes={"x": [8, 3]}).functions["forward"].args[0].type.shape == (8, 3)
    with pytest.raises(Exception, match=r"input_shapes names \['z'\], which are no graph inputs"):
        import_graph(onnx_model, input_shapes={"z": [1]})


def _weights_model() -> onnx.ModelProto:
    nodes = [helper.make_node("MatMul", ["x", "onnx::MatMul_12"], ["h"]),
             helper.make_node("Add", ["h", "/layer1/conv/bias"], ["y"])]
    return model(nodes, {"x": (F32, [1, 4])}, ["y"],
                 initializers={"onnx::MatMul_12": np.ones((4, 3), F32), "/layer1/conv/bias": np.arange(3, dtype=F32)})


def test_paths_are_sanitized_and_map_back_to_onnx_names(tmp_path: Path):
    """ "paths from the initializer names, sanitized and mapped back on export": `OnnxImport.onnx_names`."""
    imported = import_model(_weights_model())
    assert list(imported.graph.params) == ["onnx.MatMul_12", "layer1.conv.bias"]
    assert imported.onnx_names == {"onnx.MatMul_12": "onnx::MatMul_12", "layer1.conv.bias": "/layer1/conv/bias"}
    assert sanitized("conv1.weight") == "conv1.weight"


def test_param_ids_are_stored_or_derived_deterministically(tmp_path: Path):
    """ "ParamIds from `metadata_props` where kiln wrote them, otherwise derived deterministically from name and
    content, so two imports of one file agree"."""
    path = tmp_path / "m.onnx"
    onnx.save(_weights_model(), path)
    first, second = (import_graph(path).params for _ in range(2))
    assert {p: n.id for p, n in first.items()} == {p: n.id for p, n in second.items()}
    assert first["onnx.MatMul_12"].id != first["layer1.conv.bias"].id
    changed = _weights_model()
    changed.graph.initializer[1].CopyFrom(onnx.numpy_helper.from_array(np.zeros(3, F32), "/layer1/conv/bias"))
    assert import_graph(changed).params["layer1.conv.bias"].id != first["layer1.conv.bias"].id
    tagged = _weights_model()
    tagged.graph.initializer[0].metadata_props.add(key=PARAM_ID_KEY, value="12345")
    assert import_graph(tagged).params["onnx.MatMul_12"].id == 12345


def test_external_data_is_memory_mapped_and_must_stay_in_the_folder(tmp_path: Path):
    """ "external data read lazily through the records layer (memory-mapped, no copy) ... locations outside the
    model's folder are refused (`RecordError`)"."""
    path = tmp_path / "m.onnx"
    onnx.save(_weights_model(), path, save_as_external_data=True, all_tensors_to_one_file=True, location="w.bin",
              size_threshold=0)
    graph = import_graph(path)
    data = graph.params["onnx.MatMul_12"].data
    assert isinstance(data, np.memmap) and not data.flags.writeable
    assert_matches_reference(graph, onnx.load(path), {"x": np.ones((1, 4), F32)})
    escaped = onnx.load(path, load_external_data=False)
    for entry in escaped.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../w.bin"
    outside = tmp_path / "sub"
    outside.mkdir()
    onnx.save(escaped, outside / "m.onnx")
    with pytest.raises(RecordError, match=r"external_data location '\.\./w\.bin' is not a file inside"):
        import_graph(outside / "m.onnx")


def test_arithmetic_on_run_time_dims_reaches_the_reshape(tmp_path: Path):
    """Shape sub-graphs "kept symbolic where not [static]": `batch * seq` of a [?, ?, 4] tensor is a run-time
    element the Reshape makes -1; a target with two run-time dims of x copies them from x (`like`, `copy`); two
    computed ones have no reshape kiln can make and are refused."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "i0"], ["b"]),
             helper.make_node("Gather", ["s", "i1"], ["t"]), helper.make_node("Mul", ["b", "t"], ["bt"]),
             helper.make_node("Unsqueeze", ["bt", "axes"], ["btu"]),
             helper.make_node("Concat", ["btu", "last"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    initializers = {"i0": np.array(0, I64), "i1": np.array(1, I64), "axes": np.array([0], I64),
                    "last": np.array([4], I64)}
    onnx_model = model(nodes, {"x": (F32, ["batch", "seq", 4])}, ["y"], initializers=initializers)
    graph = import_graph(onnx_model)
    filecheck(str(graph), """
// CHECK-LABEL: func @forward(%x: tensor<?{batch}x?{seq}x4xf32>)
// CHECK-NEXT: reshape %x {shape = [-1, 4]} : tensor<?x4xf32>
// CHECK-NEXT: return
""", tmp_path)
    assert_matches_reference(graph, onnx_model, {"x": np.random.default_rng(0).random((2, 3, 4), F32)})
    two = model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Concat", ["s", "last"], ["shape"], axis=0),
                 helper.make_node("Reshape", ["x", "shape"], ["y"])],
                {"x": (F32, ["batch", "seq", 4])}, ["y"], initializers={"last": np.array([1], I64)})
    filecheck(str(import_graph(two)), """
// CHECK-LABEL: func @forward(%x: tensor<?{batch}x?{seq}x4xf32>)
// CHECK-NEXT: reshape %x, %x {shape = [-1, -1, 4, 1], copy = [0, 1, -1, -1]} : tensor<?{batch}x?{seq}x4x1xf32>
// CHECK-NEXT: return
""", tmp_path)
    assert_matches_reference(import_graph(two), two, {"x": np.random.default_rng(1).random((2, 3, 4), F32)})
    nodes[5] = helper.make_node("Concat", ["btu", "btu", "last"], ["shape"], axis=0)
    computed = model(nodes, {"x": (F32, ["batch", "seq", 4])}, ["y"], initializers=initializers)
    with pytest.raises(UnsupportedModel, match=r"to 2 run-time dims, more than one of them not a dim of a single"):
        import_graph(computed)


def test_reductions_and_expand_keep_the_dim_names_of_the_input(tmp_path: Path):
    """A `dim_param` dim "stays symbolic" by its name through a reduction (the reduced axis drops, or becomes 1
    with keepdims) and through Expand (a target 1 keeps the input's dim)."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
             helper.make_node("ReduceSum", ["x", "last"], ["s"], keepdims=0),
             helper.make_node("Expand", ["m", "to"], ["e"])]
    onnx_model = model(nodes, {"x": (F32, ["batch", "seq", 4])}, ["m", "s", "e"], opset=13,
                       initializers={"last": np.array([2], I64), "to": np.array([1, 3, 4], I64)})
    graph = import_graph(onnx_model)
    filecheck(str(graph), """
// CHECK-LABEL: func @forward(%x: tensor<?{batch}x?{seq}x4xf32>)
// CHECK-NEXT: mean %x {axes = [1], keepdims = true} : tensor<?{batch}x1x4xf32>
// CHECK-NEXT: sum %x {axes = [2]} : tensor<?{batch}x?{seq}xf32>
// CHECK-NEXT: broadcast_to %{{.*}} {shape = [-1, 3, 4]} : tensor<?{batch}x3x4xf32>
// CHECK-NEXT: return
""", tmp_path)
    assert_matches_reference(graph, onnx_model, {"x": np.random.default_rng(2).random((2, 5, 4), F32)})


def test_external_data_past_2_gib_is_mapped_not_read(tmp_path: Path):
    """ "> 2 GiB files included": a weight at an offset past 2**31 in a sparse 2.1 GiB file is mapped in place."""
    offset = 2**31 + 4096
    weight = np.arange(4, dtype=F32)
    with open(tmp_path / "big.bin", "wb") as f:
        f.seek(offset)
        f.write(weight.tobytes())
    tensor = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[4],
                              data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", "big.bin"), ("offset", str(offset)), ("length", "16")):
        tensor.external_data.add(key=key, value=value)
    onnx_model = model([helper.make_node("Add", ["x", "w"], ["y"])], {"x": (F32, [4])}, ["y"])
    onnx_model.graph.initializer.append(tensor)
    onnx.save(onnx_model, tmp_path / "m.onnx")
    graph = import_graph(tmp_path / "m.onnx")
    data = graph.params["w"].data
    assert isinstance(data, np.memmap) and data.offset == offset
    np.testing.assert_array_equal(interpret(graph, [np.ones(4, F32)])[0], weight + 1)


def test_causal_mask_of_a_run_time_length_stays_dynamic():
    """torch's GPT-2 mask `triu(ones(t, t, dtype=bool), 1)` over a run-time t exports as Shape -> Gather -> Concat ->
    ConstantOfShape -> Trilu -> Where: ConstantOfShape "generate[s] a tensor with given value and shape" where the
    shape is only known at run time, and Trilu keeps the `?` dims; one import serves every length."""
    nodes = [helper.make_node("Shape", ["s"], ["shape"]), helper.make_node("Gather", ["shape", "one"], ["t"]),
             helper.make_node("Unsqueeze", ["t", "axes"], ["tu"]),
             helper.make_node("Concat", ["tu", "tu"], ["tt"], axis=0),
             helper.make_node("ConstantOfShape", ["tt"], ["ones"],
                              value=onnx.numpy_helper.from_array(np.array([True]))),
             helper.make_node("Trilu", ["ones", "one"], ["causal"], upper=1),
             helper.make_node("Where", ["causal", "ninf", "s"], ["y"])]
    onnx_model = model(nodes, {"s": (F32, ["batch", "seq", "seq"])}, ["y"],
                       initializers={"one": np.array(1, I64), "axes": np.array([0], I64),
                                     "ninf": np.array(-np.inf, F32)})
    graph = import_graph(onnx_model)
    assert graph.functions["forward"].results[0].type.shape == (None, None, None)
    for batch, seq in ((1, 2), (3, 5)):
        assert_matches_reference(graph, onnx_model,
                                 {"s": np.random.default_rng(seq).random((batch, seq, seq), F32)})


@pytest.mark.parametrize("name, field", [
    (b"batch", r"graph\.input\[0\]\.type\.tensor_type\.shape\.dim\[0\]\.dim_param"),
    (b"rest", r"graph\.node\[3\]\.input\[1\]"),  # the Concat's input, first of the name's two places
])
def test_a_string_that_is_not_utf8_is_an_error_naming_file_and_field(tmp_path: Path, name: bytes, field: str):
    """Found by the onnx_import fuzzer: protobuf returns a string field that is not UTF-8 as bytes, and the dim
    name check raised TypeError; any such string (a dim_param, a node's output name) is a RecordError naming the
    file and the field (the first in the file's order), whether the model comes as a file or parsed."""
    path = tmp_path / "bad.onnx"
    data = _torch_style_reshape("batch").SerializeToString()
    assert data.count(name) >= 1
    path.write_bytes(data.replace(name, b"\xff\xfe" + name[2:]))
    with pytest.raises(RecordError, match=rf"bad\.onnx: {field} is not UTF-8 text"):
        import_model(path)
    with pytest.raises(RecordError, match=rf"parsed\.onnx: {field} is not UTF-8 text"):
        import_model(onnx.load_from_string(path.read_bytes()), source="parsed.onnx")
