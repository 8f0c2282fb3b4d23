"""The executable's call path: which inputs reach the kernel without a copy, the aligned-array helpers, bad inputs,
and outputs that stay the caller's own.

Issue 13: "users' inputs that are not 64-byte aligned are not copied where the kernel can take them (or kiln offers
an aligned-array helper the examples use)". TVM's kernels assume 64-byte aligned arguments, so the helper it is.
"""

from __future__ import annotations

import numpy as np
import pytest

import kiln
from kiln.ir import Builder, KilnError, ShapeError, interpret
from kiln.runtime.tvm import executable
from kiln.runtime.tvm.aligned import ALIGNMENT, is_aligned
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import Executable, _device_input


def _affine(batch: int | None) -> kiln.ir.Graph:
    """y = x @ w + b, z = relu(y)."""
    b = Builder("Affine")
    x = b.input("x", ((batch, 16), "f32"))
    y = b.add(b.matmul(x, b.input("w", ((16, 8), "f32"))), b.input("b", ((8,), "f32")))
    b.ret(y, b.relu(y))
    return b.build()


@pytest.fixture(scope="module")
def static() -> tuple[kiln.ir.Graph, Executable]:
    graph = _affine(4)
    return graph, compile_graph(graph, cache=False)


@pytest.fixture(scope="module")
def dynamic() -> tuple[kiln.ir.Graph, Executable]:
    graph = _affine(None)
    return graph, compile_graph(graph, cache=False)


def _misaligned(shape: tuple[int, ...], dtype: type = np.float32) -> np.ndarray:
    """A C-contiguous writeable array whose data sits 4 bytes past a 64-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = kiln.aligned_empty(n + ALIGNMENT, np.uint8)
    return raw[4:4 + n].view(dtype).reshape(shape)


def _pointer(exe: Executable, x: np.ndarray) -> int:
    """Where the executable's TVM tensor for input `x` keeps its data."""
    plan = exe._plans.get("forward") or exe._plan("forward")
    return np.from_dlpack(_device_input("forward", plan.inputs[0], x, plan)).ctypes.data


def _check(graph: kiln.ir.Graph, exe: Executable, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> None:
    for got, want in zip(exe.run(x, w, b), interpret(graph, [np.array(x), w, b])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _weights() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)


@pytest.mark.parametrize(("shape", "dtype"), [((1, 4), np.float32), ((3, 5, 7), np.float64), ((2, 3), np.int8),
                                              (13, np.int32)])
def test_aligned_empty_starts_on_a_64_byte_boundary(shape, dtype) -> None:
    x = kiln.aligned_empty(shape, dtype)
    assert x.ctypes.data % 64 == 0 and x.flags.c_contiguous and x.flags.writeable
    assert x.shape == ((shape,) if isinstance(shape, int) else shape) and x.dtype == dtype


def test_aligned_keeps_an_aligned_array_and_copies_any_other() -> None:
    x = kiln.aligned_empty((4, 16))
    assert kiln.aligned(x) is x
    for other in (_misaligned((4, 16)), np.arange(64.0, dtype=np.float32).reshape(16, 4).T):
        got = kiln.aligned(other)
        assert got is not other and is_aligned(got)
        np.testing.assert_array_equal(got, other)


def test_an_aligned_input_reaches_the_kernel_without_a_copy(static) -> None:
    graph, exe = static
    x = kiln.aligned(np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32))
    assert _pointer(exe, x) == x.ctypes.data
    _check(graph, exe, x, *_weights())


@pytest.mark.parametrize("kind", ["misaligned", "transposed", "strided", "read-only"])
def test_inputs_the_kernel_cannot_take_are_copied_and_still_correct(static, kind) -> None:
    graph, exe = static
    data = np.random.default_rng(1).standard_normal((4, 16)).astype(np.float32)
    if kind == "misaligned":
        x = _misaligned((4, 16))
        x[...] = data
    elif kind == "transposed":
        x = np.ascontiguousarray(data.T).T
    elif kind == "strided":
        x = np.repeat(data, 2, axis=1)[:, ::2]
    else:
        x = kiln.aligned(data)
        x.flags.writeable = False
    assert _pointer(exe, x) % ALIGNMENT == 0 and _pointer(exe, x) != x.ctypes.data
    _check(graph, exe, x, *_weights())


def test_dynamic_inputs_of_many_shapes(dynamic, monkeypatch) -> None:
    """The converted-shape cache may be cleared between calls (here after two shapes) without changing results."""
    graph, exe = dynamic
    monkeypatch.setattr(executable, "_SHAPE_CACHE", 2)
    rng = np.random.default_rng(2)
    for i, batch in enumerate((1, 3, 5, 3, 1, 7)):
        x = kiln.aligned(rng.standard_normal((batch, 16)).astype(np.float32)) if i % 2 else _misaligned((batch, 16))
        x[...] = rng.standard_normal((batch, 16))
        _check(graph, exe, x, *_weights())


@pytest.mark.parametrize("shape", [(0, 5, 16), (2, 0, 16), (0, 0, 16)])
def test_empty_inputs_of_dynamic_dims(shape: tuple[int, ...]) -> None:
    """An input with a dynamic dim of 0 runs and gives the empty result (numpy's strides for an empty array are
    not the compact ones TVM's argument check wants: it is copied into a buffer of kiln's)."""
    b = Builder("Batched")
    b.ret(b.matmul(b.input("x", ((None, None, 16), "f32")), b.input("w", ((16, 8), "f32"))))
    exe = compile_graph(b.build(), cache=False)
    y = exe(np.zeros(shape, np.float32), _weights()[0])
    assert y.shape == (*shape[:2], 8)


@pytest.mark.parametrize(("x", "fault"), [
    (np.zeros((4, 16), np.float64), r"shape \[4, 16\] dtype float64"),
    (np.zeros((4, 15), np.float32), r"shape \[4, 15\] dtype float32"),
    (np.zeros((16,), np.float32), r"shape \[16\] dtype float32"),
    ([[0.0] * 16] * 4, r"shape \[4, 16\] dtype float64"),
])
def test_a_wrong_input_is_a_shape_error_naming_it(static, x, fault) -> None:
    _, exe = static
    with pytest.raises(ShapeError, match=rf"@forward input %x expects tensor<4x16xf32>, got {fault}"):
        exe.run(x, *_weights())


def test_a_wrong_input_count_names_the_count(static) -> None:
    _, exe = static
    with pytest.raises(KilnError, match="@forward takes 3 inputs, got 2"):
        exe.run(np.zeros((4, 16), np.float32), _weights()[0])


def test_outputs_of_two_calls_are_independent(static) -> None:
    """The caller owns what a call returns: a later call, or a change to the (zero-copy) input, leaves it alone."""
    graph, exe = static
    w, b = _weights()
    x = kiln.aligned(np.ones((4, 16), np.float32))
    first = exe.run(x, w, b)
    kept = [a.copy() for a in first]
    x[...] = -2.0
    second = exe.run(x, w, b)
    for a, k, s, want in zip(first, kept, second, interpret(graph, [x, w, b])):
        np.testing.assert_array_equal(a, k)
        np.testing.assert_allclose(s, want, rtol=1e-5, atol=1e-5)
        assert not np.shares_memory(a, s)
    first[0][...] = 7.0
    np.testing.assert_array_equal(exe.run(x, w, b)[0], second[0])
