"""Module methods never mutate the receiver: a property test over random method sequences."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln import Lora, ParamGroup, nn

METHODS = {
    "train": lambda m: m.train(),
    "valid": lambda m: m.valid(),
    "no_grad": lambda m: m.no_grad(),
    "freeze": lambda m: m.freeze(),
    "unfreeze": lambda m: m.unfreeze(),
    "set_require_grad": lambda m: m.set_require_grad(False),
    "set_require_grad_group": lambda m: m.set_require_grad_group(ParamGroup.from_glob("fc.*"), True),
    "freeze_group": lambda m: m.freeze_group(ParamGroup.from_glob("drop.*")),
    "unfreeze_group": lambda m: m.unfreeze_group(ParamGroup.from_predicate("norm")),
    "to_device": lambda m: m.to_device("cuda:0"),
    "fork": lambda m: m.fork("cuda:1"),
    "clone": lambda m: m.clone(),
    "materialize": lambda m: m.materialize(),
    "apply_lora": lambda m: m.apply_lora(Lora(1, 1.0)) if m.fc.weight.reparam is None else m,
    "forward": lambda m: (m(kiln.tensor(np.ones((2, 3), np.float32))), m)[1],
}


class Net(kiln.Module):
    def __init__(self):
        self.fc = nn.Linear(3, 3, device=kiln.Device("cpu").autodiff())
        self.norm = nn.LayerNorm(3)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        return self.drop(self.norm(self.fc(x)))


def snapshot(m: kiln.Module) -> list:
    """Everything observable about a module's state, values included."""
    out = []
    for path, leaf in m.leaves():
        if isinstance(leaf, kiln.Param):
            out.append((path, leaf.id, leaf.grad, leaf.configured_grad, str(leaf.device), leaf.device.autodiff_enabled,
                        leaf.device.checkpointing, leaf.leaf, leaf.reparam is not None,
                        None if leaf.state.value is None else leaf.state.value.tobytes()))
        else:
            out.append((path, leaf.id, leaf.value, leaf.configured))
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(METHODS)), min_size=1, max_size=6))
def test_no_method_sequence_mutates_any_module_it_passes_through(sequence):
    m = Net()
    m.fc.weight.val()  # one initialized param, the rest lazy
    seen = [(m, snapshot(m))]
    for name in sequence:
        m = METHODS[name](m)
        seen.append((m, snapshot(m)))
    for module, before in seen[:-1]:
        after = snapshot(module)
        # lazy values may be filled in (initialization is not a state change); nothing else may differ
        assert [a[:-1] if len(a) == 10 else a for a in after] == [b[:-1] if len(b) == 10 else b for b in before]
        for a, b in zip(after, before):
            if len(a) == 10 and b[-1] is not None:
                assert a[-1] == b[-1]
