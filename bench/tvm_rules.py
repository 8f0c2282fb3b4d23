"""Benchmark kiln's TVM CPU pipeline against onnxruntime, numpy and torch on three small workloads.

Run from the repository root (the environment matches the method in the TVM CPU research notes):

    unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
    TVM_NUM_THREADS=$(nproc) OMP_NUM_THREADS=$(nproc) OPENBLAS_NUM_THREADS=$(nproc) \
        .venv/bin/python bench/tvm_rules.py [--rounds 5] [--accuracy]

Every approach runs the same float32 graph with weights as inputs. Each round times every approach
(rotated order) for >=20 runs and >=0.2 s after 5 warm-ups; the table shows the median and best of the
per-round medians, and the median over rounds of the per-round ratio to onnxruntime, which cancels noise
common to both. --accuracy instead prints the fast-math error bounds quoted in the docstring of
kiln.runtime.tvm.schedules.fastmath.
"""

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch
import tvm
from onnx import TensorProto, helper
from timing import Runner, interleaved  # bench/ is the script's directory
from tvm import relax

from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.pipeline import cpu_compile, cpu_pipeline
from kiln.runtime.tvm.target import configure_threads, cpu_count, cpu_target


@dataclass
class Workload:
    """One benchmark: its inputs, a float64 numpy reference, and each approach's graph."""

    name: str
    inputs: list[np.ndarray]
    numpy_fn: Callable[..., np.ndarray]
    torch_fn: Callable[..., torch.Tensor]
    relax_fn: Callable[..., relax.Expr]
    onnx_nodes: list[onnx.NodeProto]
    out_shape: tuple[int, ...]


def _erf(x: np.ndarray) -> np.ndarray:
    """Abramowitz-Stegun 7.1.26 erf (|error| < 1.5e-7); numpy has none."""
    t = 1.0 / (1.0 + 0.3275911 * np.abs(x))
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(x) * (1.0 - poly * np.exp(-x * x))


