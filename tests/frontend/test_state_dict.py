"""`state_dict()` / `load_state_dict(d)` (issue 11): `{path: numpy array}` views over `into_record` and
`try_load_record` for PyTorch users; torch's own layers are the oracle for the loaded values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import Quantizer, nn


def test_state_dict_is_the_record_as_arrays_and_initializes_nothing():
    # module-trait.txt: into_record "Collect this module's tensor parameters into a ModuleRecord"; flags are not
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.1), nn.LayerNorm(2))
    state = model.state_dict()
    assert list(state) == ["layers.0.weight", "layers.0.bias", "layers.2.gamma", "layers.2.beta"]
    assert not model.layers[0].weight.is_initialized()
    for path, param in model.named_parameters():
        np.testing.assert_array_equal(state[path], param.state.get())  # the value it initializes to


def test_torch_weights_load_into_the_same_architecture():
    torch.manual_seed(0)
    torch_layer = torch.nn.Linear(3, 2)
    state = {k: v.detach().numpy() for k, v in torch_layer.state_dict().items()}
    layer = nn.Linear(3, 2).load_state_dict({"weight": state["weight"].T, "bias": state["bias"]})  # Burn: [in, out]
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(layer(kiln.tensor(x)).numpy(), torch_layer(torch.tensor(x)).detach().numpy(),
                               rtol=1e-6, atol=1e-6)  # an output near zero has no relative precision


def test_load_keeps_ids_and_dtypes_and_leaves_the_receiver():
    layer = nn.Linear(3, 2)
    loaded = layer.load_state_dict({"weight": np.ones((3, 2)), "bias": np.zeros(2)})  # f64 arrays
    assert loaded.weight.id == layer.weight.id and loaded.weight.type.dtype is kiln.ir.DType.f32
    np.testing.assert_array_equal(loaded.weight.val().numpy(), np.ones((3, 2), np.float32))
    assert not layer.weight.is_initialized()  # modules are values: the receiver is unchanged


def test_missing_and_unexpected_keys_raise_one_record_error_listing_them():
    layer = nn.Linear(3, 2)
    with pytest.raises(kiln.RecordError, match=r"^Missing tensors: \['bias'\]; Unused tensors: \['bogus', 'w'\]$"):
        layer.load_state_dict({"weight": np.ones((3, 2)), "w": np.ones(1), "bogus": np.ones(1)})
    partial = layer.load_state_dict({"weight": np.ones((3, 2)), "bogus": np.ones(1)}, strict=False)
    np.testing.assert_array_equal(partial.weight.val().numpy(), np.ones((3, 2)))
    assert partial.bias is layer.bias


def test_bad_shapes_and_dtypes_name_the_key():
    layer = nn.Linear(3, 2)
    with pytest.raises(kiln.RecordError, match=r"weight: shape mismatch, expected \[3, 2\] but record has \[2, 3\]"):
        layer.load_state_dict({"weight": np.ones((2, 3)), "bias": np.ones(2)})
    with pytest.raises(kiln.RecordError, match=r"^bias: numpy dtype <U1 has no kiln DType$"):
        layer.load_state_dict({"weight": np.ones((3, 2)), "bias": np.array(["a", "b"])})


def test_quantized_weights_round_trip_codes_and_scales():
    model = nn.Linear(64, 32, bias=False).quantize_weights(Quantizer())
    state = model.state_dict()
    assert list(state) == ["weight", "weight.scales"] and state["weight"].dtype == np.int8
    fresh = nn.Linear(64, 32, bias=False).quantize_weights(Quantizer()).load_state_dict(state)
    np.testing.assert_array_equal(fresh.weight.val().numpy(), model.weight.val().numpy())
