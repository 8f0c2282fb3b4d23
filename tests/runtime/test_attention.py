"""Fused attention (`attention.py`, `attention_fusion.py`; issue 13: attention over 197 tokens behind onnxruntime):
the kernel over drawn geometries and layouts against float64 numpy (its bf16 pairs kernel against numpy with the
operands rounded as the kernel rounds them), an AVX2 build, which graphs the pass takes (and which it must leave
unfused), and whole programs against kiln's reference interpreter."""

from __future__ import annotations

import re
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import tvm
from cross_targets import AVX2
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from tvm import relax

import kiln
from kiln import nn
from kiln.ir import Builder, Graph, verify
from kiln.runtime.tvm.amx import KERNEL_NAME as AMX_KERNEL_NAME
from kiln.runtime.tvm.amx import bf16_products
from kiln.runtime.tvm.attention import KERNEL_NAME, Attention, Layout, attention_kernel
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.cpu import CPUModel, cpu_model
from kiln.runtime.tvm.dot_bf16 import DOT_KERNEL_NAME
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_fusion_passes
from kiln.runtime.tvm.target import cpu_target

TARGET = cpu_target()
MODEL = cpu_model(TARGET)
PAIRS = Attention(1, 16, 16, 32, 16, 1.0).takes_pairs(MODEL)
NO_PAIRS = "this CPU has no 512-bit vdpbf16ps (AVX512-BF16): bf16 builds use the f32 attention kernel"
pytestmark = pytest.mark.usefixtures("module_cache")


def _scores(q: np.ndarray, k: np.ndarray, scale: float) -> np.ndarray:
    return np.einsum("bhmd,bhnd->bhmn", q.astype(np.float64), k.astype(np.float64)) * scale


