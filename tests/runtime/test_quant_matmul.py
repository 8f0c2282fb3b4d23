"""A matmul of a dequantized weight builds to one kernel that decodes codes and scales in place (issue 11: "no dense
weight buffer per call or per step"), for inference and for the QLoRA training step's forward and `dy @ W^T`.

Structure: after fusion, no Relax value and no kernel buffer has the weight's float shape. Numbers: TVM against the
numpy interpreter (`kiln.ir.ops.quant`'s reference semantics), for every value kind, per tensor and per block.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import kiln
from kiln import nn, optim
from kiln.frontend.reparam import Lora, QLora, Quantizer, QuantScheme
from kiln.frontend.step import build_step
from kiln.ir import DType, Graph, TensorType, interpret, parse
from kiln.ir.ops.quant import VALUE_RANGES, quantize
from kiln.runtime.backend import using_backend
from kiln.runtime.tvm.backend import TVMBackend
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.schedules import CPUMatmul
from kiln.runtime.tvm.target import cpu_target

K, N = 64, 48
BLOCKS = {"tensor": (), "rows": (16,), "tiles": (16, 16)}  # per tensor; 16 outputs per scale; 16x16 tiles
CASES = [(value, block) for value in VALUE_RANGES for block in BLOCKS]
TARGET = cpu_target()


pytestmark = pytest.mark.usefixtures("module_cache")  # a scratch cache; a failing schedule rule fails the test


def _name(value: str, block: str) -> str:
    return f"w_{value}_{block}"


def quantized_graph() -> Graph:
    """One function multiplying x by every (value kind, block) weight, as matmul, as linear with a bias, and by the
    transpose (`y @ W^T`, the backward's product); then a rank-3 activation by a transpose and an f16 weight."""
    rng = np.random.default_rng(0)
    params, reparams, body, results = [], [], [], []
    for i, (value, block) in enumerate(CASES):
        w = _name(value, block)
        codes, scales = quantize(rng.standard_normal((K, N)).astype(np.float32), value, BLOCKS[block], "minmax")
        code_t = "i8" if codes.dtype == np.int8 and value[1] == "8" else "i4"
        shape = "x".join(map(str, scales.shape))
        params.append(f'param @{w}.codes : tensor<{K}x{N}x{code_t}> {{id = "0x{2 * i + 1:x}", data = dense<'
                      f'tensor<{K}x{N}x{code_t}>, [{", ".join(map(str, codes.ravel().tolist()))}]>}}')
        params.append(f'param @{w}.scales : tensor<{shape}xf32> {{id = "0x{2 * i + 2:x}", data = dense<'
                      f'tensor<{shape}xf32>, [{", ".join(repr(float(s)) for s in scales.ravel())}]>}}')
        attrs = f'value = "{value}"' + (f", block = [{', '.join(map(str, BLOCKS[block]))}]" if BLOCKS[block] else "")
        reparams.append(f"reparam @{w} : tensor<{K}x{N}xf32> = dequantize(@{w}.codes, @{w}.scales) {{{attrs}}}")
        body += [f"%m{i} = matmul %x, @{w} : tensor<?x{N}xf32>",
                 f"%l{i} = linear %x, @{w}, %bias : tensor<?x{N}xf32>",
                 f"%t{i} = transpose @{w} {{perm = [1, 0]}} : tensor<{N}x{K}xf32>",
                 f"%b{i} = matmul %y, %t{i} : tensor<?x{K}xf32>"]
        results += [f"%m{i}", f"%l{i}", f"%b{i}"]
    reparams.append(f'reparam @w16 : tensor<{K}x{N}xf16> = dequantize(@{_name(*CASES[1])}.codes, '
                    f'@{_name(*CASES[1])}.scales) {{value = "q8f", block = [16], dtype = f16}}')
    body += [f"%r = matmul %z, %t0 : tensor<3x?x{K}xf32>", f"%h16 = matmul %h, @w16 : tensor<?x{N}xf16>"]
    results += ["%r", "%h16"]
    types = ", ".join([f"tensor<?x{N}xf32>", f"tensor<?x{N}xf32>", f"tensor<?x{K}xf32>"] * len(CASES)
                      + [f"tensor<3x?x{K}xf32>", f"tensor<?x{N}xf16>"])
    lines = "\n    ".join(body)
    return parse(f"""module @Q {{
  {chr(10).join(params)}
  {chr(10).join(reparams)}
  func @forward(%x: tensor<?x{K}xf32>, %y: tensor<?x{N}xf32>, %bias: tensor<{N}xf32>, %z: tensor<3x?x{N}xf32>,
               %h: tensor<?x{K}xf16>) -> ({types}) {{
    {lines}
    return {", ".join(results)}
  }}
}}""")


@pytest.fixture(scope="module")
def graph() -> Graph:
    return quantized_graph()


def fused(graph: Graph, params: str) -> tuple[relax.Function, dict[str, tirx.PrimFunc]]:
    """The Relax function and the kernels the schedule rules receive (captured just before them)."""
    seen: list[tvm.IRModule] = []

    @tvm.transform.module_pass(opt_level=0, name="Capture")
    def capture(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        seen.append(tvm.IRModule(dict(mod.functions_items())))  # a copy: the rules update the module in place
        return mod

    cpu_compile(lower(graph, params).module, TARGET, cpu_pipeline(TARGET, True, [capture]))
    (mod,) = seen
    kernels = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}
    relax_fns = [f for _, f in mod.functions_items() if isinstance(f, relax.Function)]
    return relax_fns[0], kernels


def dense_weights(fn: relax.Function, kernels: dict[str, tirx.PrimFunc], shapes: set[tuple[int, int]]) -> list[str]:
    """Every Relax value and kernel buffer (argument or allocation) of a float dtype and one of `shapes`."""
    found = []
    for block in fn.body.blocks:
        for binding in block.bindings:
            ty = binding.var.ty
            floating = isinstance(ty, relax.TensorType) and str(ty.dtype).startswith(("float", "bfloat"))
            if floating and ty.shape is not None:
                dims = tuple(int(d) if isinstance(d, tirx.IntImm) else -1 for d in ty.shape.values)
                if dims in shapes:
                    found.append(f"relax value {dims} = {str(binding.value)[:80]}")
    for name, kernel in kernels.items():
        text = kernel.script()
        for k, n in shapes:
            shape = f"(T.int64({k}), T.int64({n}))"
            for at in [i for i in range(len(text)) if text.startswith(shape, i)]:
                tail = text[at + len(shape):at + len(shape) + 12]
                if not tail.startswith(', "int') and not tail.startswith(', "uint'):
                    found.append(f"kernel {name} buffer {shape}{tail}")
    return found


@pytest.mark.parametrize("params", ["inputs", "bound"])
def test_no_float_copy_of_a_quantized_weight_is_made(graph: Graph, params: str) -> None:
    """Issue 11: "dequantizes inside the consuming matmul's kernel (no dense weight buffer per call)": neither the
    Relax program nor any kernel holds a [K, N] or [N, K] float tensor; bound builds do not fold one in either."""
    fn, kernels = fused(graph, params)
    assert dense_weights(fn, kernels, {(K, N), (N, K)}) == []
    assert any("dequantize_matmul" in name for name in kernels)


def test_the_matmul_schedule_blocks_every_decoding_kernel(graph: Graph) -> None:
    """The register-blocked CPU rule takes every decoding kernel (an unscheduled one runs ~100x slower), the
    transposed product (computed as (W @ y^T)^T) included."""
    _, kernels = fused(graph, "inputs")
    decoding = {name: f for name, f in kernels.items() if "dequantize_matmul" in name}
    assert any(name.startswith("dequantize_matmul_t") for name in decoding)
    with TARGET:
        assert all(CPUMatmul().apply(f, TARGET, False) is not None for f in decoding.values())


@pytest.fixture(scope="module")
def executable(graph: Graph):
    return compile_graph(graph, params="inputs")


@pytest.mark.parametrize("rows", [1, 5])
def test_decoding_matmuls_match_the_interpreter(graph: Graph, executable, rows: int) -> None:
    """Every value kind (q8f/q8s/q4f/q4s/q2f/q2s) per tensor, per row block and per tile, as x @ W, linear and
    y @ W^T, at batch 1 and an odd batch, agrees with the numpy reference; so do a rank-3 z @ W^T and an f16
    dequantize (rounded to f16 before the product, as the reference rounds it)."""
    rng = np.random.default_rng(rows)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in [(rows, K), (rows, N), (N,), (3, rows, N)]]
    inputs.append(rng.standard_normal((rows, K)).astype(np.float16))
    got = executable.run(*inputs)
    want = interpret(graph, inputs)
    assert len(got) == len(want) == 3 * len(CASES) + 2
    np.testing.assert_allclose(got[-2], want[-2], rtol=1e-5, atol=1e-5 * float(np.abs(want[-2]).max()))
    np.testing.assert_allclose(got[-1].astype(np.float32), want[-1].astype(np.float32), rtol=2e-3, atol=1e-2)
    for (value, block), g, w in zip([c for c in CASES for _ in range(3)], got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * float(np.abs(w).max()), err_msg=f"{value} {block}")


