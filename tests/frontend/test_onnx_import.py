"""kiln.import_onnx: an ONNX model as a kiln Module (issue 12, "What users get" and "Round trips").

Oracles: onnxruntime running the same file, numpy formulas of the model, torch autograd; never kiln itself.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx_mlp import MLP

import kiln
from kiln import Lora, ParamGroup
from kiln.ir import RecordError, ShapeError, interpret

RNG = np.random.default_rng(12)
AD = kiln.Device("cpu").autodiff()


def floats(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def ort_run(path: Path | onnx.ModelProto, **feeds: np.ndarray) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    data = path.SerializeToString() if isinstance(path, onnx.ModelProto) else str(path)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, feeds)


def ids(module: kiln.Module) -> dict[str, kiln.ParamId]:
    return {p: leaf.id for p, leaf in module.named_parameters()}


@pytest.fixture
def mlp_file(tmp_path: Path) -> tuple[MLP, Path]:
    kiln.seed(12)  # one model in every test, so the build cache compiles it once
    module = MLP()
    return module, kiln.export_onnx(module, ((None, 6), "f32"), path=tmp_path / "mlp.onnx")


def foreign_model() -> onnx.ModelProto:
    """A model as other exporters write it: names no module path is made of, no kiln.param_id metadata."""
    w = numpy_helper.from_array(floats(4, 3), "onnx::MatMul_7")
    b = numpy_helper.from_array(floats(3), "/head/Add.bias")
    train = numpy_helper.from_array(floats(3), "train")
    nodes = [helper.make_node("MatMul", ["input", "onnx::MatMul_7"], ["h"], name="/head/MatMul"),
             helper.make_node("Add", ["h", "/head/Add.bias"], ["a"], name="/head/Add"),
             helper.make_node("Mul", ["a", "train"], ["m"], name="scale"),
             helper.make_node("Tanh", ["m"], ["out"], name="act")]
    graph = helper.make_graph(nodes, "foreign", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                               ["batch", 4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3])], [w, b, train])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def foreign_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    w, b, s = (numpy_helper.to_array(t) for t in model.graph.initializer)
    return np.tanh((x @ w + b) * s)


# round trips --------------------------------------------------------------------------------------------------
def test_export_import_keeps_outputs_paths_and_param_ids(mlp_file):
    """"kiln module → export_onnx → import_onnx → same outputs, same parameter paths and ParamIds"."""
    module, path = mlp_file
    imported = kiln.import_onnx(path)
    assert ids(imported) == ids(module)
    x = floats(4, 6)
    (want,) = ort_run(path, x=x)
    np.testing.assert_allclose(imported(x).numpy(), want, rtol=1e-5, atol=1e-6)
    w1, b1, w2, b2 = (p.val().numpy() for _, p in module.named_parameters())
    np.testing.assert_allclose(imported(x).numpy(), np.maximum(x @ w1 + b1, 0) @ w2 + b2, rtol=1e-5, atol=1e-6)


def test_export_import_export_keeps_names_and_meaning(mlp_file, tmp_path: Path):
    """"export → import → export keeps the graph's meaning and the names"."""
    _, path = mlp_file
    again = kiln.export_onnx(kiln.import_onnx(path), ((None, 6), "f32"), path=tmp_path / "again.onnx")
    first, second = onnx.load(path), onnx.load(again)
    assert [t.name for t in second.graph.initializer] == [t.name for t in first.graph.initializer]
    assert [t.metadata_props[0].value for t in second.graph.initializer] == \
        [t.metadata_props[0].value for t in first.graph.initializer]
    x = floats(3, 6)
    np.testing.assert_allclose(ort_run(again, x=x)[0], ort_run(path, x=x)[0], rtol=1e-6)


def test_foreign_names_become_paths_and_are_written_back(tmp_path: Path):
    """"paths from the initializer names, sanitized and mapped back on export"; a name that is a Module method
    (`train`) moves aside so the module's methods keep working."""
    model = foreign_model()
    imported = kiln.import_onnx(model)
    assert [p for p, _ in imported.named_parameters()] == ["onnx.MatMul_7", "head.Add.bias", "train_"]
    assert imported.onnx_names == {"onnx.MatMul_7": "onnx::MatMul_7", "head.Add.bias": "/head/Add.bias",
                                   "train_": "train"}
    assert imported.train() is not None and callable(imported.valid)
    x = floats(2, 4)
    np.testing.assert_allclose(imported(x).numpy(), foreign_reference(model, x), rtol=1e-5, atol=1e-6)
    out = kiln.export_onnx(imported, ((None, 4), "f32"), path=tmp_path / "back.onnx")
    assert [t.name for t in onnx.load(out).graph.initializer] == ["onnx::MatMul_7", "/head/Add.bias", "train"]
    assert [i.name for i in onnx.load(out).graph.input] == ["input"]
    np.testing.assert_allclose(ort_run(out, input=x)[0], foreign_reference(model, x), rtol=1e-5, atol=1e-6)


