"""kiln bf16 against OpenVINO's default precision on the matrix's encoder layers, one core each, in CPU time.

    .venv/bin/python bench/bf16_encoders.py [--rounds 3] [--calls 20] [256x1 256x8 ... 768x8]

On a shared host the wall-clock matrix (bench/matrix.py) reads the other tenants' load; process CPU time on one
thread (TVM_NUM_THREADS=1, OpenVINO's INFERENCE_NUM_THREADS=1) keeps most of it out. Each row: the best of `--calls`
calls, the best of `--rounds` rounds alternating the two engines; the layer is `inference.encoder_widths(d)` at
batch x 128 tokens, OpenVINO runs the ONNX file kiln exports. To compare two kiln trees, run each in its own process.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ["TVM_NUM_THREADS"] = "1"  # before TVM's pool starts

import numpy as np
from inference import encoder_widths, traced  # bench/ is the script's directory
from peers import openvino_runner
from timing import Runner, best_ms

import kiln
from kiln import nn
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.source_digest import compiler_version

ROWS = ("256x1", "256x8", "512x1", "512x8", "768x1", "768x8")


def engines(d: int, batch: int) -> tuple[Runner, Runner]:
    """(kiln bf16, OpenVINO default) on one core for the d-wide encoder layer at batch x 128 tokens."""
    graph = traced(nn.TransformerEncoderLayer(*encoder_widths(d)), (batch, 128, d))
    x = kiln.aligned(np.random.default_rng(1).standard_normal((batch, 128, d)).astype(np.float32))
    exe = kiln.compile(graph, precision="bf16")
    with tempfile.TemporaryDirectory(prefix="kiln-bf16-") as tmp:
        path = Path(tmp) / "encoder.onnx"
        path.write_bytes(to_onnx(graph).SerializeToString())
        openvino = openvino_runner(path, {graph.functions["forward"].args[0].name: x}, 1, f32=False)
    if openvino is None:
        raise SystemExit("OpenVINO is not installed")
    return (lambda: exe(x)), openvino


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=4,
                        help="calls per block of `timing.best_ms`, 5 blocks a round (a third of them at batch 8)")
    parser.add_argument("rows", nargs="*", default=list(ROWS), help="DxB: width D at batch B x 128 tokens")
    a = parser.parse_args()
    print(f"compiler {compiler_version()}, 1 thread, CPU time, best of {a.calls} calls x {a.rounds} rounds")
    print("| encoder layer | kiln bf16 ms | OpenVINO default ms | kiln / OpenVINO | load |\n|---|---:|---:|---:|---:|")
    for row in a.rows:
        d, batch = (int(v) for v in row.split("x"))
        kiln_run, openvino = engines(d, batch)
        kiln_run(), openvino()
        calls = a.calls if batch == 1 else max(1, a.calls // 3)
        ours, theirs = float("inf"), float("inf")
        for _ in range(a.rounds):
            ours = min(ours, best_ms(kiln_run, time.process_time, calls))
            theirs = min(theirs, best_ms(openvino, time.process_time, calls))
        print(f"| d{d} {batch}x128 | {ours:.3f} | {theirs:.3f} | {ours / theirs:.2f} | {os.getloadavg()[0]:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
