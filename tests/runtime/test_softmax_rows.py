"""Fast-math softmax over the last axis as one hand-written kernel (`softmax_rows.py`; issue 13: attention over 197
tokens behind onnxruntime): its exp against float64 math, drawn rows of every width against a float64 numpy
oracle, the last vector overlapping instead of guarded, one division a row, which softmaxes the rewrite takes, and
whole programs (attention's score scale, a dynamic batch) against kiln's interpreter."""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from cross_targets import AVX2, AVX512
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tvm import relax
from tvm.script import tirx as T

import kiln
from kiln.ir import Builder
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes
from kiln.runtime.tvm.row_vectors import at
from kiln.runtime.tvm.softmax_rows import KERNEL_NAME, ROW_CHAINS, exp_nonpositive, softmax_rows_kernel
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
LANES = cpu_model(TARGET).lanes()
pytestmark = pytest.mark.usefixtures("module_cache")


def _library(func: tvm.tirx.PrimFunc, target: tvm.target.Target = TARGET) -> tvm.runtime.Executable:
    return cpu_compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target, "default")


def _softmax(x: np.ndarray, width: int, lanes: int, scale: float) -> np.ndarray:
    """`softmax_rows_kernel` built and run on `x`'s rows."""
    rows = x.reshape(-1, width)
    out = tvm.runtime.tensor(np.zeros_like(rows))
    _library(softmax_rows_kernel(width, lanes, scale)).jit()["main"](tvm.runtime.tensor(rows), out)
    return out.numpy().reshape(x.shape)


def _oracle(x: np.ndarray, scale: float) -> np.ndarray:
    z = x.astype(np.float64) * scale
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _check(got: np.ndarray, want: np.ndarray) -> None:
    """Within 2e-6 of each probability and 1e-7 absolute (the probabilities near 0)."""
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)


def _kernel_names(mod: tvm.IRModule) -> list[str]:
    with TARGET:
        fused = tvm.transform.Sequential(cpu_fusion_passes(TARGET, fast_math=True))(mod)
    return [gv.name_hint for gv, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize("lanes", [16, 8, 1], ids=["avx512-scalef", "vector", "scalar"])
def test_exp_is_within_4e_7_of_float64_down_to_the_least_normal(lanes: int) -> None:
    """exp over [-87.3, 0] within 4e-7 relative of float64's; below, the least normal float32 or less (no garbage
    exponent), never negative: AVX-512's 16 lanes scale by `vscalefps`, 8 lanes and a scalar build the exponent."""
    if lanes > LANES:
        pytest.skip("this host runs no AVX-512 code")
    n = 1 << 16

    @T.prim_func(private=True, check_well_formed=False)
    def table(t: T.Buffer((n,), "float32"), out: T.Buffer((n,), "float32")):
        T.func_attr({"tirx.is_scheduled": True})
        for v in range(n // lanes):
            out[at(v * lanes, lanes)] = exp_nonpositive(t[at(v * lanes, lanes)], lanes)

    t = np.concatenate([-np.linspace(0, 87.3, n - 256), -np.linspace(87.34, 120, 256)]).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(n, np.float32))
    _library(table).jit()["main"](tvm.runtime.tensor(t), out)
    got, want = out.numpy().astype(np.float64), np.exp(t.astype(np.float64))
    normal = t >= -87.3
    assert np.abs(got[normal] / want[normal] - 1).max() < 4e-7
    assert (got[~normal] >= 0).all() and (got[~normal] <= np.finfo(np.float32).tiny * 1.0001).all()


# no shrinking: each step is a build
@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
@given(width=st.one_of(st.integers(1, 300), st.sampled_from([1000, 4097])), rows=st.integers(1, 9),
       scale=st.sampled_from([1.0, 0.125, 3.0]), spread=st.sampled_from([0.1, 4.0, 30.0]))
def test_rows_of_drawn_widths_match_numpy(width: int, rows: int, scale: float, spread: float) -> None:
    """Every width from one element to more than a vector (one vector, a vector and one, 197, 1000, 4097: no vector
    divides them), scaled inside the exp, against float64 numpy."""
    x = (np.random.default_rng(width * rows).standard_normal((rows, width)) * spread).astype(np.float32)
    _check(_softmax(x, width, LANES, scale), _oracle(x, scale))


def test_an_avx2_build_matches_numpy() -> None:
    """The kernel cross-built for AVX2 (8 lanes) over rows of 197 and 77, run on this host."""
    for width in (197, 77, 5):
        x = (np.random.default_rng(width).standard_normal((6, width)) * 4).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros_like(x))
        _library(softmax_rows_kernel(width, 8, 0.125), AVX2).jit()["main"](tvm.runtime.tensor(x), out)
        _check(out.numpy(), _oracle(x, 0.125))


