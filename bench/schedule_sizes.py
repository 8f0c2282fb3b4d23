"""A/B of the contraction tile: the AVX-512 constants kiln used everywhere before (8x32, 16 accumulators, 16 lanes,
128 KiB panels) against the sizes this CPU's model gives (`kiln.runtime.tvm.cpu`), on matmul and conv kernels.

Run from the repository root:

    .venv/bin/python bench/schedule_sizes.py [--cpu-time]

One TVM thread, so the kernel, not the thread pool, is measured. `--cpu-time` times process CPU time instead of
wall time (best of 5 blocks): on a host shared with other jobs the wall clock measures the share of a core one
gets, CPU time is closer to what the kernel costs. % peak divides by one core's peak from bench/peak.c built for
this CPU (`roofline.peak_gflops(1)`), timed by the same clock.
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
from kiln.runtime.tvm.pipeline import cpu_compile
from kiln.runtime.tvm.schedules import default_cpu_rules
from kiln.runtime.tvm.target import cpu_target

AVX512_CONSTANTS = {"mr": 8, "nr": 32, "panel_bytes": 128 << 10, "accumulators": 16, "lanes": 16}
KERNELS = {  # name: (operand shapes, relax body, flops)
    "matmul 64x784x512": ([(64, 784), (784, 512)], relax.op.matmul, 2 * 64 * 784 * 512),
    "matmul 256x1024x1024": ([(256, 1024), (1024, 1024)], relax.op.matmul, 2 * 256 * 1024 * 1024),
    "matmul K=64 attention 12x128x64x128": ([(12, 128, 64), (12, 64, 128)], relax.op.matmul, 2 * 12 * 128 * 64 * 128),
    "conv 3x3 8x64x32x32->64": ([(8, 64, 32, 32), (64, 64, 3, 3)],
                                lambda x, w: relax.op.nn.conv2d(x, w, padding=1), 2 * 8 * 64 * 64 * 9 * 32 * 32),
    "conv 3x3 s2 1x64x56x56->128": ([(1, 64, 56, 56), (128, 64, 3, 3)],
                                    lambda x, w: relax.op.nn.conv2d(x, w, padding=1, strides=2),
                                    2 * 128 * 64 * 9 * 28 * 28),
}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-time", action="store_true", help="time process CPU time, not wall time")
    cpu_time = parser.parse_args().cpu_time
    clock = time.process_time if cpu_time else time.perf_counter
    target = cpu_target()
    peak = peak_gflops(1, cpu_time=cpu_time)
    clock_name = "CPU" if cpu_time else "wall"
    print(f"cpu: {cpu_model(target).describe()}; 1-core peak {peak} GFLOP/s ({clock_name} time); "
          f"load {os.getloadavg()[0]:.1f}")
    print("| kernel | sizes | ms | GFLOP/s | % peak |\n|---|---|---:|---:|---:|")
    for name, (shapes, body, flops) in KERNELS.items():
        args = [tvm.runtime.tensor(np.random.default_rng(0).standard_normal(s).astype(np.float32)) for s in shapes]
        for label, tile in (("AVX-512 constants", AVX512_CONSTANTS), ("CPU model", {})):
            pipeline.default_cpu_rules = lambda t=None, tile=tile: default_cpu_rules(t, tile)
            library = cpu_compile(relax_module(shapes, body), target,
                                  pipeline.cpu_pipeline(target))
            main_fn = relax.VirtualMachine(library, tvm.cpu())["main"]
            ms = best_ms(lambda f=main_fn, a=args: f(*a), clock)
            gflops = flops / ms / 1e6
            share = f"{100 * gflops / peak:.0f}" if peak else "-"
            print(f"| {name} | {label} | {ms:.3f} | {gflops:.1f} | {share} |", flush=True)


if __name__ == "__main__":
    main()