def qlora_mlp() -> kiln.Module:
    dev = kiln.Device("cpu").autodiff()
    model = nn.Sequential(nn.Linear(K, N, device=dev), nn.ReLU(), nn.Linear(N, 32, device=dev))
    return model.apply_qlora(QLora(Lora(4, 8.0, init_std=0.3), Quantizer(scheme=QuantScheme("q4f", (16,)))))


def _loss(model: kiln.Module, x: kiln.Tensor) -> kiln.Tensor:
    y = model(x)
    return (y * y).mean()


def test_a_qlora_training_step_forms_no_dense_weight() -> None:
    """Issue 11: "no dense weight buffer ... per training step": the forward and the `dy @ W^T` of the backward read
    codes; `x @ (W + s A B)` is multiplied through the factors, so no [K, N] adapted weight or gradient exists."""
    program = build_step(qlora_mlp(), _loss, optim.SGD(), [TensorType((8, K), DType.f32)])
    fn, kernels = fused(program.graph, "inputs")
    assert dense_weights(fn, kernels, {(K, N), (N, K), (N, 32), (32, N)}) == []


def test_a_qlora_training_step_matches_the_interpreter() -> None:
    """Loss and updated factors of SGD steps through TVM equal the numpy interpreter's (which forms W + s A B)."""
    x = np.random.default_rng(3).standard_normal((8, K)).astype(np.float32)
    model, results = qlora_mlp(), []
    for backend in (None, TVMBackend()):
        with using_backend(backend):
            step = kiln.compile_step(model, _loss, optim.SGD(), ((8, K), "f32"))
            losses = [step(0.5, x) for _ in range(3)]
            factors = {path: p.state.get() for path, p in step.model().named_parameters() if "lora" in path}
            results.append((losses, factors))
    (want_losses, want), (got_losses, got) = results
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5)
    assert want_losses[-1] < want_losses[0] and set(got) == set(want) and len(got) == 4
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=1e-4, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("scheme", [QuantScheme.nf4(64), QuantScheme.nf4(64, "bf16"),
                                    QuantScheme.nf4(64, double_quant=True)], ids=["f32", "bf16", "double"])