@pytest.mark.parametrize(("width", "overlap"), [(197, True), (208, False)], ids=["197", "208"])
def test_the_last_vector_overlaps_and_no_lane_is_guarded(width: int, overlap: bool) -> None:
    """A row of 197 is 12 whole 16-lane vectors and one from element 181: no guarded load or store, a select only
    in its sum (none where the vectors tile the row, 208), one division a row and no vector division or gather in
    the AVX-512 code."""
    kernel = softmax_rows_kernel(width, 16, 0.125)
    text = kernel.script()
    assert "if_then_else" not in text and "likely" not in text and "T.if " not in text
    assert text.count("T.Select(") == overlap and f"{width - 16}:{width}]" in text
    assert text.count(" / ") == 1
    assembly = _library(kernel, AVX512).mod.inspect_source("asm")
    assert "vgather" not in assembly and "vdivps" not in assembly and "vmaxps" in assembly
    assert "vscalefps" in assembly and "vpslld" not in assembly  # 2^k by scalef, not built in the exponent field


def test_the_rewrite_takes_last_axis_softmaxes_only() -> None:
    """A softmax over the last axis, its positive score scale taken in, runs as the kernel; one over a middle axis
    stays TVM's fast softmax under the row rules; both against float64 numpy."""
    x = (np.random.default_rng(0).standard_normal((2, 3, 77)) * 4).astype(np.float32)
    for axis, named in ((-1, True), (1, False)):
        mod = relax_module([x.shape], lambda v, a=axis: relax.op.nn.softmax(v * relax.const(0.125, "float32"), a))
        assert (KERNEL_NAME in _kernel_names(mod)) == named
        exe = cpu_compile(mod, TARGET)
        got = relax.VirtualMachine(exe, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
        z = np.moveaxis(x, axis, -1)
        np.testing.assert_allclose(got, np.moveaxis(_oracle(z, 0.125), -1, axis), rtol=3e-6, atol=1e-7)


def test_attention_scores_over_a_dynamic_batch_match_the_interpreter() -> None:
    """softmax(s / 8) over [batch, 4, 197] (the rows a view of [batch x 4, 197]): one build, the kernel, equal to
    kiln's reference interpreter at batch 1 and 3."""
    b = Builder("Scores")
    s = b.input("s", ((None, 4, 197), "f32"))
    b.ret(b.softmax(b.mul(s, b.constant(np.float32(0.125)))))
    graph = b.build()
    assert KERNEL_NAME in _kernel_names(lower(graph).module)
    exe = compile_graph(graph, target=TARGET, fast_math=True)
    for n in (1, 3):
        inputs = [(np.random.default_rng(n).standard_normal((n, 4, 197)) * 8).astype(np.float32)]
        np.testing.assert_allclose(exe(*inputs), kiln.ir.interpret(graph, inputs)[0], rtol=3e-6, atol=1e-7)


@pytest.mark.parametrize(("width", "chains"), [(336, ROW_CHAINS), (77, ROW_CHAINS), (40, 3), (16, 1)])
def test_the_maximum_runs_in_chains_and_the_sum_in_the_exp_loop(width: int, chains: int) -> None:
    """A row's maximum is taken in `ROW_CHAINS` partial maxima (as many as the row has vectors, up to that), whose
    dependent maxima interleave; its exps are summed in the loop that stores them, not in a loop of its own."""
    text = softmax_rows_kernel(width, 16).script()
    before_exps = text[:text.index("top:")]
    assert len(set(re.findall(r"sums\[(\d+):\d+\] = ", before_exps))) == chains
    loops = re.split(r"\n\s+for ", text[text.index("top:"):])[1:]
    summing = [loop for loop in loops if re.search(r"sums\[0:16\] = sums\[[^\n]*\] \+ exps\[", loop)]
    assert len(summing) == 1 and "exps[v" in summing[0].split("\n")[1]
