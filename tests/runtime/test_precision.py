"""Precision modes (issue 13, "Precision modes for deployment"): `kiln.compile(..., precision="bf16"|"int8")`.

Numbers against a float64 numpy oracle within the bounds docs/precision.md states, on odd extents (M = 1 and 7,
N = 77, K = 1000); each bound is also checked to be tighter than f32's error would allow being exceeded, so a build
that silently stayed in f32 (or silently left it) fails.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import tvm
from test_quant_matmul import dense_weights  # the "no float [K, N] anywhere" structure check, shared
from tvm import relax, tirx
from tvm.target import Target

import kiln
from kiln import nn
from kiln.cli import main as cli_main
from kiln.frontend.reparam import Quantizer, QuantScheme
from kiln.ir import Builder, Graph, KilnError, PrecisionWarning, verify
from kiln.ir.interpreter import param_value
from kiln.runtime.tvm.amx import bf16_products, has_tiles, padded
from kiln.runtime.tvm.compile import cache_key, compile_graph
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.lowp import resolve_precision
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.target import cpu_target

K, N = 1000, 77
U = 2.0 ** -24  # f32 unit roundoff
AVX2 = Target({"kind": "llvm", "mcpu": "haswell"})  # no AVX512-BF16 on any CPU that runs these tests' builds


pytestmark = pytest.mark.usefixtures("module_cache")  # a scratch cache; a failing schedule rule fails the test


def bf16_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """docs/precision.md: |y - x.w| <= (2^-7 + 2^-16 + gamma_K) * sum_k |x_k w_k| for bf16 operands (each rounded to
    nearest, relative error 2^-8) and f32 sums over K terms (gamma_K = K u / (1 - K u))."""
    depth = x.shape[-1]
    gamma = depth * U / (1 - depth * U)
    return (2.0 ** -7 + 2.0 ** -16 + gamma) * (np.abs(x) @ np.abs(w))


def matmul_graph(w: np.ndarray, rank: int = 2) -> Graph:
    b = Builder("mm")
    x = b.input("x", ((None,) * (rank - 1) + (w.shape[0],), "f32"))
    b.ret(b.matmul(x, b.param("w", w.shape, data=w)))
    return verify(b.build())


@pytest.fixture(scope="module")
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((K, N)).astype(np.float32)


@pytest.fixture(scope="module")
def bf16_program(weight: np.ndarray) -> tuple[object, np.ndarray]:
    """One emulated-bf16 build of x @ W (W bound), a batch of activation products and a bound conv2d."""
    # 16 input channels: a conv bf16 computes on every CPU (an RGB input's stays f32 where `vdpbf16ps` is, conv_bf16.py)
    kernel = np.random.default_rng(3).standard_normal((8, 16, 3, 3)).astype(np.float32)
    b = Builder("bf16")
    x = b.input("x", ((None, K), "f32"))
    a = b.input("a", ((3, 7, 64), "f32"))
    c = b.input("c", ((3, 64, 5), "f32"))
    img = b.input("img", ((1, 16, 9, 9), "f32"))
    b.ret(b.matmul(x, b.param("w", weight.shape, data=weight)), b.matmul(a, c),
          b.conv2d(img, b.param("k", kernel.shape, data=kernel), padding=(1, 1)))
    return kiln.compile(verify(b.build()), precision="bf16!"), kernel


def _run_bf16(program, rows: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(rows)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(rows, K), (3, 7, 64), (3, 64, 5), (1, 16, 9, 9)]]
    return inputs, list(program(*inputs))


@pytest.mark.parametrize("rows", [1, 7])
def test_bf16_matmul_is_within_the_documented_bound(bf16_program, weight: np.ndarray, rows: int) -> None:
    """Issue 13: "matmul/conv in bf16 with f32 accumulation ... documented error bound": against float64, every
    element within the bound, and the error is bf16's (well above what an f32 product would make)."""
    (x, *_), (y, *_) = _run_bf16(bf16_program[0], rows)
    exact = x.astype(np.float64) @ weight.astype(np.float64)
    err = np.abs(y - exact)
    assert np.all(err <= bf16_bound(x.astype(np.float64), weight.astype(np.float64)))
    assert err.max() > 2.0 ** -16 * (np.abs(x) @ np.abs(weight)).max()  # bf16's error, far above an f32 build's


