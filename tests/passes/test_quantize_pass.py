"""quantize-weights, QLoRA through reparameterize, and materialize: semantics checked with the interpreter against
numpy computations written here, plus the state the passes leave on codes, scales and factors."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.ir import Builder, DType, Graph, Init, Interpreter, ParamNode, PassError, interpret, verify
from kiln.ir.interpreter import param_value
from kiln.passes import PassManager, get_pass, parse_pipeline

X = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)


def mlp(dtype: str = "f32") -> Graph:
    """linear(4 -> 6) with a lazy weight and a data bias, relu, linear(6 -> 2); an i64 buffer-like counter."""
    b = Builder("Net")
    w1 = b.param("fc1.weight", (4, 6), dtype, init=Init("normal", (("std", 0.5),)), autodiff=True, device="cuda:0")
    b1 = b.param("fc1.bias", (6,), dtype, data=np.linspace(-1, 1, 6).astype(DType(dtype).numpy), autodiff=True)
    w2 = b.param("fc2.weight", (6, 2), dtype, init=Init("uniform", (("min", -1.0), ("max", 1.0))), autodiff=True)
    b.param("steps", (1,), "i64", data=np.array([3]), grad=False)
    x = b.input("x", ((None, 4), dtype))
    b.ret(b.linear(b.relu(b.linear(x, w1, b1)), w2))
    return verify(b.build())


def run(pipeline: str, graph: Graph) -> Graph:
    return PassManager.parse(pipeline, verify_each=True).run(graph)


def dequantized(graph: Graph, name: str) -> np.ndarray:
    """codes * scales of a quantized param, each scale repeated over its block, computed here in numpy."""
    r = graph.reparams[name]
    codes, scales = (graph.params[o].data for o in r.operands)
    scale = scales.reshape(()) if not r.attrs["block"] else scales
    for axis in range(codes.ndim) if r.attrs["block"] else ():
        scale = np.repeat(scale, codes.shape[axis] // scales.shape[axis], axis)
    return (codes.astype(np.float32) * scale).astype(r.type.dtype.numpy)


# -- quantize-weights ------------------------------------------------------------------------------------------


def test_forward_changes_by_at_most_the_quantization_error() -> None:
    """|y - y_q| <= |h| @ |dW| + |db| layer by layer, with |dW| <= scale / 2 elementwise (q8s, per tensor)."""
    graph = mlp()
    quant = run("quantize-weights{value=q8s}", graph)
    values = Interpreter(graph)
    h = np.maximum(X @ values.symbol("fc1.weight") + values.symbol("fc1.bias"), 0)
    half = {n: graph_scale(quant, n) / 2 for n in ("fc1.weight", "fc1.bias", "fc2.weight")}
    h_bound = np.abs(X) @ np.full((4, 6), half["fc1.weight"]) + half["fc1.bias"]
    w2 = values.symbol("fc2.weight")
    bound = (np.abs(h) + h_bound) @ np.full((6, 2), half["fc2.weight"]) + h_bound @ np.abs(w2)
    (before,), (after,) = interpret(graph, [X]), interpret(quant, [X])
    assert np.all(np.abs(before - after) <= bound * (1 + 1e-5) + 1e-6)
    assert not np.array_equal(before, after)


def graph_scale(graph: Graph, name: str) -> float:
    return float(graph.params[f"{name}.scales"].data[0])


def test_codes_keep_the_param_and_scales_are_new() -> None:
    graph = mlp()
    quant = run("quantize-weights{value=q4s block=1,2 paths=*.weight}", graph)
    old, codes, scales = graph.params["fc1.weight"], quant.params["fc1.weight.codes"], quant.params["fc1.weight.scales"]
    assert (codes.id, codes.device, codes.autodiff) == (old.id, "cuda:0", True)
    assert (codes.grad, codes.configured_grad, codes.init, codes.type.dtype) == (False, False, None, DType.i4)
    assert scales.id not in {p.id for p in graph.params.values()} and not scales.grad
    assert scales.type.shape == (4, 3) and scales.device == "cuda:0"
    assert quant.params["steps"] is graph.params["steps"]
    assert "fc1.weight" not in quant.params and quant.reparams["fc1.weight"].type == old.type
    assert quant.functions == graph.functions  # uses of @fc1.weight are unchanged


@pytest.mark.parametrize("pipeline", ["quantize-weights{value=q8f}", "quantize-weights{value=q2s block=2}",
                                      "quantize-weights{value=q4f block=2,2 calibration=absmean paths=*.weight}"])
def test_each_quantized_value_is_the_dequantized_codes(pipeline: str) -> None:
    """Lazy params are quantized from their initializer; the derivation evaluates to codes * scales."""
    graph = mlp()
    quant = run(pipeline, graph)
    values = Interpreter(quant)
    assert {"fc1.weight", "fc2.weight"} <= set(quant.reparams)
    for name in quant.reparams:
        np.testing.assert_array_equal(values.symbol(name), dequantized(quant, name))
    codes = quant.params["fc1.weight.codes"].data
    assert codes.any() and codes.dtype == quant.params["fc1.weight.codes"].type.dtype.numpy
    original = param_value(graph.params["fc1.weight"])
    assert np.abs(values.symbol("fc1.weight") - original).max() < np.abs(original).max()


def test_f64_weights_dequantize_to_f64() -> None:
    quant = run("quantize-weights{value=q8s}", mlp("f64"))
    assert quant.reparams["fc1.weight"].attrs["dtype"] is DType.f64
    assert interpret(quant, [X.astype(np.float64)])[0].dtype == np.float64


def test_paths_and_exclude_select_params() -> None:
    quant = run("quantize-weights{paths=fc*.* exclude=*.bias}", mlp())
    assert set(quant.reparams) == {"fc1.weight", "fc2.weight"}
    assert "fc1.bias" in quant.params


def test_buffers_and_integer_params_are_left_alone() -> None:
    graph = mlp()
    buffer = graph.params["fc1.bias"].replace(buffer=True, grad=False)
    graph = graph.replace(params={**graph.params, buffer.name: buffer})
    quant = run("quantize-weights", graph)
    assert quant.params["fc1.bias"] is graph.params["fc1.bias"] and quant.params["steps"] is graph.params["steps"]


def test_quantized_params_are_skipped_the_second_time() -> None:
    once = run("quantize-weights{value=q8s}", mlp())
    twice = run("quantize-weights{value=q4s}", once)
    assert twice.params == once.params and twice.reparams == once.reparams


def test_lora_bases_cannot_be_quantized() -> None:
    with pytest.raises(PassError, match=r"@fc1.weight.base is an operand of a lora derivation; quantize before"):
        run("reparameterize{rank=2},quantize-weights", mlp())


def test_a_taken_codes_name_is_an_error() -> None:
    graph = mlp()
    taken = graph.params["steps"].replace(name="fc2.weight.codes")
    graph = graph.replace(params={**graph.params, taken.name: taken})
    with pytest.raises(PassError, match=r"@fc2.weight.codes already exists"):
        get_pass("quantize-weights")().apply(graph)


def test_an_indivisible_block_names_the_param() -> None:
    with pytest.raises(PassError, match=r"@fc1.bias: quantize: block \[4\] does not divide dim 0 \(6\)"):
        run("quantize-weights{block=4 paths=fc1.bias}", mlp())


def test_block_option_text() -> None:
    (p,) = parse_pipeline("quantize-weights{value=q4s block=1,32 calibration=absmean}")
    assert (p.value, p.block, p.calibration) == ("q4s", (1, 32), "absmean")
    assert p.pipeline_text() == "quantize-weights{value=q4s block=1,32 calibration=absmean}"
    assert parse_pipeline("quantize-weights{block=}")[0].block == ()
    with pytest.raises(PassError, match=r"option block='x': expected an integer"):
        parse_pipeline("quantize-weights{block=1,x}")


# -- valid / train -----------------------------------------------------------------------------------------------


def test_valid_and_train_leave_the_codes_untouched() -> None:
    quant = run("quantize-weights{value=q4s}", mlp())
    for pipeline in ("valid", "valid,train", "train"):
        out = run(pipeline, quant)
        for name in ("fc1.weight.codes", "fc2.weight.codes"):
            before, after = quant.params[name], out.params[name]
            assert after.type == before.type and after.data is before.data and not after.grad
        assert out.reparams == quant.reparams
    assert run("valid,train", quant).params["fc1.weight.codes"].autodiff


# -- QLoRA -----------------------------------------------------------------------------------------------------


def qlora(block: str = "1,2", rank: int = 2, alpha: float = 3.0) -> Graph:
    return run(f"quantize-weights{{value=q4s block={block} paths=fc*.weight}},"
               f"reparameterize{{rank={rank} alpha={alpha}}}", mlp())


def with_factors(graph: Graph, rng: np.random.Generator) -> Graph:
    """The LoRA factors given random data (b is zeros at first, which would hide a wrong product)."""
    params = dict(graph.params)
    for name, p in graph.params.items():
        if ".lora." in name:
            params[name] = p.replace(init=None, data=rng.standard_normal(p.type.shape).astype(np.float32))
    return graph.replace(params=params)


def test_qlora_structure() -> None:
    graph = qlora()
    base, adapted = graph.reparams["fc1.weight.base"], graph.reparams["fc1.weight"]
    assert (base.kind, base.operands) == ("dequantize", ("fc1.weight.codes", "fc1.weight.scales"))
    assert (adapted.kind, adapted.operands) == ("lora", ("fc1.weight.base", "fc1.weight.lora.a", "fc1.weight.lora.b"))
    assert adapted.attrs["scale"] == 1.5
    a = graph.params["fc1.weight.lora.a"]
    assert a.type.shape == (4, 2) and a.grad and a.device == "cuda:0"
    assert not graph.params["fc1.bias"].grad  # every float param is frozen
    assert list(graph.reparams).index("fc1.weight.base") < list(graph.reparams).index("fc1.weight")


def test_qlora_factors_take_the_dequantized_dtype() -> None:
    graph = run("quantize-weights{value=q8s paths=fc1.weight},reparameterize{rank=1}", mlp("f64"))
    assert graph.params["fc1.weight.lora.a"].type.dtype is DType.f64


def test_qlora_forward_and_materialize_match_numpy() -> None:
    graph = with_factors(qlora(), np.random.default_rng(0))
    folded = run("materialize", graph)
    for name in ("fc1.weight", "fc2.weight"):
        a, b = graph.params[f"{name}.lora.a"].data, graph.params[f"{name}.lora.b"].data
        want = dequantized(graph, f"{name}.base") + 1.5 * (a @ b)
        np.testing.assert_allclose(Interpreter(graph).symbol(name), want, rtol=1e-6, atol=1e-6)
        p = folded.params[name]
        np.testing.assert_allclose(p.data, want, rtol=1e-6, atol=1e-6)
        assert (p.id, p.type.dtype, p.grad, p.init) == (graph.params[f"{name}.codes"].id, DType.f32, False, None)
    assert not folded.reparams
    assert not [n for n in folded.params if n.endswith((".codes", ".scales")) or ".lora." in n]
    np.testing.assert_allclose(interpret(folded, [X])[0], interpret(graph, [X])[0], rtol=1e-5, atol=1e-6)


def test_materialize_keeps_unadapted_quantized_weights() -> None:
    quant = run("quantize-weights{value=q8s},reparameterize{rank=2 paths=fc2.*}", mlp())
    folded = run("materialize", quant)
    assert folded.reparams == {n: quant.reparams[n] for n in ("fc1.weight", "fc1.bias")}
    assert {"fc1.weight.codes", "fc1.weight.scales", "fc1.bias.codes"} <= set(folded.params)
    assert isinstance(folded.params["fc2.weight"], ParamNode) and folded.params["fc2.weight"].data is not None
    assert "fc2.weight.scales" not in folded.params
    assert run("materialize", run("quantize-weights", mlp())).reparams.keys() == {"fc1.weight", "fc1.bias",
                                                                                   "fc2.weight"}


def test_reparameterize_still_rejects_a_lora_over_lora() -> None:
    with pytest.raises(PassError, match="nested reparameterizations are not supported"):
        run("quantize-weights,reparameterize,reparameterize", mlp())
