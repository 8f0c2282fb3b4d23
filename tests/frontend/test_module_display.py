"""How a module shows itself (issue 11): `print(model)` as a tree of its fields with each parameter's type,
count, lazy/initialized, trainable/frozen and derivation; `summary()` as a table with totals and bytes per dtype;
`named_parameters()` as `visit` sees them. Counts and bytes are checked against torch and numpy, not kiln."""

from __future__ import annotations

import numpy as np
import torch

import kiln
from kiln import Lora, Module, ModuleVisitor, Quantizer, nn


class CNN(Module):
    def __init__(self, device: kiln.Device | None = None):
        self.conv = nn.Conv2d(1, 4, 3, device=device)
        self.drop = nn.Dropout(0.1)
        self.blocks = [nn.Linear(4, 4, device=device), nn.LayerNorm(4, device=device)]
        self.fc = nn.Linear(4, 2, device=device)


def torch_cnn() -> torch.nn.Module:
    """The same architecture in torch: the independent parameter count."""
    return torch.nn.ModuleDict({"conv": torch.nn.Conv2d(1, 4, 3), "b0": torch.nn.Linear(4, 4),
                                "b1": torch.nn.LayerNorm(4), "fc": torch.nn.Linear(4, 2)})


def test_print_shows_the_field_tree_with_state():
    model = CNN(kiln.Device("cpu").autodiff()).freeze_group(kiln.ParamGroup.from_glob("fc.*"))
    model.conv.weight.val().numpy()  # initialize one parameter
    assert str(model) == repr(model) == "\n".join([
        "CNN  (78 params on cpu)",
        "  conv: Conv2d(stride=(1, 1), padding=(0, 0), dilation=(1, 1), groups=1)  (40 params)",
        "    weight: tensor<4x1x3x3xf32>  36 params  initialized  trainable",
        "    bias: tensor<4xf32>  4 params  lazy  trainable",
        "  drop: Dropout(prob=0.1)  (0 params)",
        "    training: Flag on",
        "  blocks: Vec",
        "    0: Linear  (20 params)",
        "      weight: tensor<4x4xf32>  16 params  lazy  trainable",
        "      bias: tensor<4xf32>  4 params  lazy  trainable",
        "    1: LayerNorm(eps=1e-05)  (8 params)",
        "      gamma: tensor<4xf32>  4 params  lazy  trainable",
        "      beta: tensor<4xf32>  4 params  lazy  trainable",
        "  fc: Linear  (10 params)",
        "    weight: tensor<4x2xf32>  8 params  lazy  frozen",
        "    bias: tensor<2xf32>  2 params  lazy  frozen",
    ])
    assert not model.fc.weight.is_initialized()  # printing initializes nothing


def test_print_total_matches_torch_and_num_params():
    expected = sum(p.numel() for p in torch_cnn().parameters())
    model = CNN()
    assert repr(model).splitlines()[0] == f"CNN  ({expected} params on cpu)"
    assert model.num_params() == expected


def test_print_shows_valid_mode_flags_and_derivations():
    model = nn.Linear(4, 2, device=kiln.Device("cpu").autodiff()).apply_lora(Lora(2, 4.0)).valid()
    lines = repr(model).splitlines()
    # the LoRA base is frozen for good; valid turns the adapters' gradients off until train restores them
    assert lines[1] == "  weight: tensor<4x2xf32>  8 params  lazy  frozen  derived by lora"
    assert lines[2] == "    lora.a: tensor<4x2xf32>  8 params  lazy  grad off"
    assert lines[3] == "    lora.b: tensor<2x2xf32>  4 params  lazy  grad off"
    drop = nn.Dropout(0.2).valid()
    assert repr(drop).splitlines()[1] == "  training: Flag off (configured on)"


def test_print_shows_a_quantized_weight_as_the_float_it_stands_for():
    model = nn.Linear(64, 32, bias=False).quantize_weights(Quantizer())
    lines = repr(model).splitlines()
    assert lines[0] == f"Linear  ({64 * 32:,} params on cpu)"
    assert lines[1].startswith("  weight: tensor<64x32xf32>  2,048 params  initialized  ")
    assert "stored tensor<64x32xi8>  derived by dequantize" in lines[1]
    assert lines[2].startswith("    scales: tensor<1xf32>  0 params  ")  # storage, not a parameter


