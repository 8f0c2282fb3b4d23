"""PyTorch checkpoints into kiln modules (issue 16): state dicts that real torch saved (`torch.save` and, where
the package is installed, `safetensors.torch.save_file`) of an MLP, a CNN with BatchNorm and a transformer encoder
layer, loaded through `kiln.PyTorchAdapter` into the kiln model of the same architecture, must give torch's outputs
within f32 tolerance; and a kiln module written back in PyTorch's form must load into torch strictly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import nn
from kiln.nn import functional as F

ATOL = 2e-5


class TorchCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.relu(self.norm(self.conv(x))).flatten(1))


class KilnCNN(kiln.Module):
    def __init__(self):
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(F.relu(self.norm(self.conv(x))).reshape(-1, 4 * 6 * 6))


def _models():
    """(name, torch model in eval mode with random weights and running stats, kiln model, input)."""
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    cnn = TorchCNN()
    with torch.no_grad():  # running statistics that are not the defaults, so loading them is checked
        cnn.norm.running_mean.uniform_(-1, 1)
        cnn.norm.running_var.uniform_(0.5, 2)
        cnn.norm.weight.uniform_(0.5, 2)
        cnn.norm.bias.uniform_(-1, 1)
    encoder = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation="gelu", batch_first=True)
    return [
        ("mlp", mlp.eval(), nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
         rng.standard_normal((3, 8)).astype(np.float32)),
        ("cnn", cnn.eval(), KilnCNN(), rng.standard_normal((2, 2, 6, 6)).astype(np.float32)),
        ("encoder", encoder.eval(), nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0),
         rng.standard_normal((2, 5, 16)).astype(np.float32)),
    ]


def _save_torch(model, path):
    torch.save(model.state_dict(), path)
    return kiln.ModuleRecord.from_pytorch(path)


def _save_safetensors(model, path):
    st = pytest.importorskip("safetensors.torch")
    st.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return kiln.ModuleRecord.from_safetensors(path)


@pytest.mark.parametrize("save", [_save_torch, _save_safetensors], ids=["torch.save", "safetensors"])
@pytest.mark.parametrize("index", range(3), ids=["mlp", "cnn", "encoder"])
def test_a_pytorch_checkpoint_loads_into_the_same_kiln_architecture(tmp_path, save, index):
    # Burn's PyTorchToBurnAdapter: "Linear layer weight transposition (PyTorch: [out, in] -> Burn: [in, out])",
    # "Normalization parameter renaming (weight -> gamma, bias -> beta)"; num_batches_tracked is dropped.
    name, reference, model, x = _models()[index]
    record = save(reference, tmp_path / name)
    loaded = model.load_record(kiln.PyTorchAdapter().to_kiln(record, model)).valid()
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(loaded(kiln.tensor(x)).numpy(), expected, atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("index", range(3), ids=["mlp", "cnn", "encoder"])
def test_a_kiln_module_written_in_pytorch_form_loads_into_torch_strictly(tmp_path, index):
    # Burn's BurnToPyTorchAdapter: "Linear layer weight transposition (Burn: [in, out] -> PyTorch: [out, in])".
    name, reference, model, x = _models()[index]
    kiln.seed(index)
    record = kiln.PyTorchAdapter().to_pytorch(model.into_record(), model)
    record.to_safetensors(tmp_path / "m.safetensors")
    state = {k: torch.from_numpy(np.array(e.array()))
             for k, e in kiln.ModuleRecord.from_safetensors(tmp_path / "m.safetensors").items()}
    reference.load_state_dict(state, strict=True)
    with torch.no_grad():
        expected = reference(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(model.valid()(kiln.tensor(x)).numpy(), expected, atol=ATOL, rtol=1e-5)


def test_a_linear_declaring_the_pytorch_layout_takes_the_weight_as_stored():
    # README: `nn.Linear(3, 2, weight_layout=kiln.Layout.transpose())` records PyTorch's [out, in] already.
    torch.manual_seed(1)
    reference = torch.nn.Linear(3, 2)
    model = nn.Linear(3, 2, weight_layout=kiln.Layout.transpose())
    record = kiln.ModuleRecord({k: kiln.runtime.records.record.RecordEntry(kiln.ParamId(i + 1), kiln.ir.DType.f32,
                                                                           tuple(v.shape), v.detach().numpy())
                                for i, (k, v) in enumerate(reference.state_dict().items())})
    loaded = model.load_record(kiln.PyTorchAdapter().to_kiln(record, model))
    np.testing.assert_array_equal(loaded.weight.val().numpy(), reference.weight.detach().numpy().T)


def test_the_load_options_apply_unchanged_to_an_adapted_record(tmp_path):
    # Issue 16: "the existing load options (allow_partial, validate, one error listing every problem) apply".
    torch.manual_seed(2)
    reference = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    record = kiln.PyTorchAdapter().to_kiln(_save_torch(reference, tmp_path / "m.pt"), model)
    with pytest.raises(kiln.RecordError) as caught:
        model.try_load_record(record)
    assert "layers.2.weight" in str(caught.value) and "layers.2.bias" in str(caught.value)
    kept = model.try_load_record(record.validate(False))
    np.testing.assert_array_equal(kept.layers[0].weight.val().numpy(), reference[0].weight.detach().numpy().T)


def test_remap_then_adapt_loads_a_checkpoint_saved_under_other_names(tmp_path):
    # Burn's KeyRemapper example: `add_pattern(r"^pytorch\.(.*)", "burn.$1")` renames before the adapter matches.
    torch.manual_seed(3)
    wrapper = torch.nn.Module()
    wrapper.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    record = _save_torch(wrapper, tmp_path / "w.pt").remap([(r"^net\.(.*)", "$1")])
    loaded = model.load_record(kiln.PyTorchAdapter().to_kiln(record, model)).valid()
    x = np.ones((1, 8), np.float32)
    with torch.no_grad():
        expected = wrapper.net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(loaded(kiln.tensor(x)).numpy(), expected, atol=ATOL, rtol=1e-5)


def test_a_quantized_module_has_no_pytorch_form():
    model = nn.Linear(8, 4).quantize_weights(kiln.Quantizer())
    with pytest.raises(kiln.RecordError, match="weight: a quantized tensor has no PyTorch form"):
        kiln.PyTorchAdapter().to_pytorch(model.into_record(), model)
