"""Where an inference encoder layer's time goes, kernel by kernel: kiln's build (`kiln.compile`, weights bound) under
TVM's VM instrument beside onnxruntime's own profile (`SessionOptions.enable_profiling`) of the ONNX file kiln
exports, both on 1 thread, each kernel's best of `--calls` calls, in CPU time.

    .venv/bin/python bench/encoder_kernels.py [--d 256] [--batch 1] [--calls 20] [--top 20] [--precision bf16]

The layer is the matrix's (`inference.encoder_widths(d)`, 128 tokens). CPU time keeps a shared host's load out of
the figures; onnxruntime's kernel times are its profiler's (wall clock within the call), so on a loaded host they
read high. bench/step_kernels.py does the same for a captured training step.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ["TVM_NUM_THREADS"] = "1"  # before TVM's pool starts

import numpy as np
import onnxruntime as ort
from inference import encoder_widths, traced  # bench/ is the script's directory
from vm_kernels import kernel_times

import kiln
from kiln import nn
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.executable import Executable


def best_of(run: object, calls: int) -> float:
    """The best CPU-time ms of `calls` calls of `run`."""
    best = float("inf")
    for _ in range(calls):
        start = time.process_time()
        run()
        best = min(best, time.process_time() - start)
    return best * 1e3


def kiln_kernels(exe: Executable, x: np.ndarray, calls: int) -> dict[str, tuple[float, str]]:
    """Per VM call name: (its best ms summed over one forward's calls, its first call's argument shapes)."""
    return {name: (ms, " ".join("x".join(map(str, shape)) for shape in shapes))
            for name, (ms, _, shapes) in kernel_times(exe, lambda: exe(x), calls).items()}


def ort_kernels(path: Path, feeds: dict[str, np.ndarray], calls: int) -> tuple[float, dict[str, tuple[float, str]]]:
    """onnxruntime on 1 thread: (best ms of a call, per node: its best ms and op type, from its profile)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads, options.log_severity_level = 1, 1, 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    session.run(None, feeds)
    plain = best_of(lambda: session.run(None, feeds), calls)
    options.enable_profiling, options.profile_file_prefix = True, str(path.with_suffix(""))
    profiled = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for _ in range(calls):
        profiled.run(None, feeds)
    runs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for event in json.loads(Path(profiled.end_profiling()).read_text()):
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            runs[(event["name"].removesuffix("_kernel_time"), event["args"].get("op_name", ""))].append(
                event["dur"] / 1e3)
    return plain, {name: (min(times), op) for (name, op), times in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--precision", default="f32", help="kiln's precision mode (docs/precision.md)")
    a = parser.parse_args()
    graph = traced(nn.TransformerEncoderLayer(*encoder_widths(a.d)), (a.batch, 128, a.d))
    x = kiln.aligned(np.random.default_rng(1).standard_normal((a.batch, 128, a.d)).astype(np.float32))
    exe = kiln.compile(graph, precision=a.precision)
    exe(x)
    plain = best_of(lambda: exe(x), a.calls)
    kernels = kiln_kernels(exe, x, a.calls)
    print(f"encoder d{a.d} {a.batch}x128 {a.precision}, 1 thread, best of {a.calls}, CPU time; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"\nkiln: {plain:.3f} ms a call; its kernels and VM builtins, each timed alone: "
          f"{sum(ms for ms, _ in kernels.values()):.3f} ms\n")
    print("| kernel | ms | argument shapes |\n|---|---:|---|")
    for name, (ms, shapes) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"| {name[:60]} | {ms:.3f} | {shapes} |")
    with tempfile.TemporaryDirectory(prefix="kiln-encoder-") as tmp:
        path = Path(tmp) / "encoder.onnx"
        path.write_bytes(to_onnx(graph).SerializeToString())
        ort_plain, nodes = ort_kernels(path, {graph.functions["forward"].args[0].name: x}, a.calls)
    print(f"\nonnxruntime: {ort_plain:.3f} ms a call; its nodes (profiler, best each): "
          f"{sum(ms for ms, _ in nodes.values()):.3f} ms\n")
    print("| node | op | ms |\n|---|---|---:|")
    for name, (ms, op) in sorted(nodes.items(), key=lambda kv: -kv[1][0])[:a.top]:
        print(f"| {name[:60]} | {op} | {ms:.3f} |")


if __name__ == "__main__":
    main()
