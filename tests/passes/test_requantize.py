"""materialize{requantize}: a QLoRA weight folds its adapters and is quantized back into its base's scheme; the
error it adds (max and mean |requantized - folded|) is reported, checked here against numpy."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kiln import Lora, Module, QLora, Quantizer, QuantScheme, nn
from kiln.ir import DType
from kiln.ir.ops.quant import NF4
from kiln.passes.requantize import requantize
from kiln.runtime.records.record import ModuleRecord, RecordEntry


class Net(Module):
    def __init__(self):
        self.fc = nn.Linear(8, 16, bias=False)

    def forward(self, x):
        return self.fc(x)


def qlora(scheme: QuantScheme) -> Net:
    """A QLoRA net whose adapters are not zero, so folding changes the weight."""
    net = Net().apply_qlora(QLora(Lora(2, 4.0), Quantizer(scheme=scheme)))
    rng = np.random.default_rng(1)
    record = net.into_record()
    b = rng.standard_normal((2, 16)).astype(np.float32) * 0.3
    entries = dict(record.entries)
    entries["fc.weight.lora.b"] = RecordEntry(record["fc.weight.lora.b"].param_id, DType.f32, (2, 16), b)
    return net.load_record(ModuleRecord(entries))


def folded(net: Net) -> np.ndarray:
    """base + alpha / rank * a @ b in numpy, from the stored arrays (NF4 codes c name level NF4[c + 8], the
    table tests/ir/test_quant_formats.py checks against the normal quantiles)."""
    state = net.state_dict()
    codes, scales = state["fc.weight"].astype(np.int64), state["fc.weight.scales"].astype(np.float64)
    if net.fc.weight.reparam.chain()[0].attrs["value"] == "nf4":
        codes = NF4[codes + 8]
    base = (codes.astype(np.float64).reshape(8, 2, 8) * scales.reshape(8, 2, 1)).reshape(8, 16)
    return base + 2.0 * state["fc.weight.lora.a"].astype(np.float64) @ state["fc.weight.lora.b"]


def test_requantize_q8s_matches_a_numpy_requantization(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 11: "folds the adapters and re-quantizes into the base scheme (same value/block/scale dtype),
    reporting the max and mean error it adds"."""
    net = qlora(QuantScheme("q8s").per_block((8,)))
    w = folded(net).astype(np.float32)
    scale = (np.abs(w.reshape(8, 2, 8)).max(axis=2, keepdims=True) * np.float32(2) / np.float32(254)).astype(np.float32)
    ratio = w.reshape(8, 2, 8) / scale
    codes = np.clip(np.sign(ratio) * np.floor(np.abs(ratio) + 0.5), -127, 127)
    back = (codes * scale).reshape(8, 16)
    with caplog.at_level(logging.INFO, logger="kiln"):
        dense = net.materialize(requantize=True)
    assert dense.fc.weight.reparam.kind == "dequantize" and dense.fc.weight.id == net.fc.weight.id
    np.testing.assert_array_equal(dense.state_dict()["fc.weight"].astype(np.int64), codes.reshape(8, 16))
    np.testing.assert_allclose(dense.fc.weight.val().numpy(), back, rtol=1e-6)
    err = np.abs(back.astype(np.float64) - folded(net))
    _, report = requantize(net.state_graph())
    assert report["fc.weight"].max_abs == pytest.approx(err.max(), rel=1e-4, abs=1e-6)
    assert report["fc.weight"].mean_abs == pytest.approx(err.mean(), rel=1e-4, abs=1e-6)
    assert "requantize @fc.weight (q8s): max |error|" in caplog.text


def test_requantize_nf4_keeps_the_scheme_and_scale_dtype() -> None:
    net = qlora(QuantScheme.nf4(8, "f16"))
    dense = net.materialize(requantize=True)
    assert dense.fc.weight.reparam.attrs["value"] == "nf4" and tuple(dense.fc.weight.reparam.attrs["block"]) == (8,)
    assert dense.state_dict()["fc.weight.scales"].dtype == np.float16
    _, report = requantize(net.state_graph())
    err = np.abs(dense.fc.weight.val().numpy().astype(np.float64) - folded(net))
    assert report["fc.weight"].max_abs == pytest.approx(err.max(), rel=1e-4, abs=1e-6)
    assert report["fc.weight"].mean_abs == pytest.approx(err.mean(), rel=1e-4, abs=1e-6)
    # NF4's worst case is half the widest gap between its levels (0.304, from -1 to -0.696) times the block's
    # absmax, which the f16 scale rounds up by at most 2**-10 (a 0.28 here made the test fail now and then)
    widest = float(np.diff(NF4).max())
    assert report["fc.weight"].max_abs <= 0.5 * widest * np.abs(folded(net)).max() * (1 + 2**-10) + 1e-7


def test_requantize_keeps_double_quantized_scales() -> None:
    """"same value/block/scale dtype": a double-quantized NF4 base re-quantizes double-quantized."""
    net = Net().apply_qlora(QLora(Lora(2, 4.0), Quantizer(scheme=QuantScheme.nf4(8, double_quant=True))))
    folded_value = net.fc.weight.val().numpy()
    dense = net.materialize(requantize=True)
    assert dense.fc.weight.reparam.kind == "dequantize"
    assert [s for s, _ in dense.fc.weight.reparam.factors] == ["scales", "scales.scales", "scales.offset"]
    assert dense.state_dict()["fc.weight.scales"].dtype == np.int8
    _, report = requantize(net.state_graph())
    err = np.abs(dense.fc.weight.val().numpy().astype(np.float64) - folded_value)
    assert report["fc.weight"].max_abs == pytest.approx(err.max(), rel=1e-5, abs=1e-7)
