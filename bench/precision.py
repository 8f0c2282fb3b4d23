"""Precision modes: kiln f32, bf16 (`precision="bf16"`: AMX tiles where the CPU has AMX-BF16, `vdpbf16ps` where it
has AVX512-BF16 alone, else emulated through `bf16!`) and int8 (`precision="int8"` over Q8 per-channel weights)
against onnxruntime f32, onnxruntime's dynamic int8 (`quantize_dynamic`, per-channel QInt8 weights) and OpenVINO's
default (its own precision choice: bf16 through AMX or AVX512-BF16 where the CPU has it), on the MLP of
bench/inference.py and a 768-wide encoder layer at batch 1 x 128 tokens.

    TVM_NUM_THREADS=$(nproc) OMP_NUM_THREADS=$(nproc) .venv/bin/python bench/precision.py [--rounds 3]

Every build binds its weights; each output's largest error relative to the interpreter's f32 result is reported
beside its time, so a faster mode is never read without what it costs in accuracy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable

import numpy as np
import onnxruntime as ort
from inference import traced  # bench/ is the script's directory
from onnxruntime.quantization import QuantType, quantize_dynamic
from peers import openvino_runner
from roofline import cpu_model, graph_flops, peak_gflops
from timing import Runner, interleaved

from kiln import nn
from kiln.ir import Graph, interpret
from kiln.passes.quantize_weights import QuantizeWeights
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.amx import bf16_products, has_tiles
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.lowp import cpu_features
from kiln.runtime.tvm.target import configure_threads, cpu_target


def q8_per_channel(graph: Graph) -> Graph:
    """Every 2-D weight quantized q8s with one scale per output column (block [K, 1])."""
    for name, p in graph.params.items():
        if p.type.rank == 2 and name.endswith("weight"):
            graph = QuantizeWeights(value="q8s", block=(p.type.shape[0], 1), paths=(name,)).apply(graph)
    return graph


def ort_session(graph: Graph, threads: int, int8: bool) -> Callable[[np.ndarray], np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    model = to_onnx(graph).SerializeToString()
    if int8:
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "f32.onnx"), os.path.join(tmp, "int8.onnx")
            with open(src, "wb") as f:
                f.write(model)
            quantize_dynamic(src, dst, per_channel=True, weight_type=QuantType.QInt8)
            with open(dst, "rb") as f:
                model = f.read()
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    return lambda x: sess.run(None, {name: x})[0]


def openvino_default(graph: Graph, x: np.ndarray, threads: int) -> Callable[[np.ndarray], np.ndarray] | None:
    """OpenVINO in the precision it picks (bf16 on AMX), on the graph's ONNX export; None without OpenVINO."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        with open(path, "wb") as f:
            f.write(to_onnx(graph).SerializeToString())
        run = openvino_runner(path, {graph.functions["forward"].args[0].name: x}, threads, f32=False)
    return None if run is None else lambda _: run()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    threads = configure_threads()
    work = [("mlp 64x784-512-512-10", nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                                     nn.Linear(512, 10)), (64, 784)),
            ("encoder d768 h12 b1 s128", nn.TransformerEncoderLayer(768, 12, 3072), (1, 128, 768))]
    peak = peak_gflops(threads)
    features, tiles = cpu_features(cpu_target()), has_tiles(cpu_target())
    bf16 = "kiln bf16 (AMX tiles)" if tiles else "kiln bf16 (vdpbf16ps)" if bf16_products(cpu_target()) \
        else "kiln bf16 (emulated)"
    print(f"{cpu_model()}, {threads} threads, FMA peak {peak} GFLOP/s; AVX512-BF16: {'avx512bf16' in features}, "
          f"AMX-BF16: {tiles}, VNNI: {bool({'avx512vnni', 'avxvnni'} & features)}; load average "
          f"{os.getloadavg()[0]:.1f}\n")
    print("| model | approach | ms median | ms best | x ORT f32 | GFLOP/s | max rel. error |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for label, module, shape in work:
        graph = traced(module, shape)
        x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
        want = interpret(graph, [x])[0]
        quantized = q8_per_channel(graph)
        calls: dict[str, Callable[[np.ndarray], np.ndarray]] = {
            "kiln f32": compile_graph(graph),
            bf16: compile_graph(graph, precision="bf16!"),
            "kiln int8 (q8s per channel)": compile_graph(quantized, precision="int8"),
            "kiln q8s decoded in f32": compile_graph(quantized),
            "onnxruntime f32": ort_session(graph, threads, False),
            "onnxruntime int8 (dynamic)": ort_session(graph, threads, True),
        }
        openvino = openvino_default(graph, x, threads)
        if openvino is not None:
            calls["openvino default"] = openvino
        errors = {n: float(np.abs(c(x) - want).max() / np.abs(want).max()) for n, c in calls.items()}
        runners: dict[str, Runner] = {n: (lambda c=c, x=x: c(x)) for n, c in calls.items()}
        per_round = interleaved(runners, args.rounds)
        base = per_round["onnxruntime f32"]
        flops = graph_flops(graph)
        for name, ms in per_round.items():
            ratio = statistics.median(m / b for m, b in zip(ms, base))
            med = statistics.median(ms)
            print(f"| {label} | {name} | {med:.3f} | {min(ms):.3f} | {ratio:.2f} | {flops / med / 1e6:.1f} | "
                  f"{errors[name]:.1e} |")


if __name__ == "__main__":
    main()
