"""quantize_weights, quantize_weights_group and apply_qlora (spec/module-trait.txt, burn-notes §2.8-2.9)."""

from __future__ import annotations

import numpy as np

import kiln
from kiln import Lora, Module, Param, ParamGroup, QLora, Quantizer, QuantScheme, nn
from kiln.ir import interpret

AD = kiln.Device("cpu").autodiff()
X = np.random.default_rng(2).standard_normal((3, 8)).astype(np.float32)


class Net(Module):
    def __init__(self):
        self.fc1 = nn.Linear(8, 16, device=AD)
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(16, 4, device=AD)

    def forward(self, x):
        return self.fc2(self.drop(nn.functional.relu(self.fc1(x))))


def out(m: Module) -> np.ndarray:
    return m.valid()(kiln.tensor(X)).numpy()


def dequantized(p: Param) -> np.ndarray:
    """Independent of kiln's op: scale * code for a per-tensor scheme."""
    (scale,) = dict(p.reparam.chain()[0].factors)["scales"].val().numpy()
    return p.base().numpy().astype(np.float32) * scale


def test_quantize_weights_maps_every_float_param_biases_included_keeping_ids():
    """burn-notes §2.8: the Quantizer maps all float params, biases included; the ParamId is kept."""
    m = Net()
    q = m.quantize_weights(Quantizer(scheme=QuantScheme("q8s")))
    for path in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
        p = dict(q.leaves())[path]
        assert p.type.dtype is kiln.ir.DType.i8 and p.reparam.kind == "dequantize"
        assert p.id == dict(m.leaves())[path].id and not p.grad
    assert q.num_params() == m.num_params()  # scales are storage, not parameters


def test_quantized_forward_is_within_the_quantization_error():
    m = Net()
    q = m.quantize_weights(Quantizer(scheme=QuantScheme("q8s")))
    w = m.fc1.weight.val().numpy()
    dq = dequantized(q.fc1.weight)
    assert np.abs(dq - w).max() <= np.abs(w).max() / 127 / 2 + 1e-7
    assert np.abs(out(q) - out(m)).max() < 0.05
    graph = kiln.trace(q.valid(), ((None, 8), "f32"))
    np.testing.assert_allclose(interpret(graph, [X])[0], out(q), rtol=1e-6)


def test_quantize_weights_group_sets_the_quantizer_group_and_touches_only_it():
    quantizer = Quantizer(scheme=QuantScheme("q4s"))
    group = ParamGroup.from_glob("fc2.*")
    q = Net().quantize_weights_group(quantizer, group)
    assert quantizer.param_group is group
    assert q.fc1.weight.reparam is None and q.fc2.weight.reparam.kind == "dequantize"


def test_per_block_schemes():
    q = Net().quantize_weights(Quantizer(scheme=QuantScheme("q8s").per_block((1, 4)),
                                         param_group=ParamGroup.from_path("fc1.weight")))
    scales = dict(q.fc1.weight.reparam.factors)["scales"]
    assert scales.lazy_shape() == (8, 4)


def test_qlora_quantizes_frozen_bases_and_trains_only_adapters():
    """apply_qlora: "quantize the (frozen) base tensor parameters and attach trainable LoRA adapters to 2-D
    weights"; "Module-owned control flags are preserved." """
    m = Net().apply_qlora(QLora(Lora(rank=2, alpha=4.0), Quantizer(scheme=QuantScheme("q4s"))))
    trainable = sorted(p for p, v in m.leaves() if isinstance(v, Param) and v.grad)
    assert trainable == ["fc1.weight.lora.a", "fc1.weight.lora.b", "fc2.weight.lora.a", "fc2.weight.lora.b"]
    assert [r.kind for r in m.fc1.weight.reparam.chain()] == ["dequantize", "lora"]
    assert m.drop.training.value is True


def test_valid_keeps_the_packed_base_and_materialize_makes_it_dense():
    """valid: "Parameter reparameterizations and their stored bases are preserved, including quantized bases";
    materialize: "For QLoRA this also replaces the packed base with a dense effective weight" """
    base = Net()
    m = base.apply_qlora(QLora(Lora(rank=2, alpha=4.0), Quantizer(scheme=QuantScheme("q8s"))))
    v = m.valid()
    assert v.fc1.weight.type.dtype is kiln.ir.DType.i8
    dense = m.materialize()
    assert dense.fc1.weight.reparam is None and dense.fc1.weight.type.dtype is kiln.ir.DType.f32
    assert dense.fc1.weight.id == base.fc1.weight.id
    np.testing.assert_allclose(dense.fc1.weight.val().numpy(), dequantized(m.fc1.weight), rtol=1e-6)
    np.testing.assert_allclose(out(dense), out(m), rtol=1e-5, atol=1e-6)
    assert dense.fc1.bias.reparam.kind == "dequantize"  # a plain quantized weight is not a reparameterization