def _oracle(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """softmax(scale q kᵀ) v in float64 over [batch, heads, seq, d] operands."""
    s = _scores(q, k, scale)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhmn,bhnd->bhmd", e / e.sum(axis=-1, keepdims=True), v.astype(np.float64))


def _check(got: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> None:
    """Within float32's error: a score's rounding (about 1e-7 of the largest score's size) moves a weight by as much
    relative, so the absolute bound grows with the largest |score|."""
    bound = 2e-6 * (1 + np.abs(_scores(q, k, scale)).max()) * np.abs(v).max()
    np.testing.assert_allclose(got, _oracle(q, k, v, scale), rtol=2e-5, atol=bound)


def _run(spec: Attention, q: np.ndarray, k: np.ndarray, v: np.ndarray, target: tvm.target.Target = TARGET,
         model: CPUModel = MODEL) -> np.ndarray:
    """`attention_kernel(spec)` built for `target` and run on [batch, heads, seq, d] operands, each moved to its
    layout; the result back in [batch, heads, m, dv]."""
    def moved(x: np.ndarray, layout: Layout) -> np.ndarray:
        x = np.ascontiguousarray(x.transpose(0, 2, 1, 3)) if layout.seq_first else x
        return x.reshape(*x.shape[:2], -1) if layout.folded else x

    ql, kl, vl, ol = spec.layouts
    batch, heads = q.shape[:2]
    out = tvm.runtime.tensor(np.zeros(ol.dims(batch, heads, spec.m, spec.dv), np.float32))
    func = attention_kernel(spec, model).with_attr("global_symbol", "main")
    library = cpu_compile(tvm.IRModule({"main": func}), target, "default").jit()
    library["main"](*(tvm.runtime.tensor(moved(x, lay)) for x, lay in ((q, ql), (k, kl), (v, vl))), out)
    result = out.numpy().reshape(batch, spec.m, heads, spec.dv) if ol.folded else out.numpy()
    return result.transpose(0, 2, 1, 3) if ol.seq_first else result


def _layouts(drawn: int) -> tuple[Layout, ...]:
    """Each operand's and the result's layout from one base-3 digit of `drawn`: heads first, seq first, folded."""
    return tuple(Layout(drawn // 3 ** i % 3 > 0, drawn // 3 ** i % 3 == 2) for i in range(4))


def _operands(batch: int, heads: int, m: int, n: int, d: int, dv: int, spread: float, seed: int
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = (((batch, heads, m, d), spread), ((batch, heads, n, d), 1.0), ((batch, heads, n, dv), 1.0))
    return tuple((rng.standard_normal(s) * w).astype(np.float32) for s, w in shapes)


# no shrinking: each step is a build
@settings(max_examples=40, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), m=st.one_of(st.integers(1, 40), st.just(197)),
       n=st.one_of(st.integers(1, 70), st.sampled_from([197, 300])), d=st.integers(1, 80),
       dv=st.one_of(st.integers(1, 40), st.just(64)), layouts=st.integers(0, 80),
       scale=st.sampled_from([0.125, 1.0, 3.0]), spread=st.sampled_from([0.3, 4.0]))
def test_drawn_geometries_match_float64(batch: int, heads: int, m: int, n: int, d: int, dv: int, layouts: int,
                                        scale: float, spread: float) -> None:
    """Queries from one row to more than a block (the last block moved back), keys and value widths that no vector
    divides (1, 5, 197: the last vector and tile moved back), a batch and heads too few for the cores (a head's
    blocks split into parts), each operand and the result in any layout."""
    spec = Attention(heads, m, n, d, dv, scale, _layouts(layouts))
    q, k, v = _operands(batch, heads, m, n, d, dv, spread, seed=m * n + d)
    _check(_run(spec, q, k, v), q, k, v, scale)


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


@pytest.mark.skipif(not PAIRS, reason=NO_PAIRS)
@settings(max_examples=25, deadline=None, derandomize=True, database=None, phases=[Phase.generate])
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), m=st.one_of(st.integers(1, 40), st.just(197)),
       n=st.one_of(st.integers(16, 70), st.sampled_from([197, 300])),
       d=st.one_of(st.integers(16, 40).map(lambda h: 2 * h), st.just(128)),
       dv=st.one_of(st.integers(16, 40), st.just(64)), layouts=st.integers(0, 80), spread=st.sampled_from([0.3, 4.0]))
def test_the_pairs_kernel_is_float32_but_for_its_roundings(batch: int, heads: int, m: int, n: int, d: int, dv: int,
                                                           layouts: int, spread: float) -> None:
    """The bf16 pairs kernel over drawn geometries (odd keys: the last pair of weights and of v's rows half zeros;
    d not a multiple of 32: its last conversion moved back) against float64 with q, k and v rounded to bf16 as the
    kernel rounds them: what is left is the weights' rounding, each within 2^-8 of itself, so the context within
    2^-8 of the largest |v| beyond f32's bound."""
    spec = Attention(heads, m, n, d, dv, 0.125, _layouts(layouts), pairs=True)
    assert spec.takes_pairs(MODEL)
    q, k, v = _operands(batch, heads, m, n, d, dv, spread, seed=m * n + d)
    got = _run(spec, q, k, v)
    q, k, v = _bf16(q), _bf16(k), _bf16(v)
    bound = 2 ** -8 * np.abs(v).max() + 2e-6 * (1 + np.abs(_scores(q, k, 0.125)).max()) * np.abs(v).max()
    np.testing.assert_allclose(got, _oracle(q, k, v, 0.125), rtol=0, atol=bound)


def test_which_geometries_the_pairs_kernel_takes() -> None:
    """Whole pairs of d, at least 32 of them to round at once, and keys and values a vector wide, on a CPU with
    512-bit `vdpbf16ps`: never on an AVX2 build."""
    assert Attention(12, 197, 197, 64, 64, 0.125).takes_pairs(MODEL) == PAIRS
    for m, n, d, dv in ((197, 197, 63, 64), (197, 197, 16, 64), (8, 15, 64, 64), (8, 16, 64, 15)):
        assert not Attention(1, m, n, d, dv, 1.0).takes_pairs(MODEL), (m, n, d, dv)
    assert not Attention(12, 197, 197, 64, 64, 0.125).takes_pairs(cpu_model(AVX2))


def test_an_avx2_build_matches_float64() -> None:
    """The kernel cross-built for AVX2 (8 lanes, 16 registers: its own row blocks), run on this host."""
    avx2 = cpu_model(AVX2)
    for m, n, d in ((197, 197, 64), (7, 77, 24)):
        q, k, v = _operands(2, 3, m, n, d, d, 2.0, seed=n)
        spec = Attention(3, m, n, d, d, 0.125, (Layout(True), Layout(), Layout(True), Layout()))
        _check(_run(spec, q, k, v, AVX2, avx2), q, k, v, 0.125)


def test_tasks_divide_by_constants_only() -> None:
    """Every division and remainder in the kernel is by a constant, the batch symbolic or not: a task finds its
    batch row, head and part of the row blocks from static counts (a division by a symbolic count made TVM's
    LowerIntrin take 2 s of a 3 s build)."""
    for heads in (1, 12):
        text = attention_kernel(Attention(heads, 197, 197, 64, 64, 0.125, (Layout(True),) * 4), MODEL).script()
        divisors = re.findall(r" (?://|%) (T\.int64\(\d+\)|[\w.]+)", text)
        assert divisors and all(re.fullmatch(r"T\.int64\(\d+\)|\d+", d) for d in divisors), divisors


def test_a_chunk_of_blocks_is_what_fits_half_of_l2() -> None:
    """All of a head's row blocks at once where their scores and kᵀ fit half of L2 (197 keys), fewer where they do
    not (1024 keys: some), and no fusion where kᵀ and one block do not fit (4096 keys of 64)."""
    short, long = Attention(8, 197, 197, 64, 64, 1.0), Attention(8, 1024, 1024, 64, 64, 1.0)
    assert short.chunk_blocks(MODEL) == -(-197 // short.block_rows(MODEL))
    rows = long.block_rows(MODEL)
    assert 1 <= long.chunk_blocks(MODEL) < -(-1024 // rows)
    assert 4 * (64 + long.chunk_blocks(MODEL) * rows) * 1024 <= MODEL.caches.l2 // 2
    assert not Attention(8, 4096, 4096, 64, 64, 1.0).fits(MODEL)


def attention_graph(shape: tuple, scale: str = "mul", reuse_weights: bool = False,
                    mask: np.ndarray | tuple | None = None) -> Graph:
    """softmax(x xᵀ · s) x (the score scale as a multiply by 1/8, a divide by 8 or none), over `shape` (None: a
    dynamic batch); `reuse_weights` also returns the weights; `mask` is added to the scores (before them): a
    constant array, or the shape of a second input."""
    b = Builder("Attention")
    x = b.input("x", (shape, "f32"))
    perm = (*range(len(shape) - 2), len(shape) - 1, len(shape) - 2)
    scores = b.matmul(x, b.transpose(x, perm=perm))
    if scale == "mul":
        scores = b.mul(scores, b.constant(np.float32(0.125)))
    elif scale == "div":
        scores = b.div(scores, b.constant(np.float32(8.0)))
    if mask is not None:
        scores = b.add(b.constant(mask) if isinstance(mask, np.ndarray) else b.input("mask", (mask, "f32")), scores)
    weights = b.softmax(scores)
    context = b.matmul(weights, x)
    if reuse_weights:
        b.ret(context, weights)
    else:
        b.ret(context)
    return verify(b.build())


def fused_module(graph: Graph, precision: str = "f32") -> tvm.IRModule:
    """The graph's module after kiln's CPU fusion passes."""
    module = lower(graph, "bound", None, precision, TARGET).module
    with TARGET:
        return tvm.transform.Sequential(cpu_fusion_passes(TARGET, precision=precision))(module)


def fused_calls(graph: Graph, precision: str = "f32") -> list[str]:
    """The `R.call_tir` lines of the graph's functions after kiln's CPU fusion passes."""
    return [line for _, f in fused_module(graph, precision).functions_items() if isinstance(f, relax.Function)
            for line in str(f).splitlines() if "R.call_tir(" in line]


def _callees(calls: list[str]) -> list[str]:
    return [c.split("R.call_tir(")[1].split(",")[0].removeprefix("cls.") for c in calls]


def _check_program(graph: Graph, batches: tuple[int, ...] = (0,), precision: str = "f32", spread: float = 2.0,
                   bound: Callable[[np.ndarray], float] | None = None) -> None:
    """One build against kiln's interpreter (at each batch where the first dim is dynamic), inputs drawn with
    deviation `spread`; within f32's error, or within bound(first input) absolute where it is given."""
    exe = compile_graph(graph, target=TARGET, precision=precision)
    for batch in batches:
        rng = np.random.default_rng(batch)
        inputs = [(rng.standard_normal([batch if d is None else d for d in a.type.shape]) * spread).astype(np.float32)
                  for a in graph.functions["forward"].args]
        got, want = exe(*inputs), kiln.ir.interpret(graph, inputs)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want, strict=True):
            if bound is None:
                np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
            else:
                np.testing.assert_allclose(g, w, rtol=0, atol=bound(inputs[0]))


@pytest.mark.parametrize("scale", ["mul", "div", "none"])
def test_the_pass_takes_the_scores_scale_and_matches_the_interpreter(scale: str) -> None:
    """softmax(x xᵀ / 8) x over [2, 3, 197, 64] as one kernel (no product, pack or softmax kernel left), whichever
    way the scale is written, against the interpreter."""
    graph = attention_graph((2, 3, 197, 64), scale)
    assert _callees(fused_calls(graph)) == [KERNEL_NAME]
    _check_program(graph)


def test_a_single_head_and_a_dynamic_batch_are_taken() -> None:
    """Rank 3 ([batch, seq, d]: viewed as one batch of heads) over a dynamic batch, at batch 1 and 4."""
    graph = attention_graph((None, 50, 32))
    assert KERNEL_NAME in _callees(fused_calls(graph))
    _check_program(graph, batches=(1, 4))


_CAUSAL = np.triu(np.full((40, 40), -1e9, np.float32), 1)


@pytest.mark.parametrize(("mask", "batches"), [
    (np.linspace(-1, 0, 40, dtype=np.float32), (0,)),  # one row for every head and query
    (_CAUSAL, (0,)),  # [m, n]: a causal mask
    ((None, 1, 1, 40), (1, 3)),  # BERT's attention mask: an input, per batch row, over a dynamic batch
    ((1, 2, 40, 40), (0,)),  # per head and query
], ids=["keys", "causal", "batch input", "heads"])
def test_an_added_mask_is_taken_in(mask: np.ndarray | tuple, batches: tuple[int, ...]) -> None:
    """softmax(x xᵀ / 8 + mask) x as the one kernel, the mask added as each score is stored, whichever of its
    batch, head and query dims it broadcasts; against the interpreter (a dynamic batch at 1 and 3)."""
    graph = attention_graph((None if isinstance(mask, tuple) and mask[0] is None else 2, 2, 40, 16), mask=mask)
    assert _callees(fused_calls(graph)) == [KERNEL_NAME]
    _check_program(graph, batches)


@pytest.mark.parametrize("case", ["weights returned", "keys past L2"])
def test_what_the_pass_leaves_unfused_still_matches(case: str) -> None:
    """Weights used again (fusing would compute the products twice) and keys whose kᵀ does not fit half of L2
    keep the unfused kernels, and match the interpreter."""
    shape = (1, 2, 4096, 64) if case == "keys past L2" else (2, 2, 40, 16)
    graph = attention_graph(shape, reuse_weights=case == "weights returned")
    assert KERNEL_NAME not in _callees(fused_calls(graph))
    if case != "keys past L2":
        _check_program(graph)


def _bf16_attention_bound(x: np.ndarray) -> float:
    """How far a bf16 build's softmax(x xᵀ / 8) x may be from float64's: each score off by the dot bound
    (docs/precision.md, 2^-7 of its sum of |products|), which moves each weight by at most twice the largest such
    error relative, and the weights and x rounded (2^-8 each), all against the largest |x|."""
    x = x.astype(np.float64)
    score_error = 2 ** -7 * (np.abs(x) @ np.swapaxes(np.abs(x), -1, -2)).max() / 8
    return (2 * score_error + 2 ** -7) * np.abs(x).max()


def _kernel_text(graph: Graph, precision: str) -> str:
    """The attention kernel's TIR in the graph's fused module."""
    module = fused_module(graph, precision)
    return next(f.script() for gv, f in module.functions_items() if gv.name_hint == KERNEL_NAME)


@pytest.mark.skipif(not bf16_products(TARGET), reason="this CPU has no bf16 product kernel (AVX512-BF16 or AMX)")
def test_a_bf16_build_fuses_attention_and_keeps_bf16_for_other_products() -> None:
    """In a bf16 build the lowering leaves attention's products in f32 for the fused kernel: its bf16 pairs kernel
    where the CPU has `vdpbf16ps` and d is 64 (within the bf16 bound; BERT's mask over a dynamic batch too), its f32
    kernel where d is 16 (f32's error);
    a product of two activations that is no attention's (the weights returned too) is still the bf16 product
    kernel."""
    wide, narrow = attention_graph((2, 2, 40, 64)), attention_graph((2, 2, 40, 16))
    for graph, pairs in ((wide, PAIRS), (narrow, False)):
        assert _callees(fused_calls(graph, "bf16")) == [KERNEL_NAME]
        assert ("kiln_dpbf16ps" in _kernel_text(graph, "bf16")) == pairs
    _check_program(wide, precision="bf16", spread=0.5, bound=_bf16_attention_bound)
    _check_program(narrow, precision="bf16")
    masked = attention_graph((None, 2, 40, 64), mask=(None, 1, 1, 40))  # BERT's mask, over a dynamic batch
    assert ("kiln_dpbf16ps" in _kernel_text(masked, "bf16")) == PAIRS
    _check_program(masked, (1, 3), precision="bf16", spread=0.5, bound=_bf16_attention_bound)
    unfused = attention_graph((2, 2, 40, 16), reuse_weights=True)
    callees = _callees(fused_calls(unfused, "bf16"))
    assert KERNEL_NAME not in callees and sum(DOT_KERNEL_NAME in c or AMX_KERNEL_NAME in c for c in callees) == 2


def test_a_multi_head_layer_reads_its_projections_and_writes_the_context_in_place() -> None:
    """nn.MultiHeadAttention over [2, 197, 48] (4 heads of 12): the kernel reads q, k and v as the projections'
    [batch, seq, heads x d] results themselves and writes the context as the output projection reads it, so no
    kernel moves a head split (in bf16 too, whose projections' bias adds then stay in [batch, seq, 48]); the layer
    against the interpreter."""
    layer = nn.MultiHeadAttention(48, 4, dropout=0.0).valid()
    graph = kiln.trace(layer, ((2, 197, 48), "f32"))
    for precision in ("f32", *(["bf16"] if bf16_products(TARGET) else [])):
        calls = fused_calls(graph, precision)
        made = {c.split("=")[0].strip(): c.partition("out_ty=")[2] for c in calls}
        attention = [c for c in calls if _callees([c]) == [KERNEL_NAME]]
        assert len(attention) == 1 and "out_ty=R.Tensor((2, 197, 4, 12)" in attention[0], calls
        operands = attention[0].split("R.call_tir(")[1].split("(")[1].split(")")[0].split(", ")
        assert all(made[name].startswith("R.Tensor((2, 197, 48)") for name in operands), (operands, calls)
        assert not [c for c in calls if re.search(r"out_ty=R\.Tensor\(\(2, 4, 197, 12\)", c)], calls
    _check_program(graph)
