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