def test_print_shows_layer_settings_as_constructed():
    conv = nn.Conv2d(2, 4, 3, stride=2, padding=1, dilation=1, groups=2)
    assert repr(conv).splitlines()[0] == ("Conv2d(stride=(2, 2), padding=(1, 1), dilation=(1, 1), groups=2)  "
                                          "(40 params on cpu)")
    block = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.25, norm_first=True)
    lines = repr(block).splitlines()
    assert lines[0].startswith("TransformerEncoderLayer(norm_first=True)  (")
    assert lines[1].startswith("  attention: MultiHeadAttention(n_heads=2, d_head=4)  (")
    assert "  dropout1: Dropout(prob=0.25)  (0 params)" in lines
    assert repr(nn.GELU("tanh")) == "GELU(approximate='tanh')  (0 params)"  # no parameters: no device


def test_print_names_the_device_of_parameters_away_from_the_model():
    # module-trait.txt: "Return all the devices found in the underneath module tree" -- the printed tree says
    # where each parameter lives (the first device on the root line, any other one on the parameter's line)
    model = CNN()
    model.fc = nn.Linear(4, 2, device="cuda:1")  # lazy: nothing is allocated, so no GPU is needed to print it
    lines = repr(model).splitlines()
    assert lines[0] == "CNN  (78 params on cpu)"
    assert lines[-2].endswith("lazy  grad off  on cuda:1") and lines[-1].endswith("on cuda:1")
    assert not any("on cuda" in line for line in lines[:-2])
    assert [str(d) for d in model.devices()] == ["cpu", "cuda:1"]


def test_summary_totals_params_and_bytes_per_dtype():
    model = CNN(kiln.Device("cpu").autodiff()).freeze_group(kiln.ParamGroup.from_glob("conv.*"))
    table = model.summary().splitlines()
    assert table[0].split() == ["path", "type", "params", "bytes", "state"]
    arrays = {path: p.state.get() for path, p in model.named_parameters()}  # numpy: the bytes oracle
    rows = {line.split()[0]: line.split() for line in table[1:-1]}
    assert list(rows) == list(arrays)
    for path, array in arrays.items():
        assert rows[path][2:4] == [f"{array.size:,}", f"{array.nbytes:,}"]
    total = sum(p.numel() for p in torch_cnn().parameters())
    trainable = total - 40  # conv frozen
    nbytes = sum(a.nbytes for a in arrays.values())
    assert table[-1] == f"total: {total} params ({trainable} trainable), {nbytes} bytes (f32 {nbytes})"


def test_summary_counts_bytes_per_stored_dtype():
    model = nn.Linear(64, 32, bias=False).quantize_weights(Quantizer())
    codes, scales = (p.state.get() for _, p in model.named_parameters())
    assert model.summary().splitlines()[-1] == (
        f"total: 2,048 params (0 trainable), {codes.nbytes + scales.nbytes:,} bytes "
        f"(f32 {scales.nbytes}, i8 {codes.nbytes:,})")


def test_named_parameters_are_the_params_visit_sees():
    # module-trait.txt: "Visit each parameter and module-owned control value with a visitor."
    model = CNN().apply_lora(Lora(2, 4.0))
    seen = []

    class Collect(ModuleVisitor):
        def visit_param(self, path, param):
            seen.append((path, param))

    model.visit(Collect())
    named = list(model.named_parameters())
    assert [p for p, _ in named] == [p for p, _ in seen] and all(a is b for (_, a), (_, b) in zip(named, seen))
    assert "fc.weight.lora.a" in dict(named)
    assert np.all([isinstance(p, kiln.Param) for _, p in named])


def test_print_shows_a_parameters_file_form():
    """A layout (or Python mappers) changes what records hold, so the tree says so; the live type is unchanged."""
    layer = nn.Linear(4, 2, weight_layout=kiln.Layout.transpose())
    weight = "  weight: tensor<4x2xf32>  8 params  lazy  grad off  recorded as permute[1, 0]"
    assert repr(layer).splitlines()[1] == weight
    layer.bias = layer.bias.save_mapper(lambda a: a * 2)
    assert repr(layer).splitlines()[2].endswith("grad off  recorded through Python mappers")
