"""The Module trait's semantics (spec/module-trait.txt); each test quotes the sentence it checks."""

from __future__ import annotations

import copy
import tracemalloc

import numpy as np
import pytest

import kiln
from kiln import Device, Flag, Module, Param, ParamGroup, nn
from kiln.ir import Init, interpret

AD = Device("cpu").autodiff()


class Net(Module):
    def __init__(self, device=None):
        self.fc = nn.Linear(4, 3, device=device)
        self.drop = nn.Dropout(0.5)
        self.blocks = [nn.Linear(3, 3, device=device), nn.LayerNorm(3, device=device)]
        self.steps = Param.from_data(np.zeros(1, np.int64), device=device)
        self.note = "plain constants are not state"

    def forward(self, x):
        return self.blocks[1](self.blocks[0](self.drop(self.fc(x))))


def grads(m: Module) -> dict[str, tuple[bool, bool]]:
    return {p: (v.grad, v.configured_grad) for p, v in m.leaves() if isinstance(v, Param)}


def flags(m: Module) -> dict[str, tuple[bool, bool]]:
    return {p: (v.value, v.configured) for p, v in m.leaves() if isinstance(v, Flag)}


def snapshot(m: Module) -> list:
    return [(p, v.id, getattr(v, "grad", None), getattr(v, "configured_grad", None), getattr(v, "value", None),
             getattr(v, "configured", None), str(getattr(v, "device", "")), getattr(v, "leaf", None))
            for p, v in m.leaves()]


def test_fields_are_discovered_in_assignment_order_with_container_paths():
    paths = [p for p, _ in Net().leaves()]
    assert paths == ["fc.weight", "fc.bias", "drop.training", "blocks.0.weight", "blocks.0.bias",
                     "blocks.1.gamma", "blocks.1.beta", "steps"]


def test_valid_disables_gradients_and_flags_but_keeps_configured_state():
    """valid: "Tensor gradient requirements and module-owned training flags are disabled in the returned value
    while their configured state is retained internally. Use Module::train to apply that state." """
    m = Net(AD).train()
    v = m.valid()
    assert all(g == (False, True) for p, g in grads(v).items() if p != "steps")
    assert flags(v) == {"drop.training": (False, True)}
    t = v.train()
    assert all(g == (True, True) for p, g in grads(t).items() if p != "steps")
    assert flags(t) == {"drop.training": (True, True)}


def test_valid_is_idempotent():
    """"Calling valid when the module's tensors are already on a plain device still disables its training
    flags, so the operation is idempotent" """
    v = Net().valid()
    assert snapshot(v.valid()) == snapshot(v)
    assert flags(v) == {"drop.training": (False, True)}


def test_train_does_not_undo_freeze_or_no_grad():
    """train: "This does not undo explicit freezing" and no_grad: "A later train keeps gradients disabled" """
    m = Net(AD).train()
    assert all(not g for g, _ in grads(m.freeze().valid().train()).values())
    assert flags(m.freeze().valid().train()) == {"drop.training": (False, False)}
    assert all(not g for g, _ in grads(m.no_grad().train()).values())


def test_checkpointing_is_dropped_by_valid_and_not_restored_by_train():
    """"Tensor checkpointing strategies are removed with autodiff and are not restored by Module::train." """
    m = Net(Device("cpu").autodiff(checkpointing="balanced"))
    assert {v.device.checkpointing for _, v in m.leaves() if isinstance(v, Param)} == {"balanced"}
    back = m.valid().train()
    assert {v.device.checkpointing for _, v in back.leaves() if isinstance(v, Param)} == {None}
    assert all(v.device.autodiff_enabled for _, v in back.leaves() if isinstance(v, Param))


def test_no_grad_leaves_flags_alone_and_freeze_stops_both():
    """no_grad: "Module-owned control flags are left unchanged"; freeze: "every module-owned training flag is
    disabled" """
    m = Net(AD)
    assert flags(m.no_grad()) == {"drop.training": (True, True)}
    assert all(not g for g, _ in grads(m.no_grad()).values())
    assert flags(m.freeze()) == {"drop.training": (False, False)}


