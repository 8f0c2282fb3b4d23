"""A dynamic batch's memory plan: storage shared between intermediates up to `max_batch`, larger batches through an
unbounded build made on first need, and a loaded library that refuses them by name."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from tvm import relax, tirx

import kiln
from kiln import nn
from kiln.frontend.trace import trace
from kiln.ir import KilnError, ShapeError, interpret
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.executable import load_executable
from kiln.runtime.tvm.memory_plan import DEFAULT_MAX_BATCH, batch_dims

SPEC = ((None, 3, 8, 8), "f32")


@pytest.fixture(scope="module")
def graph() -> kiln.ir.Graph:
    """3x3 convs in a chain over a dynamic batch, of 64, 48, 32 and 16 channels: intermediates whose sizes are
    different multiples of it, each dead once the next conv has read it. Without a bound, Relax shares storage
    only between tensors of one symbolic size."""
    widths = (3, 64, 48, 32, 16)
    return trace(nn.Sequential(*(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths, widths[1:]))), SPEC)


def _storages(exe: kiln.runtime.tvm.executable.Executable) -> int:
    """The storage allocations of a call (the plan's, of a constant size, and the symbolic-size rest)."""
    return exe._bytecode().count("call  vm.builtin.alloc_storage")


def test_a_bounded_batch_shares_storage_and_matches_the_interpreter(graph: kiln.ir.Graph) -> None:
    """The bound (input 0, axis 0, 4) is in the signature, the build allocates fewer storages than the unbounded one
    (one per size there), and every batch up to the bound computes what the interpreter does."""
    bounded, unbounded = compile_graph(graph, max_batch=4), compile_graph(graph, max_batch=None)
    assert bounded.signatures["forward"].bounds == ((0, 0, 4),) and unbounded.signatures["forward"].bounds == ()
    assert _storages(bounded) < _storages(unbounded), (_storages(bounded), _storages(unbounded))
    for batch in (1, 4, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
        np.testing.assert_allclose(bounded(x), interpret(graph, [x])[0], rtol=1e-4, atol=1e-4)
    assert bounded._wide is None


def test_a_batch_past_the_bound_runs_an_unbounded_build_made_once(graph: kiln.ir.Graph,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    exe = compile_graph(graph, max_batch=2)
    with caplog.at_level(logging.INFO, logger="kiln.compile"):
        for batch in (5, 7, 1):
            x = np.random.default_rng(batch).standard_normal((batch, 3, 8, 8)).astype(np.float32)
            np.testing.assert_allclose(exe(x), interpret(graph, [x])[0], rtol=1e-4, atol=1e-4)
    assert [r.getMessage() for r in caplog.records if "past the memory plan" in r.getMessage()] == [
        "@forward: a batch of 5 is past the memory plan's 2; building without that bound"]
    assert exe._wide is not None and exe._wide.signatures["forward"].bounds == ()


def test_a_loaded_library_refuses_a_batch_past_its_bound(graph: kiln.ir.Graph, tmp_path: Path) -> None:
    path = str(tmp_path / "block.so")
    compile_graph(graph, max_batch=2).export_library(path)
    exe = load_executable(path)
    assert exe.signatures["forward"].bounds == ((0, 0, 2),)
    x = np.ones((2, 3, 8, 8), np.float32)
    np.testing.assert_allclose(exe(x), interpret(graph, [x])[0], rtol=1e-4, atol=1e-4)
    with pytest.raises(ShapeError, match=r"@forward input %x has 3 on axis 0, past the 2 this build planned its "
                                         r"memory for: compile it with max_batch=3 or more"):
        exe(np.ones((3, 3, 8, 8), np.float32))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "64"])
def test_max_batch_is_a_positive_int_or_none(graph: kiln.ir.Graph, bad: object) -> None:
    with pytest.raises(KilnError, match="max_batch must be a positive int or None"):
        compile_graph(graph, max_batch=bad)


def test_only_dims_that_lead_every_input_they_occur_in_are_batches() -> None:
    """A var that is also another axis (a square `m x m`) or only an inner one (a sequence length) gets no bound:
    none can be guessed for it."""
    n, s, m = (tirx.Var(name, "int64") for name in "nsm")
    params = [relax.Var(name, relax.TensorType(shape, "float32")) for name, shape in
              (("x", [n, 3, 4]), ("y", [n, s]), ("z", [m, m]))]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        bb.emit_func_output(params[0])
    assert batch_dims(bb.get()["main"]) == {"n": [(0, 0), (1, 0)]}


def test_kiln_compile_plans_a_dynamic_batch_by_default() -> None:
    exe = kiln.compile(nn.Linear(8, 4), ((None, 8), "f32"))
    assert exe.signatures["forward"].bounds == ((0, 0, DEFAULT_MAX_BATCH),)
