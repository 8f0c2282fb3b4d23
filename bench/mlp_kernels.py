"""Where an MLP's time goes: each Linear (+ bias, + relu) of the MLP rows as one TVM kernel, 1 thread (or
`TVM_NUM_THREADS`), against the FMA peak of as many cores, with the tile the CPU model gives and any `--tile MRxNR`
to compare.

    .venv/bin/python bench/mlp_kernels.py [--cpu-time] [--tile 6x16 ...] [--only SUBSTRING]
        [--weights bound|inputs] [--in-place]

`--weights bound` makes the weights constants (a `params="bound"` build: packed at build time, `matmul_layout.py`),
`inputs` passes them per call (packed by a kernel where the rows amortize it); `--in-place` adds each kernel built
without the packing pass, read `[K, N]` in place, to compare in one run. `TVM_NUM_THREADS=2` times both cores (wall
time then: CPU time counts the pool's spin).

Kernels: the 784-512-512-10 MLP at batch 256 and 1, and the odd 37-77-1000-10 MLP at batch 7 (widths no vector
divides). `--cpu-time` times process CPU time (best of 5 blocks): on a shared host closer to the kernel's own cost.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TVM_NUM_THREADS", "1")  # before TVM's pool starts; TVM_NUM_THREADS=2 times both cores

import numpy as np
import tvm
from roofline import peak_gflops  # bench/ is the script's directory
from timing import best_ms
from tvm import relax

import kiln.runtime.tvm.pipeline as pipeline
from kiln.runtime.tvm.cpu import cpu_model
from kiln.runtime.tvm.pipeline import cpu_compile
from kiln.runtime.tvm.schedules import default_cpu_rules
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



def _module(x_shape: tuple[int, int], w: relax.Expr, b: np.ndarray, relu: bool) -> tvm.IRModule:
    """`main(x[, w]) = [relu](x @ w + b)`, `w` a constant or the second parameter."""
    bb = relax.BlockBuilder()
    params = [relax.Var("x", relax.TensorType(x_shape, "float32"))]
    if isinstance(w, relax.Var):
        params.append(w)
    with bb.function("main", params):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(params[0], w), relax.const(b)))
            out = bb.emit_output(relax.op.nn.relu(y) if relu else y)
        bb.emit_func_output(out)
    return bb.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu-time", action="store_true", help="time process CPU time, not wall time")
    parser.add_argument("--tile", action="append", default=[], help="also an MRxNR register tile (e.g. 6x16)")
    parser.add_argument("--only", default="", help="only the kernels whose name contains this")
    parser.add_argument("--weights", choices=("bound", "inputs"), default="inputs", help="constant or per-call weights")
    parser.add_argument("--in-place", action="store_true", help="also each kernel without packed weights")
    args = parser.parse_args()
    threads = int(os.environ["TVM_NUM_THREADS"])
    clock = time.process_time if args.cpu_time else time.perf_counter
    target = cpu_target()
    peak = peak_gflops(threads, cpu_time=args.cpu_time)
    print(f"cpu: {cpu_model(target).describe()}; {threads}-core peak {peak} GFLOP/s "
          f"({'CPU' if args.cpu_time else 'wall'} time); {args.weights} weights; load {os.getloadavg()[0]:.1f}")
    print("| kernel | tile | weight | ms | GFLOP/s | % peak | GB/s of weight |\n|---|---|---|---:|---:|---:|---:|")
    tiles = {"CPU model": {}, **{t: dict(zip(("mr", "nr"), map(int, t.split("x")), strict=True)) for t in args.tile}}
    layouts = {"packed": pipeline.pack_matmul_weights, **({"in place": None} if args.in_place else {})}
    rng = np.random.default_rng(0)
    for name, m, k, n, relu in kernels():
        if args.only not in name:
            continue
        x, w, b = (rng.standard_normal(s).astype(np.float32) for s in [(m, k), (k, n), (n,)])
        want = np.maximum(x @ w + b, 0) if relu else x @ w + b
        bound = args.weights == "bound"
        mod = _module((m, k), relax.const(w) if bound else relax.Var("w", relax.TensorType((k, n), "float32")), b, relu)
        tensors = [tvm.runtime.tensor(a) for a in ([x] if bound else [x, w])]
        for (label, tile), (layout, packer) in ((t, lay) for t in tiles.items() for lay in layouts.items()):
            pipeline.default_cpu_rules = lambda t=None, tile=tile: default_cpu_rules(t, tile)
            pipeline.pack_matmul_weights = packer or (lambda _target: tvm.transform.Sequential([]))
            library = cpu_compile(mod, target, pipeline.cpu_pipeline(target))
            pipeline.pack_matmul_weights = layouts["packed"]
            fn = relax.VirtualMachine(library, tvm.cpu())["main"]
            np.testing.assert_allclose(fn(*tensors).numpy(), want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
            flops = 2 * m * k * n
            ms = best_ms(lambda f=fn, a=tensors: f(*a), clock, max(1, int(2e8 // flops)))
            gflops = flops / ms / 1e6
            share = f"{100 * gflops / peak:.0f}" if peak else "-"
            print(f"| {name} | {label} | {layout} | {ms:.4f} | {gflops:.1f} | {share} | {4 * k * n / ms / 1e6:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
