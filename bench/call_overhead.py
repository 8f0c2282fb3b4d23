"""Per-call overhead of a compiled executable against onnxruntime and OpenVINO: a Linear at batch 1, tiny (4x4,
nearly all overhead) and 256x256, called from Python with numpy in and numpy out.

    .venv/bin/python bench/call_overhead.py [--rounds 7]

"kiln" gets a plain numpy array (numpy's allocations are 16-byte aligned, so the executable copies it into a
64-byte aligned buffer first), "kiln aligned" one made by `kiln.aligned` (passed to the kernel zero-copy), "kiln
seeded" the same Linear followed by an active Dropout (a run-seed scalar per call). All engines run one ONNX file.
Blocks are timed without waiting for a quiet host (`timing.interleaved(quiet=False)`): µs = median / best of
per-round medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from peers import onnxruntime_runner, openvino_runner  # bench/ is the script's directory
from roofline import cpu_model
from timing import SETTLE_S, Runner, interleaved

import kiln
from kiln import nn
from kiln.runtime.onnx.export import to_onnx
from kiln.runtime.tvm.target import configure_threads, cpu_count


def misaligned(x: np.ndarray) -> np.ndarray:
    """A copy of `x` 16 bytes past a 64-byte boundary, as numpy's own allocations may be (copying until one was
    not aligned could loop forever: numpy's small-block cache can hand back 64-byte aligned blocks every time)."""
    raw = np.empty(x.nbytes + 128, np.uint8)
    start = -raw.ctypes.data % 64 + 16
    out = raw[start:start + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    return out


def runners(width: int, folder: Path, threads: int) -> dict[str, Runner]:
    """Every approach on a `width` x `width` Linear at batch 1, each checked against onnxruntime."""
    graph = kiln.trace(nn.Linear(width, width).valid(), ((1, width), "f32"))
    seeded = kiln.trace(nn.Sequential(nn.Linear(width, width), nn.Dropout(0.5)).train(), ((1, width), "f32"))
    exe, exe_seeded = kiln.compile(graph), kiln.compile(seeded)
    x = misaligned(np.random.default_rng(0).standard_normal((1, width)).astype(np.float32))
    xa = kiln.aligned(x)
    path = folder / f"linear{width}.onnx"
    path.write_bytes(to_onnx(graph).SerializeToString())
    feeds = {"x": x}
    out: dict[str, Runner] = {"kiln": lambda: exe(x), "kiln aligned": lambda: exe(xa),
                              "kiln seeded": lambda: exe_seeded(xa),
                              "onnxruntime": onnxruntime_runner(path, feeds, threads)}
    for name, f32 in (("openvino f32", True), ("openvino default", False)):
        run = openvino_runner(path, feeds, threads, f32)
        if run is not None:
            out[name] = run
    want = out["onnxruntime"]()[0]
    for name in ("kiln", "kiln aligned"):
        np.testing.assert_allclose(out[name](), want, rtol=1e-4, atol=1e-5, err_msg=name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    threads = cpu_count()
    configure_threads()
    load = os.getloadavg()[0]
    lines = [f"`{' '.join(['.venv/bin/python', *sys.argv])}`: {cpu_model()}, {threads} threads, load average "
             f"{load:.1f} at the start; µs per call = median / best of per-round medians; vs ORT = median of "
             "per-round ratios", "", "| Linear, batch 1 | approach | µs median | µs best | vs ORT |",
             "|---|---|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="kiln-call-") as tmp:
        for width in (4, 256):
            runs = runners(width, Path(tmp), threads)
            per_round = interleaved(runs, args.rounds, quiet=False, settle_s=SETTLE_S)
            for name, ms in per_round.items():
                ratio = statistics.median(t / o for t, o in zip(ms, per_round["onnxruntime"], strict=True))
                lines.append(f"| {width}x{width} | {name} | {1e3 * statistics.median(ms):.1f} | {1e3 * min(ms):.1f} "
                             f"| {ratio:.2f} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