def test_ids_without_metadata_are_the_same_on_every_import(tmp_path: Path):
    """"ParamIds from metadata_props where kiln wrote them, otherwise derived deterministically from name and
    content, so two imports of one file agree"."""
    onnx.save(foreign_model(), tmp_path / "f.onnx")
    first, second = ids(kiln.import_onnx(tmp_path / "f.onnx")), ids(kiln.import_onnx(tmp_path / "f.onnx"))
    assert first == second and len(set(first.values())) == 3
    changed = foreign_model()
    changed.graph.initializer[0].float_data[:] = [1.0] * 12
    changed.graph.initializer[0].ClearField("raw_data")
    assert ids(kiln.import_onnx(changed))["onnx.MatMul_7"] != first["onnx.MatMul_7"]


# Module behaviour -----------------------------------------------------------------------------------------------
def test_parameters_nest_into_submodules_for_visit_map_and_groups(mlp_file):
    """The imported parameters behave as a hand-written module's: visit paths, num_params, devices, a glob group."""
    module, path = mlp_file
    imported = kiln.import_onnx(path, device=AD)
    assert imported.num_params() == module.num_params() == 6 * 5 + 5 + 5 * 3 + 3
    assert imported.devices() == [AD]
    frozen = imported.freeze_group(ParamGroup.from_glob("fc1.*"))
    assert {p: v.grad for p, v in frozen.named_parameters()} == {"fc1.weight": False, "fc1.bias": False,
                                                                  "fc2.weight": True, "fc2.bias": True}

    class Zero(kiln.ModuleMapper):
        def map_param(self, path, p):
            return kiln.Param.from_data(np.zeros(p.lazy_shape(), np.float32), id=p.id) if path == "fc2.bias" else p
    zeroed = imported.map(Zero())
    x = floats(2, 6)
    w1, b1, w2, _ = (p.val().numpy() for _, p in module.named_parameters())
    np.testing.assert_allclose(zeroed(x).numpy(), np.maximum(x @ w1 + b1, 0) @ w2, rtol=1e-5, atol=1e-6)
    assert "fc1: OnnxBlock" in repr(imported) and "tensor<6x5xf32>" in repr(imported)
    assert imported.graph.functions["forward"].args[0].name == "x"  # the imported graph, for graph users


def test_trace_and_valid_give_the_imported_function(mlp_file):
    _, path = mlp_file
    imported = kiln.import_onnx(path)
    graph = kiln.trace(imported.valid(), ((None, 6), "f32"))
    assert list(graph.params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    x = floats(5, 6)
    np.testing.assert_allclose(interpret(graph, [x])[0], ort_run(path, x=x)[0], rtol=1e-5, atol=1e-6)


def test_gradients_match_torch(mlp_file):
    """Autodiff through the replayed graph: d(sum(y^2))/dW against torch autograd on the same weights."""
    module, path = mlp_file
    imported = kiln.import_onnx(path, device=AD)
    x = floats(4, 6)
    grads = kiln.GradientsParams.from_grads((imported(kiln.tensor(x)) ** 2.0).sum().backward(), imported)
    tw = {p: torch.tensor(v.val().numpy(), requires_grad=True) for p, v in module.named_parameters()}
    y = torch.relu(torch.tensor(x) @ tw["fc1.weight"] + tw["fc1.bias"]) @ tw["fc2.weight"] + tw["fc2.bias"]
    (y ** 2).sum().backward()
    for p, leaf in imported.named_parameters():
        np.testing.assert_allclose(np.asarray(grads[leaf.id]), tw[p].grad.numpy(), rtol=1e-4, atol=1e-5)


def test_records_round_trip(mlp_file, tmp_path: Path):
    module, path = mlp_file
    imported = kiln.import_onnx(path)
    imported.save_file(tmp_path / "m.bpk")
    blank = kiln.import_onnx(foreign_free_copy(path, tmp_path))
    loaded = blank.load_file(tmp_path / "m.bpk")
    assert ids(loaded) == ids(module)
    x = floats(2, 6)
    np.testing.assert_allclose(loaded(x).numpy(), ort_run(path, x=x)[0], rtol=1e-5, atol=1e-6)


def foreign_free_copy(path: Path, tmp_path: Path) -> Path:
    """The same model with zeroed weights and no stored ids (so loading the record must restore both)."""
    model = onnx.load(path)
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(t)), t.name))
    onnx.save(model, tmp_path / "zeros.onnx")
    return tmp_path / "zeros.onnx"


