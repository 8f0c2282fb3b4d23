"""Parameter layout mappers (Burn's param_mapper, burn-notes §2.2 "Load and save", §2.6, §2.10): a declarative
`kiln.Layout` carried into the graph, and Python load/save/init mappers kept on the frontend Param."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import Layout, Lora, Module, Param, ParamGroup, Quantizer, QuantScheme, nn
from kiln.ir import RecordError, ShapeError, interpret, parse

AD = kiln.Device("cpu").autodiff()
LIVE = np.arange(6, dtype=np.float32).reshape(2, 3)


class Net(Module):
    """A Linear whose weight is recorded in PyTorch's [out, in] layout, and a reshaped lazy parameter."""

    def __init__(self, device: kiln.Device | None = None):
        self.fc = nn.Linear(3, 2, device=device)
        self.fc.weight = self.fc.weight.with_layout(Layout.transpose())
        self.flat = Param.lazy((2, 2), kiln.ir.Init("normal"), device=device, layout=Layout(reshape=(4,)))

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc(x)


def test_layout_directions_are_inverse_and_match_numpy():
    # one description, both directions: saving permutes then reshapes, loading undoes both (numpy oracle)
    layout = Layout(permute=(2, 0, 1), reshape=(3, 4))
    live = np.arange(12.0).reshape(2, 2, 3)
    saved = layout.save(live)
    np.testing.assert_array_equal(saved, np.transpose(live, (2, 0, 1)).reshape(3, 4))
    assert layout.file_shape((2, 2, 3)) == (3, 4)
    np.testing.assert_array_equal(layout.load(saved, (2, 2, 3)), live)