def test_bf16_batched_matmul_and_conv_are_within_the_bound(bf16_program) -> None:
    """"matmul/conv (dense and batch) read bf16 operands": a batch of activation x activation products (as in
    attention) and a conv2d, against float64 torch."""
    program, w = bf16_program
    (_, xa, xc, xi), (_, y, z) = _run_bf16(program, 1)
    assert np.all(np.abs(y - xa.astype(np.float64) @ xc) <= bf16_bound(xa.astype(np.float64), xc.astype(np.float64)))
    assert np.abs(y - xa.astype(np.float64) @ xc).max() > 1e-4  # bf16, not f32
    t = lambda v: torch.from_numpy(v.astype(np.float64))  # noqa: E731
    exact = torch.nn.functional.conv2d(t(xi), t(w), padding=1).numpy()
    terms = torch.nn.functional.conv2d(t(np.abs(xi)), t(np.abs(w)), padding=1).numpy()  # sum_k |x_k w_k|
    assert np.all(np.abs(z - exact) <= bf16_bound(np.ones((1, 144)), np.ones((144, 1)))[0, 0] / 144 * terms)
    assert np.abs(z - exact).max() > 1e-4


def test_bf16_without_bf16_hardware_is_f32_with_one_notice(weight: np.ndarray) -> None:
    """"On a CPU without bf16 support, precision="bf16" falls back to f32 with a one-line notice (once)"."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert resolve_precision("bf16", AVX2) == "f32"
        assert resolve_precision("bf16", AVX2) == "f32"
        assert resolve_precision("bf16!", AVX2) == "bf16"
    notices = [w for w in seen if issubclass(w.category, PrecisionWarning)]
    assert len(notices) <= 1 and all("\n" not in str(w.message) for w in notices)
    assert resolve_precision("bf16", Target({"kind": "llvm", "mcpu": "sapphirerapids"})) == "bf16"


def test_precision_joins_the_cache_key(weight: np.ndarray) -> None:
    """Builds in different precisions are different programs, so they never share a cache entry."""
    g, tgt = matmul_graph(weight), cpu_target()
    keys = {cache_key(g, ("forward",), tgt, "bound", True, None, p) for p in ("f32", "bf16", "int8")}
    assert len(keys) == 3
    assert cache_key(g, ("forward",), tgt, "bound", True, None, "f32") == cache_key(g, ("forward",), tgt, "bound", True)


@pytest.mark.parametrize(("precision", "target", "message"), [
    ("fp8", "llvm", "precision must be one of f32, bf16, bf16!, int8, not 'fp8'"),
    ("int8", "cuda", "precision 'int8' is for CPU (llvm) targets, not cuda"),
])
def test_a_bad_precision_is_one_kiln_error(weight: np.ndarray, precision: str, target: str, message: str) -> None:
    with pytest.raises(KilnError, match=f"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        compile_graph(matmul_graph(weight), precision=precision, target=target)


SCHEMES = {"tensor": (), "channel": (K, 1), "tiles": (200, 7)}  # one scale; one per column; K and N blocks


class Schemes(kiln.Module):
    """One Linear per Q8 scheme over the same input, so one build covers them all."""

    def __init__(self) -> None:
        self.fcs = [nn.Linear(K, N) for _ in SCHEMES]

    def forward(self, x: kiln.Tensor) -> tuple[kiln.Tensor, ...]:
        return tuple(fc(x) for fc in self.fcs)


@pytest.fixture(scope="module")
def q8_model() -> kiln.Module:
    kiln.seed(1)
    model = Schemes().valid()
    for i, block in enumerate(SCHEMES.values()):
        model = model.quantize_weights_group(Quantizer(scheme=QuantScheme("q8s", block)),
                                             kiln.ParamGroup.from_glob(f"fcs.{i}.weight"))
    return model


def decoded(graph: Graph, i: int, block: tuple[int, ...]) -> np.ndarray:
    """The weight the Q8 codes stand for, from codes and scales in numpy (Burn's q8s: code * block scale)."""
    codes = np.asarray(graph.params[f"fcs.{i}.weight.codes"].data, np.float64)
    scales = np.asarray(graph.params[f"fcs.{i}.weight.scales"].data, np.float64)
    if not block:
        return codes * scales.reshape(())
    return codes * np.repeat(np.repeat(scales, block[0], 0), block[1], 1)


@pytest.mark.parametrize("rows", [1, 7])
def test_int8_matmul_is_within_the_activation_rounding_bound(q8_model: kiln.Module, rows: int) -> None:
    """Issue 13: "int8: weights quantized by quantize_weights (Q8 per-channel/per-block) run as int8 matmuls with
    int32 accumulation": against float64 x @ W (W the decoded codes), each output within what rounding the row's
    activations to 1/127 of their peak can change, 0.5 * s_i * sum_k |W_kj| (plus f32 slack)."""
    graph = kiln.trace(q8_model, ((None, K), "f32"))
    vm = q8_build(q8_model)[2]
    outputs = vm["forward"](tvm.runtime.tensor(x := np.random.default_rng(rows).standard_normal((rows, K)).astype(
        np.float32)))
    step = np.abs(x).max(axis=1, keepdims=True) / 127
    for i, (scheme, block) in enumerate(SCHEMES.items()):
        w = decoded(graph, i, block)
        exact = x.astype(np.float64) @ w + param_value(graph.params[f"fcs.{i}.bias"])
        bound = 0.5 * step * np.abs(w).sum(axis=0) + 1e-5 * np.abs(x) @ np.abs(w)
        err = np.abs(outputs[i].numpy() - exact)
        assert np.all(err <= bound), f"{scheme} rows={rows}: {(err / bound).max():.3f} of the bound"
        assert err.max() > 1e-4, scheme  # the activations were rounded to int8: not the f32 decoding kernel


def _kernels(graph: Graph, precision: str) -> tuple[relax.Function, dict[str, tirx.PrimFunc],
                                                   relax.VirtualMachine]:
    """The Relax function and kernels of a bound build as the schedule rules receive them, and the built program."""
    seen: list[tvm.IRModule] = []

    @tvm.transform.module_pass(opt_level=0, name="Capture")
    def capture(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        seen.append(tvm.IRModule(dict(mod.functions_items())))
        return mod

    target = cpu_target()
    library = cpu_compile(lower(graph, "bound", None, precision, target).module, target,
                          cpu_pipeline(target, True, [capture]))
    kernels = {gv.name_hint: f for gv, f in seen[0].functions_items() if isinstance(f, tirx.PrimFunc)}
    fn = next(f for _, f in seen[0].functions_items() if isinstance(f, relax.Function))
    return fn, kernels, relax.VirtualMachine(library, tvm.cpu())


_q8_builds: dict[int, tuple[relax.Function, dict[str, tirx.PrimFunc], relax.VirtualMachine]] = {}


def q8_build(model: kiln.Module) -> tuple[relax.Function, dict[str, tirx.PrimFunc], relax.VirtualMachine]:
    """One int8 build of the Q8 model serves the numbers and the structure tests."""
    if id(model) not in _q8_builds:
        _q8_builds[id(model)] = _kernels(kiln.trace(model, ((None, K), "f32")), "int8")
    return _q8_builds[id(model)]


def test_int8_builds_no_float_copy_of_the_weight(q8_model: kiln.Module) -> None:
    """"no dense float weight materialized per call": no float [K, N] value or buffer in the bound build, and
    the products read the int8 codes into int32 sums."""
    fn, kernels, _ = q8_build(q8_model)
    assert dense_weights(fn, kernels, {(K, N), (N, K)}) == []
    products = [name for name, f in kernels.items() if '"int8"' in f.script() and '"int32"' in f.script()]
    calls = sum(fn.script().count(f"call_tir({name},") for name in products)  # same-shape products share one
    assert calls >= len(SCHEMES)


def test_the_weight_of_a_bf16_build_is_cast_once(weight: np.ndarray) -> None:
    """"weights converted once at bind time": the product reads a bf16 [K, N] constant, and no kernel casts an
    f32 [K, N] tensor per call."""
    _, kernels, _ = _kernels(matmul_graph(weight), "bf16")
    scripts = {name: f.script() for name, f in kernels.items()}
    shape = f"(T.int64({K}), T.int64({N}))"
    read = f'{shape}, "bfloat16"'
    if bf16_products(cpu_target()):  # packed at build time: [Np / 16, Kp / 2, 16] bf16 pairs
        _, kp, np_ = padded(tirx.IntImm("int64", 1), K, N, has_tiles(cpu_target()))
        read = f'{np_ // 16}, {kp // 2}, 16), "uint32"'
    assert any(read in s and "matmul" in name for name, s in scripts.items())
    assert not any(f'{shape}, "float32"' in s for s in scripts.values())


def test_kiln_compile_takes_precision(tmp_path, capsys: pytest.CaptureFixture) -> None:
    """`kiln compile --precision` is the same option: an unknown mode is one error line (exit 1), before any build."""
    src = tmp_path / "mm.kir"
    src.write_text(str(matmul_graph(np.ones((4, 3), np.float32))))
    assert cli_main(["compile", str(src), "-o", str(tmp_path / "mm.so"), "--precision", "fp8"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "precision must be one of f32, bf16, bf16!, int8, not 'fp8'" in err
    assert not (tmp_path / "mm.so").exists()