def _gelu(x: np.ndarray) -> np.ndarray:
    """Exact-form gelu on numpy arrays."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _conv3x3(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """NCHW 3x3 conv with padding 1 as im2col + one matmul."""
    n, c, h, wd = x.shape
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    cols = np.lib.stride_tricks.sliding_window_view(xp, (3, 3), axis=(2, 3))
    cols = cols.transpose(0, 2, 3, 1, 4, 5).reshape(n * h * wd, c * 9)
    out = cols @ w.reshape(w.shape[0], -1).T
    return out.reshape(n, h, wd, -1).transpose(0, 3, 1, 2)


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _mlp(rng: np.random.Generator) -> Workload:
    dims = [784, 512, 512, 10]
    inputs = [_rand(rng, 64, 784)]
    for d_in, d_out in zip(dims, dims[1:], strict=False):
        inputs += [_rand(rng, d_in, d_out, scale=d_in**-0.5), _rand(rng, d_out, scale=0.1)]

    def numpy_fn(x, *p):
        for i in range(0, len(p), 2):
            x = x @ p[i] + p[i + 1]
            x = np.maximum(x, 0) if i < len(p) - 2 else x
        return x

    def torch_fn(x, *p):
        for i in range(0, len(p), 2):
            x = torch.addmm(p[i + 1], x, p[i])
            x = torch.relu(x) if i < len(p) - 2 else x
        return x

    def relax_fn(x, *p):
        for i in range(0, len(p), 2):
            x = relax.op.matmul(x, p[i]) + p[i + 1]
            x = relax.op.nn.relu(x) if i < len(p) - 2 else x
        return x

    nodes, h = [], "in0"
    for layer, i in enumerate(range(1, len(inputs), 2)):
        nodes += [
            helper.make_node("MatMul", [h, f"in{i}"], [f"mm{layer}"]),
            helper.make_node("Add", [f"mm{layer}", f"in{i + 1}"], [f"z{layer}"]),
        ]
        h = f"z{layer}"
        if i < len(inputs) - 2:
            nodes.append(helper.make_node("Relu", [h], [f"a{layer}"]))
            h = f"a{layer}"
    nodes.append(helper.make_node("Identity", [h], ["out"]))
    return Workload("mlp 64x784-512-512-10", inputs, numpy_fn, torch_fn, relax_fn, nodes, (64, 10))


def _conv(rng: np.random.Generator) -> Workload:
    inputs = [_rand(rng, 8, 64, 32, 32), _rand(rng, 64, 64, 3, 3, scale=(64 * 9) ** -0.5)]
    nodes = [helper.make_node("Conv", ["in0", "in1"], ["out"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    return Workload(
        "conv2d 3x3 8x64x32x32->64",
        inputs,
        _conv3x3,
        lambda x, w: torch.nn.functional.conv2d(x, w, padding=1),
        lambda x, w: relax.op.nn.conv2d(x, w, padding=1),
        nodes,
        (8, 64, 32, 32),
    )


def _matmul_gelu(rng: np.random.Generator) -> Workload:
    inputs = [_rand(rng, 1024, 256), _rand(rng, 256, 1024, scale=256**-0.5)]
    nodes = [
        helper.make_node("MatMul", ["in0", "in1"], ["y"]),
        helper.make_node("Div", ["y", "sqrt2"], ["ys"]),
        helper.make_node("Erf", ["ys"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["y", "e1"], ["ye"]),
        helper.make_node("Mul", ["ye", "half"], ["out"]),
    ]
    return Workload(
        "matmul+gelu 1024x256x1024",
        inputs,
        lambda x, w: _gelu(x @ w),
        lambda x, w: torch.nn.functional.gelu(x @ w),
        lambda x, w: relax.op.nn.gelu(relax.op.matmul(x, w)),
        nodes,
        (1024, 1024),
    )


def _compile(
    shapes: list[tuple[int, ...]], body: Callable[..., relax.Expr], fast_math: bool = True
) -> tuple[relax.VirtualMachine, float]:
    """Compile `main(in0, in1, ...) = body(...)` with kiln's CPU pipeline; returns the VM and seconds."""
    target = cpu_target()
    start = time.perf_counter()
    exe = cpu_compile(relax_module(shapes, body), target,
                      cpu_pipeline(target, fast_math=fast_math))
    return relax.VirtualMachine(exe, tvm.cpu()), time.perf_counter() - start


def _tvm_runner(wl: Workload, fast_math: bool) -> tuple[Runner, float]:
    """The workload compiled by kiln's pipeline, and its compile time in seconds."""
    vm, seconds = _compile([a.shape for a in wl.inputs], wl.relax_fn, fast_math)
    args = [tvm.runtime.tensor(a) for a in wl.inputs]
    return (lambda: vm["main"](*args)), seconds


def _ort_runner(wl: Workload, threads: int) -> Runner:
    """An onnxruntime CPU session over the same graph, all graph optimizations on."""
    used = {name for node in wl.onnx_nodes for name in node.input}
    consts = [
        helper.make_tensor(name, TensorProto.FLOAT, [], [value])
        for name, value in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))
        if name in used
    ]
    graph = helper.make_graph(
        wl.onnx_nodes,
        "bench",
        [
            helper.make_tensor_value_info(f"in{i}", TensorProto.FLOAT, a.shape)
            for i, a in enumerate(wl.inputs)
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, wl.out_shape)],
        initializer=consts,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = {f"in{i}": a for i, a in enumerate(wl.inputs)}
    return lambda: sess.run(None, feeds)


