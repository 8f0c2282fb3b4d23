"""A batched `transpose(x) @ g` lowered as one kernel reading x transposed (`runtime/tvm/transposed_matmul.py`):
attention's value and key gradients. Structure: the fused module has no transpose kernel where it folded (and
keeps one where it must not fold); values: numpy's `swapaxes(x) @ g`, the oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tvm
from step_oracle import assert_steps_match_interpreter

from kiln.ir import DType, FunctionBuilder, Graph, TensorType
from kiln.runtime.tvm.compile import compile_graph, lowering_input
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.schedules import CPUMatmul
from kiln.runtime.tvm.target import cpu_target


def graph(x_shape: tuple[int | None, ...], g_shape: tuple[int | None, ...], perm: tuple[int, ...] | None = None,
          transpose_rhs: bool = False, dtype: DType = DType.f32) -> Graph:
    """`transpose(x, perm) @ g`, or `x @ transpose(g, perm)` with `transpose_rhs`."""
    fb = FunctionBuilder("f", lambda name: None)
    x, g = fb.input("x", TensorType(x_shape, dtype)), fb.input("g", TensorType(g_shape, dtype))
    if transpose_rhs:
        y = fb.emit("matmul", x, fb.emit("transpose", g, perm=perm))
    else:
        y = fb.emit("matmul", fb.emit("transpose", x, perm=perm), g)
    return Graph("g", functions={"f": fb.finish([y])})


def fused(g: Graph) -> tvm.IRModule:
    target = cpu_target()
    with target:
        return tvm.transform.Sequential(cpu_fusion_passes(target))(lower(lowering_input(g), "inputs").module)


def kernels(g: Graph) -> list[str]:
    """The PrimFuncs the fused module calls, in order."""
    return [line.split("R.call_tir(")[1].split(",")[0] for line in str(fused(g)["f"]).splitlines()
            if "R.call_tir(" in line]


@pytest.mark.parametrize("x_shape, g_shape, perm", [
    ((2, 3, 32, 16), (2, 3, 32, 8), (0, 1, 3, 2)),  # attention's p^T @ g, per head
    ((4, 32, 16), (4, 32, 8), (0, 2, 1)),
])
def test_left_transpose_folds_into_the_matmul(x_shape, g_shape, perm) -> None:
    """Without the fold the module ran a transpose kernel (`transpose`) before the matmul (`matmul`)."""
    g = graph(x_shape, g_shape, perm)
    assert kernels(g) == ["matmul_tn"]
    # and CPUMatmul schedules it (its rows read with stride 1 down x's columns), not a fallback rule
    assert CPUMatmul().apply(fused(g)["matmul_tn"], cpu_target(), False) is not None


@pytest.mark.parametrize("x_shape, g_shape, perm, rhs", [
    ((64, 24), (64, 40), None, False),  # a 2-D weight gradient x^T @ g: the dense kernel reads rows
    ((2, 24, 64), (2, 40, 64), (0, 2, 1), True),  # x @ g^T: the stride would fall on the vector loop
    ((4, 8, 16), (8, 16, 5), (1, 0, 2), False),  # not the last two axes
    ((2, 32, 16), (1, 32, 8), (0, 2, 1), False),  # broadcast batch
])
def test_other_transposes_keep_their_kernel(x_shape, g_shape, perm, rhs) -> None:
    names = kernels(graph(x_shape, g_shape, perm, transpose_rhs=rhs))
    assert "matmul_tn" not in names and any("transpose" in n for n in names), names


@pytest.mark.parametrize("x_shape, g_shape, perm, run", [
    ((3, 37, 13), (3, 37, 29), (0, 2, 1), ((3, 37, 13), (3, 37, 29))),  # no vector divides the widths
    ((2, None, 16), (2, None, 24), (0, 2, 1), ((2, 50, 16), (2, 50, 24))),  # a dynamic contraction
    ((2, 3, 33, 17), (2, 3, 33, 9), (0, 1, 3, 2), ((2, 3, 33, 17), (2, 3, 33, 9))),
])
def test_folded_matmul_matches_numpy(x_shape, g_shape, perm, run) -> None:
    g = graph(x_shape, g_shape, perm)
    assert kernels(g) == ["matmul_tn"]
    rng = np.random.default_rng(0)
    x, y = (rng.standard_normal(s).astype(np.float32) for s in run)
    got = compile_graph(g, params="inputs", functions=("f",)).run(x, y, function="f")[0]
    np.testing.assert_allclose(got, np.swapaxes(x, -1, -2) @ y, rtol=1e-5, atol=1e-5)


def test_f64_folds_and_f16_keeps_its_lowering() -> None:
    """f16 computes in f32 and rounds (its own matmul lowering); f64 folds and keeps f64 precision."""
    perm = (0, 2, 1)
    assert kernels(graph((2, 8, 4), (2, 8, 5), perm, dtype=DType.f64)) == ["matmul_tn"]
    assert "matmul_tn" not in kernels(graph((2, 8, 4), (2, 8, 5), perm, dtype=DType.f16))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((2, 8, 4)), rng.standard_normal((2, 8, 5))
    got = compile_graph(graph((2, 8, 4), (2, 8, 5), perm, dtype=DType.f64), params="inputs", functions=("f",)).run(
        x, y, function="f")[0]
    np.testing.assert_allclose(got, np.swapaxes(x, 1, 2) @ y, rtol=1e-12)


def encoder_step_graph() -> tuple[Graph, object, object]:
    """A d32 h2 transformer layer's captured step (the model and its loss too), on 2 x 8 tokens."""
    import kiln
    from kiln import nn, optim
    from kiln.frontend.step import build_step

    model = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, device=kiln.Device("cpu").autodiff())

    def loss(m, x, y):
        return nn.mse_loss(m(x), y)

    x_type = TensorType((2, 8, 32), DType.f32)
    return build_step(model, loss, optim.Adam(), [x_type, x_type]).graph, model, loss


def test_encoder_step_folds_its_gradient_transposes() -> None:
    """A transformer layer's captured Adam step: attention's value and key gradients read their left factor
    transposed in the matmul (2 `matmul_tn` calls; without the fold, 0)."""
    step_graph = encoder_step_graph()[0]
    calls = [line for line in str(fused(step_graph)["step"]).splitlines() if "R.call_tir(" in line]
    assert sum("R.call_tir(matmul_tn" in line for line in calls) == 2, calls


@pytest.mark.skipif(os.environ.get("KILN_SLOW_TESTS") != "1", reason="a transformer step build (~1 min); "
                    "KILN_SLOW_TESTS=1")
def test_encoder_step_through_tvm_is_the_interpreters() -> None:
    """Two SGD steps of the layer (exact math, so rounding is all that differs): losses and new weights as the
    interpreter's (6e-8 apart when measured, folded or not)."""
    _, model, loss = encoder_step_graph()
    rng = np.random.default_rng(0)
    data = tuple(rng.standard_normal((2, 8, 32)).astype(np.float32) for _ in range(2))
    assert_steps_match_interpreter(model, loss, [(2, 8, 32), (2, 8, 32)], [data, data])
