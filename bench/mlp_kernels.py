"""Where an MLP's time goes: each Linear (+ bias, + relu) of the MLP rows as one TVM kernel, 1 thread, against the
1-core FMA peak, with the tile the CPU model gives and any `--tile MRxNR` to compare.

    .venv/bin/python bench/mlp_kernels.py [--cpu-time] [--tile 6x16 ...] [--only SUBSTRING]

Kernels: the 784-512-512-10 MLP at batch 256 and 1, and the odd 37-77-1000-10 MLP at batch 7 (widths no vector
divides). `--cpu-time` times process CPU time (best of 5 blocks): on a shared host closer to the kernel's own cost.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["TVM_NUM_THREADS"] = "1"  # before TVM's pool starts

import numpy as np
import tvm
from roofline import peak_gflops  # bench/ is the script's directory
from timing import best_ms
from tvm import relax

import kiln.runtime.tvm.pipeline as pipeline
from kiln.runtime.tvm.calibrate import relax_module
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.schedules import CPUMatmul, Safe, default_cpu_rules
from kiln.runtime.tvm.target import cpu_target

LAYERS = {"784-512-512-10": (784, 512, 512, 10), "37-77-1000-10": (37, 77, 1000, 10)}
BATCHES = {"784-512-512-10": (256, 1), "37-77-1000-10": (7,)}


def kernels() -> list[tuple[str, int, int, int, bool]]:
    """(name, M, K, N, relu) of every Linear of the MLP rows."""
    out = []
    for mlp, widths in LAYERS.items():
        for m in BATCHES[mlp]:
            for i, (k, n) in enumerate(zip(widths, widths[1:])):
                relu = i < len(widths) - 2
                out.append((f"{mlp} b{m} {m}x{k}x{n}{' +bias+relu' if relu else ' +bias'}", m, k, n, relu))
    return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-time", action="store_true", help="time process CPU time, not wall time")
    parser.add_argument("--tile", action="append", default=[], help="also an MRxNR register tile (e.g. 6x16)")
    parser.add_argument("--only", default="", help="only the kernels whose name contains this")
    args = parser.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    target = cpu_target()
    peak = peak_gflops(1, cpu_time=args.cpu_time)
    print(f"cpu: {cpu_model(target).describe()}; 1-core peak {peak} GFLOP/s ({'CPU' if args.cpu_time else 'wall'} "
          f"time); load {os.getloadavg()[0]:.1f}")
    print("| kernel | tile | ms | GFLOP/s | % peak | GB/s of weight |\n|---|---|---:|---:|---:|---:|")
    tiles = {"CPU model": {}, **{t: dict(zip(("mr", "nr"), map(int, t.split("x")), strict=True)) for t in args.tile}}
    rng = np.random.default_rng(0)
    for name, m, k, n, relu in kernels():
        if args.only not in name:
            continue
        shapes = [(m, k), (k, n), (n,)]
        data = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        want = np.maximum(data[0] @ data[1] + data[2], 0) if relu else data[0] @ data[1] + data[2]

        def body(x, w, b, relu=relu):
            y = relax.op.add(relax.op.matmul(x, w), b)
            return relax.op.nn.relu(y) if relu else y

        for label, tile in tiles.items():
            pipeline.default_cpu_rules = lambda t=None, tile=tile: [Safe(CPUMatmul(**tile)), *default_cpu_rules(t)[1:]]
            library = tvm.compile(relax_module(shapes, body), target=target,
                                  relax_pipeline=pipeline.cpu_pipeline(target))
            fn = relax.VirtualMachine(library, tvm.cpu())["main"]
            tensors = [tvm.runtime.tensor(d) for d in data]
            np.testing.assert_allclose(fn(*tensors).numpy(), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
            flops = 2 * m * k * n
            ms = best_ms(lambda f=fn, a=tensors: f(*a), clock, max(1, int(2e8 // flops)))
            gflops = flops / ms / 1e6
            share = f"{100 * gflops / peak:.0f}" if peak else "-"
            print(f"| {name} | {label} | {ms:.4f} | {gflops:.1f} | {share} | {4 * k * n / ms / 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