def test_unfreeze_sets_flags_enabled_rather_than_restoring():
    """unfreeze: "every module-owned training flag is set to enabled rather than restored to a prior value" """
    m = Net(AD)
    m = m.map(type("Off", (kiln.ModuleMapper,), {"map_flag": lambda self, p, f: f.replace(configured=False,
                                                                                      value=False)})())
    assert flags(m.unfreeze()) == {"drop.training": (True, True)}


def test_set_require_grad_true_overrides_selective_configuration():
    """"Setting this to true overrides selective gradient configurations" """
    m = Net(AD).freeze_group(ParamGroup.from_glob("fc.*"))
    assert grads(m)["fc.weight"] == (False, False)
    assert grads(m.set_require_grad(True))["fc.weight"] == (True, True)
    assert grads(m.set_require_grad(True))["steps"] == (False, False)  # ints never require grad


def test_group_variants_touch_only_matched_values():
    m = Net(AD)
    g = m.freeze_group(ParamGroup.from_path("fc.weight").fuse(ParamGroup.from_glob("drop.*")))
    assert grads(g)["fc.weight"] == (False, False) and grads(g)["fc.bias"] == (True, True)
    assert flags(g) == {"drop.training": (False, False)}
    assert flags(g.unfreeze_group(ParamGroup.from_glob("drop.*"))) == {"drop.training": (True, True)}


def test_set_require_grad_group_ignores_flags_even_for_a_whole_subtree():
    """"a group created with ParamGroup::ids_from_module can select an entire subtree while this method
    changes only its tensor gradient state" """
    m = Net(AD)
    group = ParamGroup.ids_from_module(m.drop).fuse(ParamGroup.ids_from_module(m.fc))
    out = m.set_require_grad_group(group, False)
    assert flags(out) == {"drop.training": (True, True)}
    assert grads(out)["fc.weight"] == (False, False) and grads(out)["blocks.0.weight"] == (True, True)


def test_requests_on_a_plain_device_take_effect_on_train():
    """"On a backend without autodiff, the enabled setting is preserved and takes effect when train transitions
    the module back to training." """
    m = Net().no_grad().set_require_grad(True)
    assert grads(m)["fc.weight"] == (False, True)
    assert grads(m.train())["fc.weight"] == (True, True)
    assert m.train().fc.weight.val().is_require_grad()


def test_freeze_on_a_plain_device_disables_flags_immediately():
    """"On a backend without autodiff, flags are disabled immediately, and train keeps tensors untracked" """
    m = Net().freeze()
    assert flags(m) == {"drop.training": (False, False)}
    assert all(not g for g, _ in grads(m.train()).values())


def test_methods_never_mutate_the_receiver():
    m = Net(AD)
    before = snapshot(m)
    for method in ("train", "valid", "no_grad", "freeze", "unfreeze", "clone"):
        getattr(m, method)()
    m.set_require_grad(False), m.freeze_group(ParamGroup.all()), m.unfreeze_group(ParamGroup.all())
    m.set_require_grad_group(ParamGroup.all(), False), m.to_device("cuda:0"), m.fork("cuda:0")
    assert snapshot(m) == before


def test_num_params_counts_float_params_without_initializing():
    """num_params: "without initializing the ones not initialized yet" (steps is an int: not counted)"""
    m = Net()
    assert m.num_params() == 4 * 3 + 3 + 3 * 3 + 3 + 3 + 3
    assert not any(v.is_initialized() for _, v in m.leaves() if isinstance(v, Param) and v.type.dtype.is_float)


def test_num_params_of_a_billion_lazy_parameters_allocates_nothing():
    class Huge(Module):
        def __init__(self):
            self.layers = [nn.Linear(31623, 31623) for _ in range(1)]

    tracemalloc.start()
    m = Huge()
    count = m.num_params()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 31623 * 31623 + 31623 > 10**9
    assert peak < 1 << 20


def test_devices_report_lazy_devices_without_initializing_and_ignore_autodiff():
    """devices: "Lazy tensor parameters report their initialization device without being initialized. Device
    equality ignores autodiff and checkpointing settings" """
    m = Net(AD)
    assert m.devices() == [Device("cpu")]
    assert m.fork("cuda:1").devices() == [Device("cuda:1")]
    assert m.collect_devices([Device("cuda:0")]) == [Device("cuda:0"), Device("cpu")]
    assert not m.fc.weight.is_initialized()


