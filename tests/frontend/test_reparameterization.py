"""apply_lora, apply_reparameterization and materialize (spec/module-trait.txt)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln import Lora, Module, Param, ParamGroup, Reparam, nn
from kiln.ir import ParamGroupWarning, interpret

AD = kiln.Device("cpu").autodiff()
X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


class Simple(Module):
    def __init__(self):
        self.fc = nn.Linear(4, 6, device=AD)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.fc(x))


def out(m: Module) -> np.ndarray:
    return m.valid()(kiln.tensor(X)).numpy()


def with_nonzero_b(m: Module) -> Module:
    class Fill(kiln.ModuleMapper):
        def map_param(self, path, p):
            if path.endswith("lora.b"):
                return Param.from_data(np.full(p.lazy_shape(), 0.1, np.float32), device=p.device, id=p.id)
            return p
    return m.map(Fill())


def test_lora_freezes_bases_and_trains_only_adapters():
    """apply_lora: "only the adapter factors are trainable"; num_params counts factors (24 + 6 + 4r + 6r)."""
    m = Simple().apply_lora(Lora(rank=2, alpha=4.0))
    trainable = sorted(p for p, v in m.leaves() if isinstance(v, Param) and v.grad)
    assert trainable == ["fc.weight.lora.a", "fc.weight.lora.b"]
    assert m.num_params() == 24 + 6 + 4 * 2 + 2 * 6


def test_lora_keeps_the_module_working_and_starts_at_the_base_function():
    """"The same module keeps working without any code changes; adapted weights now produce
    base + scale * (a @ b)" (b starts at zero)."""
    m = Simple()
    lora = m.apply_lora(Lora(rank=2, alpha=4.0))
    np.testing.assert_allclose(out(lora), out(m), rtol=1e-6)
    bumped = with_nonzero_b(lora)
    a = dict(bumped.fc.weight.reparam.factors)["lora.a"].val().numpy()
    expected_w = m.fc.weight.val().numpy() + 2.0 * (a @ np.full((2, 6), 0.1, np.float32))
    np.testing.assert_allclose(out(bumped), X @ expected_w + m.fc.bias.val().numpy(), rtol=1e-5)


def test_lora_preserves_flags():
    """"Module-owned control flags are preserved, so dropout and batch normalization keep their current
    training behavior." """
    m = Simple().apply_lora(Lora(rank=2, alpha=1.0))
    assert m.drop.training.value is True


def test_lora_group_selects_weights():
    with pytest.warns(ParamGroupWarning, match=r"pass 'reparameterize': group from_paths\(\['nothing'\]\) matches no"):
        m = Simple().apply_lora(Lora(rank=1, alpha=1.0).set_param_group(ParamGroup.from_path("nothing")))
    assert m.fc.weight.reparam is None and not m.fc.weight.grad


def test_nested_reparameterization_is_rejected():
    m = Simple().apply_lora(Lora(rank=1, alpha=1.0))
    with pytest.raises(kiln.ir.PassError, match="nested"):
        m.apply_lora(Lora(rank=1, alpha=1.0))


def test_valid_keeps_reparameterizations():
    """valid: "Parameter reparameterizations and their stored bases are preserved" """
    v = Simple().apply_lora(Lora(rank=2, alpha=4.0)).valid()
    assert v.fc.weight.reparam is not None
    assert [s for s, _ in v.fc.weight.reparam.factors] == ["lora.a", "lora.b"]


def test_materialize_folds_adapters_keeping_base_id_and_trainability():
    """materialize: "The resulting parameters retain their base parameter IDs ... and configured trainability,
    but are detached" and "Parameters without reparameterizations remain lazy" """
    base = Simple()
    m = with_nonzero_b(base.apply_lora(Lora(rank=2, alpha=4.0)))
    folded = m.materialize()
    assert folded.fc.weight.reparam is None and folded.fc.weight.id == base.fc.weight.id
    assert folded.fc.weight.grad is False and folded.num_params() == 30
    np.testing.assert_allclose(out(folded), out(m), rtol=1e-5)
    assert not folded.fc.bias.is_initialized() or base.fc.bias.is_initialized()


def test_materialize_does_not_initialize_plain_lazy_params():
    m = Simple().materialize()
    assert not m.fc.weight.is_initialized()


def test_valid_then_materialize_is_not_autodiff_and_train_requires_grad_again():
    m = Simple().valid().materialize()
    assert not m.fc.weight.val().is_autodiff()
    assert m.train().fc.weight.val().is_require_grad()


def test_custom_reparameterizer_sees_every_float_param_with_its_path():
    seen = []

    class Scale:
        def reparameterize(self, path, param):
            seen.append(path)
            if path == "fc.weight":
                gain = Param.from_data(np.full((4, 6), 2.0, np.float32), device=param.device)
                return param, Reparam("mul", (("gain", gain),))
            return param, None

    m = Simple()
    r = m.apply_reparameterization(Scale())
    assert seen == ["fc.weight", "fc.bias"]
    np.testing.assert_allclose(out(r), X @ (2 * m.fc.weight.val().numpy()) + m.fc.bias.val().numpy(), rtol=1e-6)
    g = kiln.trace(r.valid(), ((None, 4), "f32"))
    assert "fc.weight" in g.reparams and g.reparams["fc.weight"].kind == "mul"
    np.testing.assert_allclose(interpret(g, [X])[0], out(r), rtol=1e-6)