def _runners(wl: Workload, threads: int) -> dict[str, Runner]:
    """Every approach for a workload, each checked against the float64 reference first."""
    reference = wl.numpy_fn(*[a.astype(np.float64) for a in wl.inputs])
    tensors = [torch.from_numpy(a) for a in wl.inputs]
    runners: dict[str, Runner] = {}
    tvm_fast, compile_s = _tvm_runner(wl, fast_math=True)
    runners["tvm kiln rules"] = tvm_fast
    print(f"  compile (kiln rules + fast-math): {compile_s:.2f} s")
    if "gelu" in wl.name:
        runners["tvm kiln rules, exact gelu"] = _tvm_runner(wl, fast_math=False)[0]
    runners["onnxruntime"] = _ort_runner(wl, threads)
    runners["numpy"] = lambda: wl.numpy_fn(*wl.inputs)

    def torch_run():
        with torch.inference_mode():
            return wl.torch_fn(*tensors)

    runners["torch"] = torch_run
    for name, run in runners.items():
        out = run()
        out = out[0] if isinstance(out, list) else out
        got = out.numpy() if hasattr(out, "numpy") else np.asarray(out)
        np.testing.assert_allclose(got, reference, rtol=3e-3, atol=3e-4, err_msg=name)
    return runners


def bench(rounds: int) -> None:
    """Time every workload and print one table of ms and ratios to onnxruntime."""
    threads = cpu_count()
    configure_threads()
    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    rows = []
    for wl in (_mlp(rng), _conv(rng), _matmul_gelu(rng)):
        print(f"{wl.name}:")
        runners = _runners(wl, threads)
        per_round = interleaved(runners, rounds)
        for name in runners:
            ratios = [t / o for t, o in zip(per_round[name], per_round["onnxruntime"], strict=True)]
            rows.append((wl.name, name, statistics.median(per_round[name]), min(per_round[name]), ratios))
    print(f"\n{threads} threads, {rounds} rounds; ms = median / best of per-round medians")
    print(f"| {'workload':<26} | {'approach':<27} | {'ms median':>9} | {'ms best':>8} | {'vs ORT':>6} |")
    print(f"|{'-' * 28}|{'-' * 29}|{'-' * 11}|{'-' * 10}|{'-' * 8}|")
    for wl_name, name, med, best, ratios in rows:
        ratio = statistics.median(ratios)
        print(f"| {wl_name:<26} | {name:<27} | {med:>9.3f} | {best:>8.3f} | {ratio:>6.2f} |")


def _compile_unary(shape: tuple[int, ...], op: Callable[[relax.Expr], relax.Expr]) -> Callable:
    """`op` on one float32 input, compiled with fast-math on, as a numpy-in numpy-out function."""
    vm, _ = _compile([shape], op)
    return lambda a: vm["main"](tvm.runtime.tensor(a)).numpy()


def accuracy() -> None:
    """Max abs/rel error of fast gelu and fast softmax (float32) against float64 math."""
    configure_threads()
    x = np.linspace(-20.0, 20.0, 2_000_001, dtype=np.float32)
    exact = np.array([0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x.astype(np.float64)])
    err = np.abs(_compile_unary(x.shape, relax.op.nn.gelu)(x) - exact)
    big = np.abs(exact) >= 1e-3
    rel = (err[big] / np.abs(exact[big])).max()
    print(f"fast gelu, x in [-20, 20]: max abs {err.max():.2e}; max rel {rel:.2e} where |gelu(x)| >= 1e-3")
    rng = np.random.default_rng(0)
    for scale in (1.0, 10.0, 30.0):
        logits = (rng.standard_normal((512, 1000)) * scale).astype(np.float32)
        z = logits.astype(np.float64)
        e = np.exp(z - z.max(-1, keepdims=True))
        exact = e / e.sum(-1, keepdims=True)
        err = np.abs(_compile_unary(logits.shape, relax.op.nn.softmax)(logits) - exact)
        big = exact >= 1e-6
        print(
            f"fast softmax, logits ~ N(0, {scale:g}^2): max abs {err.max():.2e};"
            f" max rel {(err[big] / exact[big]).max():.2e} where p >= 1e-6"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--accuracy", action="store_true", help="print fast-math error bounds instead")
    args = parser.parse_args()
    if args.accuracy:
        accuracy()
    else:
        bench(args.rounds)


if __name__ == "__main__":
    main()
