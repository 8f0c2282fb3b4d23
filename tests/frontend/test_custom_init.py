"""Custom initializers: `Param.lazy(shape, init=fn)` with `fn(shape, dtype, rng)`, lazy like Burn's
`Param::uninitialized` (burn-notes §2.2 "Lazy creation": `lazy_device()` and `lazy_shape()` answer without
initializing; clones share the lazy state, so init runs at most once) and seeded from the ParamId as the
built-in initializers are."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kiln
from kiln import Lora, Module, Param
from kiln.ir import DType, Init, IRParseError, ShapeError, TensorType, interpret, parse
from kiln.ir import init as initializers

AD = kiln.Device("cpu").autodiff()


class Counting:
    """An initializer that counts its calls and records what it was given."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, shape, dtype, rng):
        self.calls.append((shape, dtype))
        return rng.uniform(-1.0, 1.0, shape)


class Net(Module):
    def __init__(self, init, device: kiln.Device | None = None, id: int | None = None):
        self.w = Param.lazy((3, 2), init, device=device, id=id)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return x @ self.w.val()


def test_initializer_gets_shape_dtype_and_a_generator_seeded_from_the_param_id():
    fn = Counting()
    p = Param.lazy((3, 2), fn, dtype="f16", id=42)
    value = p.val().numpy()
    assert fn.calls == [((3, 2), DType.f16)]
    expected = np.random.default_rng(42).uniform(-1.0, 1.0, (3, 2)).astype(np.float16)  # numpy oracle
    np.testing.assert_array_equal(value, expected)


def test_seeding_matches_the_built_in_initializers():
    builtin = Param.lazy((4, 4), Init("normal", (("std", 2.0),)), id=7).val().numpy()
    custom = Param.lazy((4, 4), lambda shape, dtype, rng: rng.normal(0.0, 2.0, shape), id=7).val().numpy()
    np.testing.assert_array_equal(custom, builtin)


def test_stays_lazy_through_counting_devices_moves_and_materialize():
    # spec (materialize): "Parameters without reparameterizations remain lazy; this does not initialize them."
    fn = Counting()
    net = Net(fn, AD)
    assert net.num_params() == 6 and net.devices() == [AD]
    moved = net.to_device("cpu").fork("cpu").valid().train().materialize()
    records = moved.into_record()
    assert not moved.w.is_initialized() and not net.w.is_initialized() and fn.calls == []
    np.testing.assert_array_equal(records["w"].array(), moved.w.val().numpy())
    np.testing.assert_array_equal(moved.w.val().numpy(), net.w.val().numpy())  # same ParamId, same value


def test_clones_share_one_initialization():
    fn = Counting()
    net = Net(fn)
    clone = net.clone()
    net.w.val()
    clone.w.val()
    assert len(fn.calls) == 1


def test_lora_over_a_custom_initialized_base_materializes_its_value():
    net = Net(lambda shape, dtype, rng: np.full(shape, 0.5), AD).apply_lora(Lora(rank=1, alpha=1.0))
    merged = net.materialize()
    np.testing.assert_allclose(merged.w.val().numpy(), np.full((3, 2), 0.5))  # lora b starts at zero


def test_trace_keeps_it_lazy_as_an_opaque_python_init():
    # a Python callable has no text: the graph holds it (the interpreter and compilers call it when they need
    # the value), `.kir` prints `init = python`, and the parser refuses to read one back
    net = Net(lambda shape, dtype, rng: rng.normal(size=shape))
    graph = kiln.trace(net, ((None, 3), "f32"))
    assert graph.params["w"].init.kind == "python" and graph.params["w"].data is None
    assert not net.w.is_initialized()
    x = np.ones((2, 3), np.float32)
    np.testing.assert_allclose(interpret(graph, [x])[0], x @ net.w.val().numpy(), rtol=1e-6)
    text = str(graph)
    assert "init = python" in text
    with pytest.raises(IRParseError) as info:
        parse(text, "traced.kir")
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "init = python" in ln)
    column = text.splitlines()[line - 1].index("python") + 1
    assert str(info.value).startswith(f"traced.kir:{line}:{column}: a Python initializer (init = python) cannot "
                                      "be read from text")


@pytest.mark.parametrize("fn, dtype, message", [
    (lambda shape, dtype, rng: np.zeros(6), "f32", "gave shape [6] for parameter"),
    (lambda shape, dtype, rng: np.zeros(shape, np.int64), "f32", "gave int64 values for parameter"),
    (lambda shape, dtype, rng: np.zeros(shape), "i64", "gave float64 values for parameter"),
    (lambda shape, dtype, rng: np.zeros(shape, object), "f32", "gave object values for parameter"),
])
def test_a_wrong_result_names_the_initializer_and_the_parameter(fn, dtype, message):
    p = Param.lazy((3, 2), fn, dtype=dtype, id=9)
    with pytest.raises(ShapeError) as info:
        p.val()
    text = str(info.value)
    assert text.startswith("initializer <lambda> ") and message in text and str(kiln.ParamId(9)) in text


def test_a_non_callable_initializer_is_refused():
    with pytest.raises(ShapeError, match="must be callable as fn"):
        Param.lazy((2,), "normal")  # type: ignore[arg-type]


def test_an_integer_parameter_takes_integer_results():
    p = Param.lazy((3,), lambda shape, dtype, rng: rng.integers(0, 10, shape, dtype=np.int32), dtype="i64",
                   require_grad=False, id=3)
    np.testing.assert_array_equal(p.val().numpy(), np.random.default_rng(3).integers(0, 10, 3, dtype=np.int32))
    assert p.val().numpy().dtype == np.int64


SCRIPT = """
import json, sys
import kiln
kiln.seed(int(sys.argv[1]))
p = kiln.Param.lazy((2, 3), lambda shape, dtype, rng: rng.standard_normal(shape))
print(json.dumps({"id": str(p.id), "value": p.val().numpy().tolist()}))
"""


def run(seed: str) -> dict:
    done = subprocess.run([sys.executable, "-c", SCRIPT, seed], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def test_kiln_seed_makes_custom_initializers_reproducible():
    first = run("11")
    assert first == run("11") and first["value"] != run("12")["value"]


def test_evaluate_runs_a_python_init_like_a_built_in():
    init = initializers.python(lambda shape, dtype, rng: rng.uniform(0.0, 1.0, shape))
    value = initializers.evaluate(init, TensorType((5,), DType.bf16), 123)
    expected = np.random.default_rng(123).uniform(0.0, 1.0, 5).astype(value.dtype)
    np.testing.assert_array_equal(value.astype(np.float32), expected.astype(np.float32))


def test_bound_compile_cache_keys_tell_python_initializers_apart_by_value():
    # a callable's repr is an address, which another process may reuse for another function: the key must not
    # let a build with other initial weights hit the cache
    from kiln.runtime.tvm.compile import cache_key
    from kiln.runtime.tvm.target import resolve_target

    class Fill:
        """Two of these print alike, as two functions at one reused address do."""

        def __init__(self, value: float):
            self.value = value

        def __call__(self, shape, dtype, rng):
            return np.full(shape, self.value)

        def __repr__(self) -> str:
            return "<function fill at 0x7f0000000000>"

    def key(value: float) -> str:
        graph = kiln.trace(Net(Fill(value), id=1), ((None, 3), "f32"))
        return cache_key(graph, ["forward"], resolve_target("llvm"), "bound", True)

    assert key(1.0) != key(2.0)
    assert key(1.0) == key(1.0)
