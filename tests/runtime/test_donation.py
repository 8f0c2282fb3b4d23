"""Donated inputs: kernels write their results into inputs the caller gives up (`runtime/tvm/donation.py`), where
that cannot change a result, and the executable never writes an array its caller made."""

from __future__ import annotations

import numpy as np
import pytest
from tvm import tirx
from tvm.script import tirx as T

import kiln
from kiln import nn, optim
from kiln.ir import Builder, KilnError, interpret
from kiln.runtime.backend import using_backend
from kiln.runtime.tvm.backend import TVMBackend
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.donation import _blocks, _in_place_safe
from kiln.runtime.tvm.executable import Executable


def _update() -> kiln.ir.Graph:
    """Adam's shape of work: m' = m + (g - m) / 10, p' = p - m' / 2, both returned."""
    b = Builder("Update")
    p, m, g = (b.input(n, ((64, 48), "f32")) for n in ("p", "m", "g"))
    m2 = b.add(m, b.mul(b.sub(g, m), b.constant(np.float32(0.1))))
    b.ret(b.sub(p, b.mul(m2, b.constant(np.float32(0.5)))), m2)
    return b.build()


def _arrays(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [kiln.aligned(rng.standard_normal((64, 48)).astype(np.float32)) for _ in range(3)]


def _in_place(exe: Executable, graph: kiln.ir.Graph, function: str = "forward") -> list[int]:
    """Which outputs alias a donated input when every input is one the last `copy=False` call handed out."""
    first = exe.run(*_arrays(), function=function, copy=False)  # views of the VM's buffers, fed back below
    inputs = [*first, *_arrays(1)[len(first):]]
    addresses = [x.ctypes.data for x in inputs]
    want = interpret(graph, inputs, function)
    outs = exe.run(*inputs, function=function, copy=False)
    for got, expected in zip(outs, want):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    return [i for i, o in enumerate(outs) if o.ctypes.data in addresses]


def test_results_go_into_the_donated_inputs_they_replace() -> None:
    graph = _update()
    exe = compile_graph(graph, params="inputs", cache=False, donate={"forward": ["p", "m"]})
    assert exe.signatures["forward"].donated == (0, 1)
    assert _in_place(exe, graph) == [0, 1]


def test_without_donation_every_result_is_a_fresh_buffer() -> None:
    graph = _update()
    assert _in_place(compile_graph(graph, params="inputs", cache=False), graph) == []


def test_an_input_read_after_the_kernel_or_at_other_elements_is_not_overwritten() -> None:
    """x is read by exp(x), whose result is shaped like x, and again by the add after the matmul: only the add, its
    last reader, may overwrite it. w is read transposed (w^T + 1 reads element [j, i] to write [i, j]), so it keeps
    its buffer. Overwriting either would change a result."""
    b = Builder("Kept")
    x, w = b.input("x", ((32, 32), "f32")), b.input("w", ((32, 32), "f32"))
    b.ret(b.add(x, b.matmul(b.exp(x), w)), b.add(b.transpose(w, perm=[1, 0]), b.constant(np.float32(1.0))))
    graph = b.build()
    exe = compile_graph(graph, params="inputs", cache=False, donate={"forward": ["x", "w"]})
    rng = np.random.default_rng(0)
    first = exe.run(*(kiln.aligned(rng.standard_normal((32, 32)).astype(np.float32)) for _ in range(2)), copy=False)
    fed = [np.array(a) for a in first]  # the values, kept apart from the buffers the call may write
    outs = exe.run(*first, copy=False)
    for got, want in zip(outs, interpret(graph, fed)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_callers_own_arrays_are_never_written() -> None:
    """Donation only hands over views the executable gave out: the caller's arrays go in as copies."""
    graph = _update()
    exe = compile_graph(graph, params="inputs", cache=False, donate={"forward": ["p", "m"]})
    inputs = _arrays()
    before = [a.copy() for a in inputs]
    for copy in (True, False):
        outs = exe.run(*inputs, copy=copy)
        for got, want in zip(outs, interpret(graph, before)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(inputs, before):
            np.testing.assert_array_equal(a, b)


def test_one_buffer_passed_twice_is_written_once() -> None:
    """The same handed-out view given as both donated inputs: one of them goes in as a copy, so the kernel never
    reads what it has just written through the other."""
    graph = _update()
    exe = compile_graph(graph, params="inputs", cache=False, donate={"forward": ["p", "m"]})
    view = exe.run(*_arrays(), copy=False)[0]
    fed = np.array(view)
    g = _arrays(2)[2]
    outs = exe.run(view, view, g, copy=False)
    for got, want in zip(outs, interpret(graph, [fed, fed, g])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_donating_an_unknown_input_names_it() -> None:
    with pytest.raises(KilnError, match="@forward has no input %q to donate"):
        compile_graph(_update(), params="inputs", cache=False, donate={"forward": ["p", "q"]})
    with pytest.raises(KilnError, match="cannot donate inputs of @step"):
        compile_graph(_update(), params="inputs", cache=False, donate={"step": ["p"]})


def test_the_train_step_updates_in_place_and_its_model_is_a_snapshot() -> None:
    """A captured Adam step donates its parameters and moments: after the first step (whose inputs are the
    module's own arrays, copied) each step writes into the last one's results; a module taken from the step is a
    copy that later steps leave alone; the losses match the interpreter's step for step."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 12)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32)

    model = nn.Linear(12, 4, device=kiln.Device("cpu").autodiff())

    def losses(backend: object | None) -> tuple[list[float], list[bool], np.ndarray, np.ndarray]:
        with using_backend(backend):  # type: ignore[arg-type]
            step = kiln.compile_step(model, lambda m, a, b: nn.mse_loss(m(a), b), optim.Adam(), ((16, 12), "f32"),
                                     ((16, 4), "f32"))
            seen, in_place, snapshot = [], [], None
            for i in range(4):
                before = {id(a): a.ctypes.data for a in step._params}  # noqa: SLF001 (the arrays it was given)
                seen.append(step(1e-2, x, y))
                in_place.append(any(a.ctypes.data in before.values() for a in step._params))  # noqa: SLF001
                if i == 1:
                    snapshot = step.model()
                    kept = np.array(snapshot.weight.val().numpy())
            assert snapshot is not None
            return seen, in_place, kept, snapshot.weight.val().numpy()

    reference, _, _, _ = losses(None)
    seen, in_place, kept, later = losses(TVMBackend())
    np.testing.assert_allclose(seen, reference, rtol=1e-5)
    assert in_place == [False, True, True, True]
    np.testing.assert_array_equal(later, kept)


@T.prim_func(s_tir=True)
def _kernels(a: T.Buffer((8, 8), "float32"), b: T.Buffer((8, 8), "float32"), c: T.Buffer((8, 8), "float32"),
             d: T.Buffer((8, 8), "float32")):
    """c = a + 1 (a read at the element written), d = b^T + c (b read at the mirrored element)."""
    for i, j in T.grid(8, 8):
        with T.sblock("c"):
            vi, vj = T.axis.remap("SS", [i, j])
            c[vi, vj] = a[vi, vj] + T.float32(1)
    for i, j in T.grid(8, 8):
        with T.sblock("d"):
            vi, vj = T.axis.remap("SS", [i, j])
            d[vi, vj] = b[vj, vi] + c[vi, vj]


@T.prim_func(s_tir=True)
def _row_sums(a: T.Buffer((8, 8), "float32"), s: T.Buffer((8, 8), "float32")):
    for i, j, k in T.grid(8, 8, 8):
        with T.sblock("s"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                s[vi, vj] = T.float32(0)
            s[vi, vj] = s[vi, vj] + a[vi, vk]


@pytest.mark.parametrize(("kernel", "source", "result", "safe"), [
    (_kernels, 0, 2, True),  # read where written
    (_kernels, 1, 3, False),  # read transposed
    (_kernels, 0, 3, False),  # read by another block than the writer
    (_row_sums, 0, 1, False),  # a reduction writes each element many times
], ids=["pointwise", "transposed", "other-block", "reduction"])
def test_in_place_safe_reads_the_blocks(kernel: tirx.PrimFunc, source: int, result: int, safe: bool) -> None:
    assert _in_place_safe(_blocks(kernel), kernel.params[source], kernel.params[result]) is safe
