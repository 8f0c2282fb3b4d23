"""Where a captured training step's time goes, kernel by kernel: the TVM step of an encoder layer (forward, mse loss,
backward, Adam) under TVM's VM profiler, 1 thread (or --threads), each kernel's best call of N steps, with its
share of the step, GFLOP/s where it is a contraction, and the kiln ops behind it; then torch eager's same step under
torch.profiler (its top ops, self CPU time, best of the same N).

    .venv/bin/python bench/step_kernels.py [--d 256 --batch 8] [--steps 5] [--top 25] [--threads 1]

Times are process CPU time on 1 thread (a shared host distorts them less than the wall clock) and wall clock on
more (CPU time would add the threads' times up), each kernel's the best of `--steps` steps. d 256 x batch 8 and
d 768 x batch 1 (128 tokens) are bench/train_step.py's "transformer" and "encoder768" rows.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import time
from collections import defaultdict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # before TVM's pool starts
CLOCK = time.process_time if ARGS.threads == 1 else time.perf_counter

import numpy as np  # noqa: E402
import torch  # noqa: E402
from inference import encoder_widths  # noqa: E402  (bench/ is the script's directory)
from vm_kernels import Kernel, kernel_times  # noqa: E402

import kiln  # noqa: E402
from kiln import nn, optim  # noqa: E402
from kiln.frontend.step import TrainStep  # noqa: E402
from kiln.runtime.backend import set_default_backend  # noqa: E402
from kiln.runtime.tvm.backend import TVMBackend  # noqa: E402
from kiln.runtime.tvm.compile import lowering_input  # noqa: E402
from kiln.runtime.tvm.executable import Executable  # noqa: E402
from kiln.runtime.tvm.op_map import ops_named  # noqa: E402

BACKEND = TVMBackend()
set_default_backend(BACKEND)


def train_step(d: int, batch: int) -> tuple[TrainStep, tuple[np.ndarray, np.ndarray]]:
    """The captured step of a d-wide encoder layer (dropout 0) under the TVM backend, and its inputs (x, y)."""
    width, heads, ffn = encoder_widths(d)
    model = nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.0, device=kiln.Device("cpu").autodiff())
    rng = np.random.default_rng(0)
    x, y = ((rng.standard_normal((batch, 128, d)) * 0.05).astype(np.float32) for _ in range(2))
    spec = (x.shape, "f32")
    return kiln.compile_step(model, lambda m, x, y: nn.mse_loss(m(x), y), optim.Adam(), spec, spec), (x, y)


def kiln_kernels(step: TrainStep, inputs: tuple[np.ndarray, ...], steps: int
                 ) -> tuple[float, dict[str, Kernel], Executable]:
    """(best step ms, `kernel_times` of the step, its executable), run as training runs it: each step's parameters
    and state are the last one's results, donated."""
    run = functools.partial(step, 1e-3, *inputs)
    run()
    plain = float("inf")
    for _ in range(steps):
        start = CLOCK()
        run()
        plain = min(plain, (CLOCK() - start) * 1e3)
    assert step.program is not None
    exe = BACKEND.executable(step.program.graph, "step", step.program.donated)
    return plain, kernel_times(exe, run, steps, CLOCK), exe


def torch_ops(d: int, batch: int, steps: int) -> tuple[float, dict[str, float]]:
    """torch eager's step of the same layer: (best step ms, best self-CPU ms per aten op)."""
    torch.set_num_threads(ARGS.threads)
    width, heads, ffn = encoder_widths(d)
    layer = torch.nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.0, activation="gelu", batch_first=True)
    opt = torch.optim.Adam(layer.parameters(), 1e-3)
    x, y = torch.randn(batch, 128, d), torch.randn(batch, 128, d)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(layer(x), y).backward()
        opt.step()

    step()
    plain = float("inf")
    for _ in range(steps):
        start = CLOCK()
        step()
        plain = min(plain, (CLOCK() - start) * 1e3)
    best = {}
    for _ in range(steps):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        per = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
        for name, ms in per.items():
            best[name] = min(best.get(name, float("inf")), ms)
    return plain, best


def kernel_ops(graph: kiln.ir.Graph, name: str, op_map: dict[str, list[int]]) -> str:
    """The kiln op kinds behind a kernel name (`fused_matmul3_add2` -> matmul, add), counted."""
    ops = lowering_input(graph).functions["step"].ops
    kinds: dict[str, int] = defaultdict(int)
    for i in ops_named(name, op_map):
        kinds[ops[i].kind] += 1
    return ", ".join(f"{k}x{n}" if n > 1 else k for k, n in kinds.items()) or "-"


def matmul_flops(name: str, shapes: list[tuple[int, ...]], calls: int) -> int:
    """2 x multiply-adds of a matmul kernel's calls from its operand and output shapes (the output last, the
    contraction the operand axis not in it); 0 for other kernels."""
    if "matmul" not in name or len(shapes) < 3:
        return 0
    a, out = shapes[0], shapes[-1]
    k = a[-1] if a[-2] == out[-2] else a[-2]
    return 2 * int(np.prod(out)) * k * calls


def main() -> None:
    a = ARGS
    step, inputs = train_step(a.d, a.batch)
    total, kernels, exe = kiln_kernels(step, inputs, a.steps)
    assert step.program is not None
    graph, op_map = step.program.graph, exe.program.op_map["step"]
    clock = "CPU time" if a.threads == 1 else "wall clock"
    print(f"d{a.d} batch {a.batch}x128, {a.threads} thread(s), {clock}, best of {a.steps}; load "
          f"{os.getloadavg()[0]:.1f}")
    in_kernels = sum(ms for ms, _, _ in kernels.values())
    print(f"kiln TVM step: {total:.2f} ms {clock}; its {len(kernels)} kernels and VM builtins, each timed "
          f"alone: {in_kernels:.2f} ms\n")
    print("| kernel | calls | ms | % step | GFLOP/s | shapes | kiln ops |\n|---|---:|---:|---:|---:|---|---|")
    for name, (ms, n, shapes) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:a.top]:
        flops = matmul_flops(name, shapes, n)
        rate = f"{flops / ms / 1e6:.1f}" if flops else ""
        shown = " ".join("x".join(map(str, s)) for s in shapes)
        print(f"| {name[:60]} | {n} | {ms:.3f} | {100 * ms / total:.1f} | {rate} | {shown} | "
              f"{kernel_ops(graph, name, op_map)} |")
    by_kind: dict[str, float] = defaultdict(float)
    for name, (ms, _, _) in kernels.items():
        by_kind[re.sub(r"\d+$", "", name.split("_")[1] if name.startswith("fused_") else name)] += ms
    print("\n| kernel family | ms | % step |\n|---|---:|---:|")
    for name, ms in sorted(by_kind.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {name} | {ms:.3f} | {100 * ms / total:.1f} |")
    t_total, t_ops = torch_ops(a.d, a.batch, a.steps)
    op_total = sum(t_ops.values())
    print(f"\ntorch eager step: {t_total:.2f} ms {clock}; its ops under torch.profiler (self time, wall clock, so "
          f"a busy host inflates them; shares are of their sum, {op_total:.2f} ms)\n")
    print("| aten op | ms | % of ops |\n|---|---:|---:|")
    for name, ms in sorted(t_ops.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"| {name} | {ms:.3f} | {100 * ms / op_total:.1f} |")


if __name__ == "__main__":
    main()