def test_nf4_weights_decode_inside_the_matmul_and_match_the_interpreter(scheme: QuantScheme) -> None:
    """The fused kernel is generic over `quant_ops.decoder`: NF4's lookup, narrow scales and double-quantized
    scales (four dequantize operands) need no kernel of their own, make no float weight, and agree with the numpy
    reference; a QLoRA step over them reads codes in the forward and in the backward's `dy @ W^T`."""
    model = nn.Sequential(nn.Linear(K, 2 * K, bias=False), nn.ReLU(), nn.Linear(2 * K, 2 * K, bias=False))
    model = model.quantize_weights(Quantizer(scheme=scheme))
    weights = {(K, 2 * K), (2 * K, K), (2 * K, 2 * K)}
    graph = kiln.trace(model, ((None, K), "f32"))
    fn, kernels = fused(graph, "bound")
    assert dense_weights(fn, kernels, weights) == [] and any("dequantize_matmul" in name for name in kernels)
    x = np.random.default_rng(4).standard_normal((3, K)).astype(np.float32)
    want = interpret(graph, [x])[0]
    np.testing.assert_allclose(compile_graph(graph).run(x)[0], want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
    adapted = model.apply_lora(Lora(2, 4.0, init_std=0.3)).fork(kiln.Device("cpu").autodiff()).train()
    program = build_step(adapted, _loss, optim.SGD(), [TensorType((4, K), DType.f32)])
    fn, kernels = fused(program.graph, "inputs")
    assert dense_weights(fn, kernels, weights) == []
    assert any(name.startswith("dequantize_matmul_t") for name in kernels)  # the backward's dy @ W^T
