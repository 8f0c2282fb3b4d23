"""Time kiln's TVM CPU build of the spatial ops (conv_transpose2d, resize, pad) against onnxruntime.

    TVM_NUM_THREADS=$(nproc) OMP_NUM_THREADS=$(nproc) .venv/bin/python bench/spatial.py [--rounds 3]

Each workload is one kiln op with its weight as an input; onnxruntime runs kiln's own ONNX export of the same
graph. Prints the median per-call time of each and the ratio kiln / onnxruntime (rounds interleaved as in
bench/timing.py, so noise common to both cancels).
"""

import argparse
import statistics

import numpy as np
import onnxruntime as ort
from timing import interleaved  # bench/ is the script's directory

import kiln
from kiln.ir import Builder
from kiln.runtime.onnx.export import to_onnx

RNG = np.random.default_rng(0)

WORKLOADS = {
    # a decoder / U-Net upsampling stage: 64 -> 32 channels, 32x32 -> 64x64
    "conv_transpose2d 1x64x32x32 k4 s2 p1 -> 32": (
        [(1, 64, 32, 32), (64, 32, 4, 4)], "conv_transpose2d", {"stride": (2, 2), "padding": (1, 1)}),
    "resize linear 1x64x64x64 -> 128x128": (
        [(1, 64, 64, 64)], "resize", {"size": (128, 128), "mode": "linear"}),
    "pad reflect 1x64x64x64 +3": (
        [(1, 64, 64, 64)], "pad", {"before": (0, 0, 3, 3), "after": (0, 0, 3, 3), "mode": "reflect"}),
}


def graph(shapes, kind, attrs):
    b = Builder("bench")
    xs = [b.input(f"x{i}", (s, "f32")) for i, s in enumerate(shapes)]
    b.ret(b.op(kind, *xs, **attrs))
    return b.build()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    for name, (shapes, kind, attrs) in WORKLOADS.items():
        g = graph(shapes, kind, attrs)
        inputs = [RNG.standard_normal(s).astype(np.float32) for s in shapes]
        exe = kiln.compile(g)
        session = ort.InferenceSession(to_onnx(g).SerializeToString(), providers=["CPUExecutionProvider"])
        feed = {i.name: x for i, x in zip(session.get_inputs(), inputs)}
        np.testing.assert_allclose(exe(*inputs), session.run(None, feed)[0], rtol=1e-3, atol=1e-3)
        runners = {"kiln": lambda e=exe, xs=inputs: e(*xs),
                   "onnxruntime": lambda s=session, f=feed: s.run(None, f)}
        times = interleaved(runners, rounds, quiet=False)
        k, o = statistics.median(times["kiln"]), statistics.median(times["onnxruntime"])
        print(f"{name:45s} kiln {k:8.3f} ms  onnxruntime {o:8.3f} ms  ratio {k / o:5.2f}")


if __name__ == "__main__":
    main()