def test_a_moved_lazy_param_stays_lazy_and_keeps_its_autodiff_context():
    m = Net()
    moved = m.to_device(Device("cuda:0").autodiff())
    assert not moved.fc.weight.is_initialized()
    assert moved.fc.weight.lazy_device() == Device("cuda:0")
    assert not moved.fc.weight.lazy_device().autodiff_enabled


def test_a_lazy_param_shared_with_a_clone_initializes_before_moving():
    """fork/to_device: "A parameter not initialized yet initializes on the destination, unless a clone shares
    it, in which case it initializes where it is and is then moved." """
    m = Net()
    twin = m.clone()
    moved = m.to_device("cuda:0")
    assert twin.fc.weight.is_initialized()
    np.testing.assert_array_equal(moved.fc.weight.val().numpy(), twin.fc.weight.val().numpy())


def test_clones_share_lazy_initialization():
    m = Net()
    twin = m.clone()
    np.testing.assert_array_equal(twin.fc.weight.val().numpy(), m.fc.weight.val().numpy())
    assert m.fc.weight.is_initialized()


def test_fork_keeps_trainable_leaves_and_to_device_makes_intermediaries():
    """to_device: "The output model will be an intermediary model, meaning that you can't optimize it";
    fork "ensures the output module on the new device will have its own autodiff graph" """
    m = Net(AD)
    m.fc.weight.val()  # initialize
    assert m.to_device("cuda:0").fc.weight.leaf is False
    assert m.fork("cuda:0").fc.weight.leaf is True
    assert m.fork("cuda:0").fc.weight.grad and m.to_device("cuda:0").fc.weight.device.autodiff_enabled


def test_visit_and_map_see_every_param_and_flag_with_paths_and_containers():
    seen = []

    class V(kiln.ModuleVisitor):
        def enter_module(self, name, container):
            seen.append(("enter", name, container))

        def visit_param(self, path, param):
            seen.append(("param", path))

        def visit_flag(self, path, flag):
            seen.append(("flag", path))

    Net().visit(V())
    assert ("enter", "blocks", "Vec") in seen and ("flag", "drop.training") in seen
    assert ("enter", "fc", "Struct:Linear") in seen and ("param", "blocks.1.beta") in seen

    class Zero(kiln.ModuleMapper):
        def map_param(self, path, p):
            return Param.from_data(np.zeros(p.lazy_shape(), p.type.dtype.numpy), id=p.id)

    z = Net().map(Zero())
    assert z.fc.weight.val().numpy().sum() == 0


def test_trace_then_interpret_matches_eager_forward_and_valid_removes_dropout():
    m = Net().valid()
    g = kiln.trace(m, ((None, 4), "f32"))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    np.testing.assert_allclose(interpret(g, [x])[0], m(kiln.tensor(x)).numpy(), rtol=1e-6)
    from kiln.passes import PassManager
    ops = [op.kind for op in PassManager.parse("canonicalize,dce").run(g).functions["forward"].ops]
    assert "dropout" not in ops and "linear" in ops


def test_graph_back_to_module_rebinds_state():
    m = Net(AD)
    g = kiln.trace(m, ((None, 4), "f32"))
    frozen = kiln.passes.get_pass("freeze")().apply(g)
    back = m.load_graph(frozen)
    assert flags(back) == {"drop.training": (False, False)}
    assert all(not gr for gr, _ in grads(back).values())


def test_shape_errors_point_at_the_user_call():
    with pytest.raises(kiln.ir.ShapeError, match="linear"):
        Net()(kiln.tensor(np.zeros((2, 5), np.float32)))


def test_lazy_init_is_deterministic_by_param_id():
    a = Param.lazy((3, 3), Init("normal"), id=42)
    b = Param.lazy((3, 3), Init("normal"), id=42)
    np.testing.assert_array_equal(a.val().numpy(), b.val().numpy())
    assert copy.copy(a).state is a.state


def test_groups_from_python_predicates_over_path_and_param():
    m = Net(AD)
    big = ParamGroup.from_fn(lambda path, p: p.type.rank == 2 and p.type.shape[0] > 3)
    frozen = m.freeze_group(big)
    assert grads(frozen)["fc.weight"] == (False, False) and grads(frozen)["blocks.0.weight"] == (True, True)
