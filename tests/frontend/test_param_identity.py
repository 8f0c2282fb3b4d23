"""One identity per parameter: group passes match a derived parameter's stored nodes by the path `visit` and
records show. burn-notes §2.7: "Paths seen by group operations are the module path joined by ".", the same as
record names"; §1.6: LoRA adapter tensors are "<param>.lora.a" and "<param>.lora.b", the base recorded at
"<param>"."""

from __future__ import annotations

import warnings

import pytest

import kiln
from kiln import Lora, Module, Param, ParamGroup, QLora, Quantizer, nn
from kiln.ir import ParamGroupWarning

AD = kiln.Device("cpu").autodiff()


class Net(Module):
    def __init__(self):
        self.fc = nn.Linear(4, 6, device=AD)
        self.drop = nn.Dropout(0.2)

    def forward(self, x):
        return self.drop(self.fc(x))


def grads(m: Module) -> dict[str, bool]:
    return {path: leaf.grad for path, leaf in m.leaves() if isinstance(leaf, Param)}


def visited(m: Module) -> list[str]:
    paths: list[str] = []

    class See(kiln.ModuleVisitor):
        def visit_param(self, path, param):
            paths.append(path)

    m.visit(See())
    return paths


@pytest.mark.parametrize("group", [ParamGroup.from_path("fc.weight"), ParamGroup.from_glob("fc.weight")])
def test_set_require_grad_group_reaches_a_lora_base_by_its_user_path(group):
    """The defect: the pass saw `fc.weight.base`, so this silently did nothing."""
    m = Net().apply_lora(Lora(rank=2, alpha=4.0))
    assert "fc.weight" in visited(m) and list(m.into_record_group(group).keys()) == ["fc.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParamGroupWarning)  # the group matches, so nothing warns
        trained = m.set_require_grad_group(group, True)
    assert grads(trained) == {"fc.weight": True, "fc.bias": False, "fc.weight.lora.a": True, "fc.weight.lora.b": True}
    frozen = trained.freeze_group(group)
    assert grads(frozen) == {**grads(trained), "fc.weight": False}  # the adapters keep their own state


def test_lora_factors_are_matched_at_their_own_paths():
    m = Net().apply_lora(Lora(rank=2, alpha=4.0)).unfreeze_group(ParamGroup.from_path("fc.weight"))
    frozen = m.freeze_group(ParamGroup.from_glob("fc.weight.**"))
    assert grads(frozen) == {"fc.weight": True, "fc.bias": False, "fc.weight.lora.a": False,
                             "fc.weight.lora.b": False}


def test_a_quantized_weight_is_selected_by_its_user_path():
    """The codes node `fc.weight.codes` stands for `fc.weight`: records and group passes agree on it."""
    m = Net().quantize_weights(Quantizer())
    group = ParamGroup.from_path("fc.weight")
    assert list(m.into_record_group(group).keys()) == ["fc.weight"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ParamGroupWarning)
        m.freeze_group(group)
        m.apply_qlora(QLora(Lora(rank=2, alpha=4.0), Quantizer())).set_require_grad_group(group, True)


def test_a_group_matching_nothing_warns_from_python():
    with pytest.warns(ParamGroupWarning, match=r"pass 'freeze-group': group from_paths\(\['fc\.weight\.base'\]\)"):
        Net().apply_lora(Lora(rank=2, alpha=4.0)).freeze_group(ParamGroup.from_path("fc.weight.base"))
