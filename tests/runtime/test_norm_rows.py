"""Layer and RMS norms over the last axis as one hand-written kernel (`norm_rows.py`; issue 13: layer norm rows
behind onnxruntime): drawn rows of every width against a float64 numpy oracle (a mean far from zero included), the
last vector overlapping instead of guarded, independent accumulators, which norms the rewrite takes, and whole
programs (a dynamic row count, kiln's traced layer norm) against float64 numpy and kiln's interpreter."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from cross_targets import AVX2, AVX512
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tvm import relax, tirx
from tvm_ffi.structural import structural_map

import kiln
from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.norm_rows import CHAINS, KERNEL_NAME, norm_rows_kernel
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes, cpu_pipeline
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
LANES = cpu_model(TARGET).lanes()
pytestmark = pytest.mark.usefixtures("module_cache")


def _library(func: tirx.PrimFunc, target: tvm.target.Target = TARGET) -> tvm.runtime.Executable:
    return cpu_compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target, "default")


def _oracle(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray | None, eps: float) -> np.ndarray:
    """The norm in float64: a layer norm where `beta` is given, else an RMS norm."""
    x = x.astype(np.float64)
    if beta is None:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma
    return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps) * gamma + beta


def _operands(rows: int, width: int, offset: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, width)) * 3 + offset).astype(np.float32)
    return x, rng.standard_normal(width).astype(np.float32), rng.standard_normal(width).astype(np.float32)


def _run_kernel(kernel: tirx.PrimFunc, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray,
                target: tvm.target.Target = TARGET) -> np.ndarray:
    out = tvm.runtime.tensor(np.zeros_like(x))
    _library(kernel, target).jit()["main"](*(tvm.runtime.tensor(a) for a in (x, gamma, beta)), out)
    return out.numpy()


def _kernel_names(mod: tvm.IRModule) -> list[str]:
    with TARGET:
        fused = tvm.transform.Sequential(cpu_fusion_passes(TARGET, fast_math=False))(mod)
    return [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tirx.PrimFunc)]


# no shrinking: each step is a build
@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
@given(width=st.one_of(st.integers(1, 300), st.sampled_from([768, 4097])), rows=st.integers(1, 9),
       centered=st.booleans(), offset=st.sampled_from([0.0, 100.0]), eps=st.sampled_from([1e-5, 1e-6, 1e-3]))
def test_rows_of_drawn_widths_match_numpy(width: int, rows: int, centered: bool, offset: float, eps: float) -> None:
    """Every width from one element to more than a vector (one vector, a vector and one, 768, 4097), layer and RMS,
    rows about 0 or about 100 (the variance summed about the mean keeps its digits), against float64 numpy."""
    x, gamma, beta = _operands(rows, width, offset, width * rows)
    got = _run_kernel(norm_rows_kernel(width, LANES, eps, centered), x, gamma, beta if centered else 0 * beta)
    want = _oracle(x, gamma, beta if centered else None, eps)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(gamma).max() + 2e-5)


def test_an_avx2_build_matches_numpy() -> None:
    """The kernel cross-built for AVX2 (8 lanes) over rows of 244, 77 and 5, run on this host."""
    for width in (244, 77, 5):
        x, gamma, beta = _operands(6, width, 1.0, width)
        got = _run_kernel(norm_rows_kernel(width, 8, 1e-5, True), x, gamma, beta, AVX2)
        np.testing.assert_allclose(got, _oracle(x, gamma, beta, 1e-5), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize(("width", "overlap"), [(244, True), (768, False)], ids=["244", "768"])
def test_the_last_vector_overlaps_into_independent_sums(width: int, overlap: bool) -> None:
    """A row of 244 is 15 whole 16-lane vectors and one from element 228: no guarded load or store, a select in its
    two sums only (none where the vectors tile the row, 768); each sum alternates between `CHAINS` accumulator
    vectors; no gather in the AVX-512 code."""
    kernel = norm_rows_kernel(width, 16, 1e-5, True)
    text = kernel.script()
    assert "if_then_else" not in text and "likely" not in text
    assert text.count("T.Select(") == 2 * overlap and f"{width - 16}:{width}]" in text
    sizes: list[int] = []

    def record(alloc: tirx.AllocBuffer) -> tirx.AllocBuffer:
        sizes.append(int(np.prod([int(d) for d in alloc.buffer.shape])))
        return alloc

    structural_map(kernel.body, [(tirx.AllocBuffer, record)])
    assert sizes == [CHAINS * 16]
    assert "vgather" not in _library(kernel, AVX512).mod.inspect_source("asm")


def test_the_rewrite_takes_last_axis_norms_only() -> None:
    """Layer and RMS norms over the last axis run as the kernel, whatever the rank; one over two axes stays TVM's;
    all against float64 numpy."""
    x, gamma, beta = _operands(12, 50, 1.0, 0)
    x3 = x.reshape(3, 4, 50)
    cases = [
        (relax_module([x3.shape, (50,), (50,)], lambda v, g, b: relax.op.nn.layer_norm(v, g, b, axes=[-1])),
         [x3, gamma, beta], _oracle(x3, gamma, beta, 1e-5), True),
        (relax_module([x.shape, (50,)], lambda v, g: relax.op.nn.rms_norm(v, g, axes=[1], epsilon=1e-6)),
         [x, gamma], _oracle(x, gamma, None, 1e-6), True),
        (relax_module([x3.shape, (4, 50), (4, 50)], lambda v, g, b: relax.op.nn.layer_norm(v, g, b, axes=[1, 2])),
         [x3, np.ones((4, 50), np.float32), np.zeros((4, 50), np.float32)], None, False)]
    for mod, inputs, want, named in cases:
        assert (KERNEL_NAME in _kernel_names(mod)) == named
        got = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, False)), tvm.cpu())["main"](
            *(tvm.runtime.tensor(a) for a in inputs)).numpy()
        if want is None:
            flat = x3.reshape(3, -1).astype(np.float64)
            want = ((flat - flat.mean(-1, keepdims=True)) / np.sqrt(flat.var(-1, keepdims=True) + 1e-5)).reshape(
                x3.shape)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)


def test_rms_norm_over_a_dynamic_row_count() -> None:
    """One build over [n, 64] rows runs at 1 and 5 rows."""
    n = tirx.Var("n", "int64")
    mod = relax_module([(n, 64), (64,)], lambda x, g: relax.op.nn.rms_norm(x, g, axes=[-1], epsilon=1e-6))
    assert KERNEL_NAME in _kernel_names(mod)
    vm = relax.VirtualMachine(cpu_compile(mod, TARGET, cpu_pipeline(TARGET, False)), tvm.cpu())
    for rows in (1, 5):
        x, gamma, _ = _operands(rows, 64, 0.0, rows)
        got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(gamma)).numpy()
        np.testing.assert_allclose(got, _oracle(x, gamma, None, 1e-6), rtol=2e-5, atol=1e-4)


def test_a_traced_layer_norm_over_a_dynamic_batch_matches_the_interpreter() -> None:
    """kiln's layer norm with its gamma and beta over [batch, 7, 77] tokens: the kernel, equal to kiln's reference
    interpreter at batch 1 and 3."""
    b = Builder("Norm")
    x = b.input("x", ((None, 7, 77), "f32"))
    rng = np.random.default_rng(3)
    gamma = b.param("g", (77,), id=1, data=rng.standard_normal(77).astype(np.float32))
    beta = b.param("b", (77,), id=2, data=rng.standard_normal(77).astype(np.float32))
    b.ret(b.layer_norm(x, gamma, beta, axes=(2,), eps=1e-5))
    graph = b.build()
    assert KERNEL_NAME in _kernel_names(lower(graph).module)
    exe = compile_graph(graph, target=TARGET)
    for n in (1, 3):
        inputs = [(rng.standard_normal((n, 7, 77)) * 2 + 1).astype(np.float32)]
        np.testing.assert_allclose(exe(*inputs), kiln.ir.interpret(graph, inputs)[0], rtol=1e-5, atol=1e-5)
