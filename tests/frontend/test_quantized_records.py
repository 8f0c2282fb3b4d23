"""Quantized parameters in records: one Burn QFloat entry per parameter (burn-notes §1.4, §2.8-2.10)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import Lora, Module, QLora, Quantizer, QuantScheme, nn
from kiln.runtime.records.burnpack_io import BurnpackFile
from kiln.runtime.records.record import ModuleRecord

X = np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)


class Net(Module):
    def __init__(self):
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(nn.functional.relu(self.fc1(x)))


def out(m: Module) -> np.ndarray:
    return m.valid()(kiln.tensor(X)).numpy()


def stored(m: Module) -> dict[str, np.ndarray]:
    return {p: np.asarray(leaf.base().numpy()).astype(np.float32) for p, leaf in m.leaves()}


SCHEMES = [QuantScheme("q8s"), QuantScheme("q8f").per_block((4,)), QuantScheme("q4f"),
           QuantScheme("q4s").per_block((8,)),
           QuantScheme("q2f"), QuantScheme("q2s").per_block((2,))]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.value}{list(s.block)}")
def test_quantized_params_save_as_single_qfloat_entries_and_load_back(scheme, tmp_path):
    q = Net().quantize_weights(Quantizer(scheme=scheme))
    record = q.into_record()
    assert list(record) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]  # no `.scales` entries
    q.save_file(tmp_path / "q")
    with BurnpackFile.open(tmp_path / "q.bpk") as pack:
        for entry in pack.entries.values():
            assert entry.dtype.kind == "QFloat"
            value = entry.dtype.scheme_value
            assert value["value"] == scheme.value.upper() and value["store"] == {"PackedU32": 0}
            assert value["mode"] == "Symmetric" and value["tensor"] is None
            assert (value["block"] is None) == (not scheme.block)
    # into a module quantized differently: codes, scales, ids and the scheme all come from the record
    loaded = Net().quantize_weights(Quantizer(scheme=QuantScheme("q8f"))).load_file(tmp_path / "q")
    assert stored(loaded).keys() == stored(q).keys()
    for path, value in stored(q).items():
        np.testing.assert_array_equal(stored(loaded)[path], value)
    for (_, a), (_, b) in zip(q.leaves(factors=False), loaded.leaves(factors=False)):
        assert a.id == b.id and a.reparam.attrs["value"] == b.reparam.attrs["value"]
        assert tuple(a.reparam.attrs["block"]) == tuple(b.reparam.attrs["block"])
    np.testing.assert_array_equal(out(loaded), out(q))


def test_a_qfloat_record_loads_into_a_float_module_dequantized():
    q = Net().quantize_weights(Quantizer(scheme=QuantScheme("q4s").per_block((4,))))
    dense = Net().load_record(ModuleRecord.from_bytes(q.into_record().to_bytes()))
    assert all(leaf.reparam is None and leaf.type.dtype is kiln.ir.DType.f32 for _, leaf in dense.leaves())
    np.testing.assert_allclose(out(dense), out(q), rtol=1e-6, atol=1e-6)


def test_qlora_record_keeps_the_packed_base_and_the_adapters():
    def build():
        return Net().apply_qlora(QLora(Lora(2, 4.0), Quantizer(scheme=QuantScheme("q4f"))))

    q = build()
    record = q.into_record()
    assert list(record) == ["fc1.weight", "fc1.weight.lora.a", "fc1.weight.lora.b", "fc1.bias",
                            "fc2.weight", "fc2.weight.lora.a", "fc2.weight.lora.b", "fc2.bias"]
    assert record["fc1.weight"].scheme is not None and record["fc1.weight.lora.a"].scheme is None
    loaded = build().load_record(ModuleRecord.from_bytes(record.to_bytes()))
    np.testing.assert_array_equal(out(loaded), out(q))