def test_transpose_is_torch_linear_layout():
    # PyTorch's Linear stores weight [out, in]; Burn's (and kiln's) Linear stores [in, out]
    torch_linear = torch.nn.Linear(3, 2)
    w = torch_linear.weight.detach().numpy()
    live = Layout.transpose().load(w, (3, 2))
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(x @ live, (torch_linear(torch.from_numpy(x)) - torch_linear.bias).detach().numpy(),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("make, message", [
    (lambda: Layout(), "needs a permute or a reshape"),
    (lambda: Layout(permute=(0, 0)), "permute[0, 0] is not a permutation"),
    (lambda: Layout(reshape=(-1, 2)), "non-negative sizes"),
    (lambda: Param.from_data(LIVE, layout=Layout(permute=(1, 0, 2))),
     "permutes 3 axes but the parameter has shape [2, 3]"),
    (lambda: Param.from_data(LIVE, layout=Layout(reshape=(5,))), "cannot reshape a parameter of shape [2, 3]"),
    (lambda: Param.from_data(LIVE, layout=Layout.transpose()).save_mapper(np.ravel), "a Layout (permute[1, 0]) or"),
])
def test_bad_layouts_are_shape_errors(make, message):
    with pytest.raises(ShapeError) as info:
        make()
    assert message in str(info.value)


def test_into_record_writes_the_save_form_and_stays_lazy():
    # Burn: "`into_record` records the on_save form, so a layout-changing mapper saves its save shape"
    # (test round_trip_a_shape_mapped_param)
    net = Net()
    record = net.into_record()
    assert record["fc.weight"].shape == (2, 3) and record["flat"].shape == (4,)
    assert not net.flat.is_initialized() and not net.fc.weight.is_initialized()
    np.testing.assert_array_equal(record["fc.weight"].array(), net.fc.weight.val().numpy().T)
    np.testing.assert_array_equal(record["flat"].array(), net.flat.val().numpy().reshape(4))


def test_state_dict_uses_the_record_form_and_loads_back():
    net = Net()
    state = net.state_dict()
    assert state["fc.weight"].shape == (2, 3) and state["flat"].shape == (4,)
    loaded = Net().load_state_dict(state)
    np.testing.assert_array_equal(loaded.fc.weight.val().numpy(), net.fc.weight.val().numpy())
    np.testing.assert_array_equal(loaded.flat.val().numpy(), net.flat.val().numpy())


def test_load_record_checks_the_mapped_shape_and_maps_to_the_live_form(tmp_path):
    # Burn: load checks shape against the mapped form, so a record of the save shape loads into the live shape
    net = Net()
    net.save_file(tmp_path / "net.bpk")
    loaded = Net().load_file(tmp_path / "net.bpk")
    assert loaded.fc.weight.lazy_shape() == (3, 2) and loaded.fc.weight.id == net.fc.weight.id
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(loaded(kiln.tensor(x)).numpy(), net(kiln.tensor(x)).numpy(), rtol=1e-6)


def test_load_of_the_live_shape_names_both_shapes_and_the_layout():
    net = Net()
    live_form = {"fc.weight": np.zeros((3, 2), np.float32), "fc.bias": np.zeros(2, np.float32),
                 "flat": np.zeros(4, np.float32)}
    with pytest.raises(RecordError) as info:
        net.load_state_dict(live_form)
    assert ("fc.weight: shape mismatch, expected [2, 3] (the file form of live shape [3, 2] under layout "
            "permute[1, 0]) but record has [3, 2]") in str(info.value)


def test_layout_survives_state_methods_trace_and_materialize():
    # spec (materialize): "The resulting parameters retain their base parameter IDs, layout mappings and
    # configured trainability"
    net = Net(AD)
    layout = Layout.transpose()
    moved = net.freeze().unfreeze().valid().train().to_device("cpu").fork("cpu").no_grad()
    assert moved.fc.weight.layout == layout
    adapted = net.apply_lora(Lora(rank=1, alpha=1.0, param_group=ParamGroup.from_option_text(["fc.weight"])))
    assert adapted.fc.weight.layout == layout
    assert all(p.layout is None for r in adapted.fc.weight.reparam.chain() for _, p in r.factors)
    merged = adapted.materialize()
    assert merged.fc.weight.layout == layout and merged.fc.weight.id == net.fc.weight.id
    graph = kiln.trace(net, ((None, 3), "f32"))
    assert graph.params["fc.weight"].layout == layout
    assert parse(str(graph)).params["fc.weight"].layout == layout  # and it round-trips through .kir


def test_lora_records_base_in_file_form_and_factors_in_live_form():
    net = Net(AD).apply_lora(Lora(rank=1, alpha=1.0, param_group=ParamGroup.from_option_text(["fc.weight"])))
    record = net.into_record()
    assert record["fc.weight"].shape == (2, 3)
    assert record["fc.weight.lora.a"].shape == (3, 1) and record["fc.weight.lora.b"].shape == (1, 2)
    again = Net(AD).apply_lora(Lora(rank=1, alpha=1.0, param_group=ParamGroup.from_option_text(["fc.weight"])))
    again = again.load_record(record)
    np.testing.assert_array_equal(again.fc.weight.val().numpy(), net.fc.weight.val().numpy())


def test_quantized_mapped_param_runs_but_refuses_a_file_form_record():
    # a QFloat entry's scale blocks follow the live axes, so writing it permuted would be a wrong record
    net = Net().quantize_weights(Quantizer(param_group=ParamGroup.from_option_text(["fc.weight"])))
    assert net.fc.weight.layout == Layout.transpose()
    x = np.ones((1, 3), np.float32)
    assert net(kiln.tensor(x)).numpy().shape == (1, 2)
    with pytest.raises(RecordError) as info:
        net.into_record()
    assert "fc.weight: a quantized parameter cannot be recorded in a file form (permute[1, 0])" in str(info.value)


class One(Module):
    def __init__(self, w: Param):
        self.w = w


def test_quantized_entry_loads_into_a_mapped_float_param_dequantized_then_mapped():
    source = One(Param.from_data(LIVE)).quantize_weights(Quantizer(scheme=QuantScheme("q8s")))
    record = source.into_record()
    assert record["w"].scheme is not None
    loaded = One(Param.from_data(np.zeros((3, 2), np.float32), layout=Layout.transpose())).load_record(record)
    np.testing.assert_allclose(loaded.w.val().numpy(), LIVE.T, atol=5 / 127)  # q8s: error under one step


def test_interpreted_graph_is_unchanged_by_a_layout():
    # a layout is the file form only: the function computes with the live value (interpreter vs numpy)
    graph = parse("""module @M {
  param @w : tensor<2x3xf32> {id = "0x1", data = dense<tensor<2x3xf32>, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]>,
                              layout = permute[1, 0]}
  func @forward(%x: tensor<1x2xf32>) -> (tensor<1x3xf32>) {
    %0 = matmul %x, @w : tensor<1x3xf32>
    return %0
  }
}""")
    x = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_allclose(interpret(graph, [x])[0], x @ LIVE)


class Mapped(Module):
    """Python mappers (frontend only): recorded flattened, loaded back reshaped."""

    def __init__(self):
        self.w = Param.from_data(LIVE).save_mapper(np.ravel).load_mapper(lambda a: a.reshape(2, 3))


def test_python_save_and_load_mappers_round_trip_and_stay_off_the_graph():
    # Burn: "`transform_for_load` applies `on_load` ... `transform_for_save` applies `on_save` to `val()`"
    m = Mapped()
    record = m.into_record()
    assert record["w"].shape == (6,)
    np.testing.assert_array_equal(record["w"].array(), LIVE.ravel())
    target = Mapped()
    loaded = target.load_state_dict({"w": np.arange(6, 12, dtype=np.float32)})
    np.testing.assert_array_equal(loaded.w.val().numpy(), np.arange(6, 12, dtype=np.float32).reshape(2, 3))
    assert loaded.w.mapper is target.w.mapper
    assert m.state_graph().params["w"].layout is None  # a Python mapper has no graph form


def test_python_load_mapper_result_is_checked_against_the_live_shape():
    m = Param.from_data(LIVE).load_mapper(lambda a: a)
    model = Mapped()
    model.w = m
    with pytest.raises(RecordError) as info:
        model.load_state_dict({"w": np.zeros(6, np.float32)})
    assert "w: shape mismatch, expected [2, 3] but record has [6]" in str(info.value)


def test_materialize_keeps_the_python_mapper():
    # burn-notes §2.6: materialize keeps "the id, `param_mapper` and `is_active`"
    m = Mapped()
    m.w = m.w.replace(device=AD)
    adapted = m.apply_lora(Lora(rank=1, alpha=1.0))
    assert adapted.materialize().w.mapper is m.w.mapper


def test_init_mapper_chains_without_initializing():
    # burn-notes §2.2: "`init_mapper` chains onto a lazy init without triggering it ... the result is a leaf"
    p = Param.lazy((2, 3), kiln.ir.Init("ones"), device=AD)
    mapped = p.init_mapper(lambda a: a * 3)
    assert not p.is_initialized() and not mapped.is_initialized()
    np.testing.assert_array_equal(mapped.val().numpy(), np.full((2, 3), 3.0, np.float32))
    assert not p.is_initialized() and mapped.leaf and mapped.autodiff_node != p.autodiff_node
    # Burn applies the mapper at once to an initialized value
    ready = Param.from_data(LIVE).init_mapper(np.negative)
    np.testing.assert_array_equal(ready.val().numpy(), -LIVE)


def test_init_mapper_of_the_wrong_shape_names_the_parameter():
    p = Param.lazy((2, 3), kiln.ir.Init("ones"), id=5).init_mapper(np.ravel)
    with pytest.raises(ShapeError) as info:
        p.val()
    assert str(info.value).startswith(f"init mapper ravel gave shape [6] for parameter {kiln.ParamId(5)}")


def test_python_mapper_errors_are_record_errors_naming_the_path():
    bad = One(Param.from_data(LIVE).save_mapper(lambda a: a.astype(object)))
    with pytest.raises(RecordError, match="^w: a mapper gave numpy dtype object has no kiln DType"):
        bad.into_record()
    quantized = One(Param.from_data(LIVE)).quantize_weights(Quantizer()).into_record()
    reader = One(Param.from_data(LIVE).load_mapper(lambda a: a))
    with pytest.raises(RecordError, match=r"^w: a Python load mapper cannot read a quantized \(QFloat\) entry"):
        reader.try_load_record(quantized)


def test_linear_with_torch_weight_layout_loads_a_torch_state_dict():
    # PyTorch's Linear state_dict holds weight [out, in]; kiln's Linear computes with [in, out] (torch oracle)
    torch.manual_seed(0)
    reference = torch.nn.Linear(3, 2)
    state = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    linear = nn.Linear(3, 2, weight_layout=Layout.transpose()).load_state_dict(state)
    x = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(linear(kiln.tensor(x)).numpy(), reference(torch.from_numpy(x)).detach().numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(linear.state_dict()["weight"], state["weight"])  # saved back as torch has it