def test_matmul_weights_are_lora_qlora_and_quantization_targets(mlp_file):
    """apply_lora / apply_qlora / quantize_weights pick an imported MatMul weight by path glob."""
    _, path = mlp_file
    imported = kiln.import_onnx(path, device=AD)
    lora = imported.apply_lora(Lora(rank=2, alpha=2.0, param_group=ParamGroup.from_glob("fc1.weight")))
    assert sorted(p for p, v in lora.named_parameters() if v.grad) == ["fc1.weight.lora.a", "fc1.weight.lora.b"]
    x = floats(3, 6)
    (want,) = ort_run(path, x=x)
    np.testing.assert_allclose(lora(x).numpy(), want, rtol=1e-5, atol=1e-6)  # b starts at zero
    q = kiln.Quantizer(scheme=kiln.QuantScheme().per_tensor(), param_group=ParamGroup.from_glob("*.weight"))
    quantized = imported.quantize_weights(q)
    kinds = {p: v.reparam.kind if v.reparam else None for p, v in quantized.leaves(factors=False)}
    assert kinds == {"fc1.weight": "dequantize", "fc1.bias": None, "fc2.weight": "dequantize", "fc2.bias": None}
    np.testing.assert_allclose(quantized(x).numpy(), want, atol=0.1)
    qlora = imported.apply_qlora(kiln.QLora(Lora(rank=2, alpha=2.0), q))
    assert {p for p, v in qlora.named_parameters() if v.grad} == {"fc1.weight.lora.a", "fc1.weight.lora.b",
                                                                  "fc2.weight.lora.a", "fc2.weight.lora.b"}


def test_lora_training_round_trip_agrees_with_onnxruntime(mlp_file, tmp_path: Path):
    """"imported model → apply_lora → a few training steps → materialize → export → onnxruntime agrees with
    kiln", and training moved the weights (the adapters learned)."""
    _, path = mlp_file
    model = kiln.import_onnx(path, device=AD).apply_lora(Lora(rank=2, alpha=4.0))
    x, target = floats(16, 6), floats(16, 3)
    step = kiln.compile_step(model, lambda m, a, b: kiln.nn.mse_loss(m(a), b), kiln.optim.Adam(),
                             ((None, 6), "f32"), ((None, 3), "f32"))
    losses = [float(step(0.05, x, target)) for _ in range(5)]
    assert losses[-1] < losses[0]
    trained = step.model().materialize()
    assert [p for p, _ in trained.named_parameters()] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    out = kiln.export_onnx(trained, ((None, 6), "f32"), path=tmp_path / "trained.onnx")
    (got,) = ort_run(out, x=x)
    np.testing.assert_allclose(got, trained(x).numpy(), rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, ort_run(path, x=x)[0], atol=1e-3)


def test_compiles_through_tvm(mlp_file):
    _, path = mlp_file
    exe = kiln.compile(kiln.import_onnx(path).valid(), ((None, 6), "f32"))
    x = floats(7, 6)
    np.testing.assert_allclose(np.asarray(exe(x)), ort_run(path, x=x)[0], rtol=1e-4, atol=1e-5)


# bad input ------------------------------------------------------------------------------------------------------
def test_bad_inputs_are_one_line_kiln_errors(mlp_file, tmp_path: Path):
    _, path = mlp_file
    imported = kiln.import_onnx(path)
    with pytest.raises(ShapeError, match=r"forward takes 1 inputs \(x\), got 2"):
        imported(floats(2, 6), floats(2, 6))
    with pytest.raises(ShapeError, match=r"input x must be tensor<\?\{batch\}x6xf32>, got tensor<2x5xf32>"):
        imported(floats(2, 5))
    with pytest.raises(ShapeError, match=r"input_shapes names \['y'\], which are no graph inputs"):
        kiln.import_onnx(path, input_shapes={"y": (1, 6)})
    bad = onnx.load(path)
    bad.graph.initializer[0].metadata_props[0].value = "zz"
    with pytest.raises(RecordError, match="initializer 'fc1.weight': kiln.param_id 'zz' is not a u64 in decimal"):
        kiln.import_onnx(bad)
    (tmp_path / "junk.onnx").write_bytes(b"\x12\xff not protobuf")
    with pytest.raises(RecordError, match="junk.onnx: not an ONNX model"):
        kiln.import_onnx(tmp_path / "junk.onnx")


def test_input_shapes_fix_dims(mlp_file):
    """`input_shapes` fixes an input's dims: the traced forward has them."""
    _, path = mlp_file
    imported = kiln.import_onnx(path, input_shapes={"x": (2, 6)})
    assert str(imported.graph.functions["forward"].args[0].type) == "tensor<2x6xf32>"
