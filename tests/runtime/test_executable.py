"""Executable calls: outputs as copies or read-only views, and which inputs go in without a copy."""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.ir import Builder, interpret
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import Executable, _device_input


@pytest.fixture(scope="module")
def affine() -> tuple[kiln.ir.Graph, Executable]:
    """y = x @ w + b, z = relu(y): two outputs of one call, each shaped like x."""
    b = Builder("Affine")
    x = b.input("x", ((4, 16), "f32"))
    y = b.add(b.matmul(x, b.input("w", ((16, 16), "f32"))), b.input("b", ((16,), "f32")))
    b.ret(y, b.relu(y))
    graph = b.build()
    return graph, compile_graph(graph, cache=False)


def _inputs(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((4, 16), (16, 16), (16,))]


def test_views_equal_copies_and_are_read_only(affine: tuple[kiln.ir.Graph, Executable]) -> None:
    graph, exe = affine
    inputs = _inputs()
    copies = exe.run(*inputs)
    views = exe.run(*inputs, copy=False)
    for copied, view, want in zip(copies, views, interpret(graph, inputs)):
        np.testing.assert_array_equal(view, copied)
        np.testing.assert_allclose(view, want, rtol=1e-5, atol=1e-6)
        assert copied.flags.writeable and not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 1.0


def test_views_fed_back_go_in_without_a_copy(affine: tuple[kiln.ir.Graph, Executable]) -> None:
    """A read-only view handed out by `copy=False` is passed to the VM through its writeable base (same memory)."""
    graph, exe = affine
    inputs = _inputs()
    y, _ = exe.run(*inputs, copy=False)
    plan = exe._plans["forward"]
    assert np.from_dlpack(_device_input("forward", plan.inputs[0], y, plan)).ctypes.data == y.ctypes.data
    again = exe.run(y, *inputs[1:], copy=False)
    for got, want in zip(again, interpret(graph, [np.array(y), *inputs[1:]])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_other_read_only_arrays_are_copied(affine: tuple[kiln.ir.Graph, Executable]) -> None:
    graph, exe = affine
    inputs = _inputs(1)
    frozen = [a.copy() for a in inputs]
    for a in frozen:
        a.flags.writeable = False
    plan = exe._plans.get("forward") or exe._plan("forward")
    tensor = _device_input("forward", plan.inputs[0], frozen[0], plan)
    assert np.from_dlpack(tensor).ctypes.data != frozen[0].ctypes.data
    for got, want in zip(exe.run(*frozen), interpret(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the inputs `_device_input` converts from now on."""
    from kiln.runtime.tvm import executable

    names: list[str] = []
    real = executable._device_input

    def counted(function: str, spec: executable._InputSpec, x: object, plan: executable._Plan) -> object:
        names.append(spec.name)
        return real(function, spec, x, plan)
    monkeypatch.setattr(executable, "_device_input", counted)
    return names


def test_views_of_the_last_call_go_back_as_the_vms_tensors(affine: tuple[kiln.ir.Graph, Executable],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14 (the step's per-call Python): a view the last `copy=False` call handed out is not converted again;
    one at an input of another shape is still checked and refused."""
    graph, exe = affine
    inputs = _inputs(2)
    y, z = exe.run(*inputs, copy=False)
    converted = _counting(monkeypatch)
    again = exe.run(y, *inputs[1:], copy=False)
    assert converted == ["w", "b"]
    for got, want in zip(again, interpret(graph, [np.array(y), *inputs[1:]])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(kiln.ShapeError, match=r"input %w expects .*got shape \[4, 16\]"):
        exe.run(inputs[0], again[1], inputs[2], copy=False)


def test_a_tvm_train_step_converts_only_the_batch_and_lr_after_its_first_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 14: "keep parameter/optimizer-state buffers on the device between steps": from the second step on,
    parameters and Adam's moments go back in as the VM's tensors; the oracle for the values is the interpreter."""
    from kiln import nn, optim
    from kiln.runtime.backend import using_backend
    from kiln.runtime.tvm.backend import TVMBackend

    device = kiln.Device("cpu").autodiff()
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
    steps = {}
    for name, backend in (("tvm", TVMBackend()), ("interpreter", None)):
        kiln.seed(0)
        model = nn.Sequential(nn.Linear(6, 5, device=device), nn.ReLU(), nn.Linear(5, 3, device=device))
        step = kiln.compile_step(model, lambda m, a, b: nn.cross_entropy(m(a), b), optim.Adam(), ((8, 6), "f32"),
                                 ((8,), "i64"))
        with using_backend(backend):
            losses = [step(0.01, x, y)]
            converted = _counting(monkeypatch)
            losses += [step(0.01, x, y) for _ in range(2)]
            monkeypatch.undo()
        steps[name] = (losses, step.model(), converted)
    assert steps["tvm"][2] == ["lr", "x", "x1"] * 2  # not the 4 parameters and 8 moments
    np.testing.assert_allclose(steps["tvm"][0], steps["interpreter"][0], rtol=1e-5)
    for (_, p), (_, q) in zip(steps["tvm"][1].leaves(), steps["interpreter"][1].leaves()):
        np.testing.assert_allclose(p.state.get(), q.state.get(), rtol=1e-5, atol=1e-6)
