"""Benchmark of one training step (forward, loss, backward, Adam update): kiln's captured step against torch 2.13
eager and torch.compile, with identical initial weights and inputs and the same thread count; and the peak live
activation bytes of `forward_backward` under each checkpointing strategy.

Workloads: an MLP 784 -> 512 -> 512 -> 10 on a batch of 64 (cross-entropy), and encoder layers of
`inference.encoder_widths` (the inference matrix's, dropout 0; squared error against a target): d 256 on a batch of
8 x 128 tokens ("transformer") and d 768 on 1 x 128 ("encoder768"). kiln runs on each backend named by --backends
(the interpreter; TVM when `kiln.runtime.tvm.backend` exists); torch.compile compiles the model (forward and
backward) and keeps the optimizer eager. Each workload runs in one fresh process (empty kiln compile cache) that
interleaves rounds of every implementation (`timing.interleaved`, rotated order, a pause between blocks so thread
pools go idle), so a busy host slows all of them alike: ms is the median of per-round medians, "x torch eager" the
median of per-round ratios. GFLOP/s counts the matmuls of kiln's `forward_backward` (`roofline.graph_flops`), % peak
is against bench/peak.c's FMA peak on the same threads per second of CPU time x threads (what the cores can do,
whatever share of them a busy host leaves this run).

    .venv/bin/python bench/train_step.py                    # every workload and backend, 2 threads
    .venv/bin/python bench/train_step.py --rounds 1 --backends interpreter --no-compile   # a quick run
    .venv/bin/python bench/train_step.py --backends tvm --no-compile --rounds 5   # the issue 14 speed table
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of every implementation")
    parser.add_argument("--backends", default="interpreter,tvm")
    parser.add_argument("--workloads", default="mlp,transformer,encoder768")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # WORKLOAD:IMPLEMENTATION,..., in a child process
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts: before kiln imports TVM

import torch  # noqa: E402
from inference import encoder_widths, torch_encoder  # noqa: E402  (bench/ is the script's directory)
from roofline import cpu_model, graph_flops, peak_gflops  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402
from timing import SETTLE_S, interleaved  # noqa: E402

import kiln  # noqa: E402
from kiln import nn, optim  # noqa: E402
from kiln.frontend.optim.optimizer import with_values  # noqa: E402
from kiln.frontend.trace import trace_function  # noqa: E402
from kiln.ir.liveness import peak_live_bytes  # noqa: E402
from kiln.passes import PassManager  # noqa: E402
from kiln.runtime.backend import Backend, InterpreterBackend, using_backend  # noqa: E402

DEVICE = kiln.Device("cpu").autodiff()
LR = 1e-3


@dataclass
class Workload:
    name: str
    model: kiln.Module
    loss_fn: Callable[..., kiln.Tensor]
    inputs: list[np.ndarray]
    torch_model: torch.nn.Module
    torch_loss: Callable[..., torch.Tensor]


def seeded(model: kiln.Module) -> kiln.Module:
    """The model with weights from a fixed seed (ParamIds, which seed lazy initializers, are random): U(+-1/sqrt(
    fan_in)) for matrices and biases, ones for norm scales, zeros for norm shifts."""
    rng = np.random.default_rng(0)
    values, fan_in = {}, 1
    for path, p in model.leaves():
        if not isinstance(p, kiln.Param):
            continue
        shape = p.lazy_shape()
        if path.endswith("gamma") or path.endswith("beta"):
            values[p.id] = np.full(shape, 1.0 if path.endswith("gamma") else 0.0, np.float32)
            continue
        fan_in = shape[0] if len(shape) == 2 else fan_in
        values[p.id] = rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(fan_in))
    return with_values(model, values)


def mlp() -> Workload:
    model = seeded(nn.Sequential(nn.Linear(784, 512, device=DEVICE), nn.ReLU(), nn.Linear(512, 512, device=DEVICE),
                                 nn.ReLU(), nn.Linear(512, 10, device=DEVICE)))
    reference = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
    with torch.no_grad():
        for layer, ref in zip(model.layers[::2], reference[::2]):
            ref.weight.copy_(torch.from_numpy(layer.weight.state.get().T))
            ref.bias.copy_(torch.from_numpy(layer.bias.state.get()))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((64, 784)).astype(np.float32), rng.integers(0, 10, 64)]
    return Workload("MLP 784-512-512-10, batch 64", model, lambda m, x, y: nn.cross_entropy(m(x), y), inputs,
                    reference, lambda out, y: torch.nn.functional.cross_entropy(out, y))


def encoder(d: int, batch: int) -> Workload:
    width, heads, ffn = encoder_widths(d)
    model = seeded(nn.TransformerEncoderLayer(width, heads, ffn, dropout=0.0, device=DEVICE))
    weights = {path: np.array(p.state.get()) for path, p in model.leaves() if isinstance(p, kiln.Param)}
    reference = torch_encoder(width, heads, ffn)(weights, "cpu").train()  # dropout 0: train mode, same math
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((batch, 128, d)).astype(np.float32) for _ in range(2)]
    return Workload(f"transformer layer d{d} h{heads} ffn{ffn}, batch {batch}x128", model,
                    lambda m, x, y: nn.mse_loss(m(x), y), inputs, reference, torch.nn.functional.mse_loss)


WORKLOADS: dict[str, Callable[[], Workload]] = {"mlp": mlp, "transformer": lambda: encoder(256, 8),
                                              "encoder768": lambda: encoder(768, 1)}


def run_kiln(w: Workload, backend: Backend) -> Callable[[], float]:
    specs = [(x.shape, kiln.ir.DType.from_numpy(x.dtype)) for x in w.inputs]
    step = kiln.compile_step(w.model, w.loss_fn, optim.Adam(), *specs)
    inputs = [kiln.aligned(x) for x in w.inputs]  # as the Learner's DataLoader gathers its batches

    def run() -> float:
        with using_backend(backend):  # the step asks for the default backend on each call
            return step(LR, *inputs)
    return run


def run_torch(w: Workload, compiled: bool) -> Callable[[], float]:
    model = copy.deepcopy(w.torch_model)  # its own weights: the implementations share a process
    opt = torch.optim.Adam(model.parameters(), LR)
    forward = torch.compile(model) if compiled else model
    inputs = [torch.from_numpy(x) for x in w.inputs]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = w.torch_loss(forward(inputs[0]), inputs[1])
        loss.backward()
        opt.step()
        return loss.item()
    return step


def step_flops(w: Workload) -> int:
    """The matmul FLOPs of one step: those of the traced `forward_backward` (the update adds O(parameters))."""
    specs = [(x.shape, kiln.ir.DType.from_numpy(x.dtype)) for x in w.inputs]
    traced, _ = trace_function(w.model, lambda *xs: w.loss_fn(w.model, *xs), *specs)
    return graph_flops(PassManager.parse("autodiff,cse,dce").run(traced), "forward_backward")


def checkpoint_rows(w: Workload) -> list[str]:
    specs = [(x.shape, kiln.ir.DType.from_numpy(x.dtype)) for x in w.inputs]
    traced, _ = trace_function(w.model, lambda *xs: w.loss_fn(w.model, *xs), *specs)
    rows, base = [], None
    for strategy in ("none", "balanced", "all"):
        graph = PassManager.parse(f"autodiff,cse,checkpoint{{strategy={strategy}}},dce").run(traced)
        fn = graph.functions["forward_backward"]
        peak = peak_live_bytes(fn)
        base = base or peak
        rows.append(f"| {w.name} | {strategy} | {peak / 2**20:.2f} | {peak / base:.2f} | {len(fn.ops)} |")
    return rows


IMPLEMENTATIONS = {
    "kiln-interpreter": "kiln captured step, interpreter backend",
    "kiln-tvm": "kiln captured step, TVM backend (llvm, fast-math)",
    "torch-eager": "torch eager",
    "torch-compile": "torch.compile (model; optimizer eager)",
}


def run(workload: str, implementations: list[str]) -> dict[str, tuple[float, float, list[float]]]:
    """Every implementation on one workload in this process: (first call s, first loss, per-round median ms)."""
    torch.manual_seed(0)
    torch.set_num_threads(ARGS.threads)
    w = WORKLOADS[workload]()
    with threadpool_limits(limits=ARGS.threads, user_api="blas"):
        steps, firsts = {}, {}
        for implementation in implementations:
            if implementation == "kiln-interpreter":
                steps[implementation] = run_kiln(w, InterpreterBackend())
            elif implementation == "kiln-tvm":
                from kiln.runtime.tvm.backend import TVMBackend
                steps[implementation] = run_kiln(w, TVMBackend())
            else:
                steps[implementation] = run_torch(w, compiled=implementation == "torch-compile")
            start = time.perf_counter()
            loss = steps[implementation]()
            firsts[implementation] = (time.perf_counter() - start, loss)
        per_round = interleaved(steps, ARGS.rounds, quiet=False, settle_s=SETTLE_S)
    return {name: (*firsts[name], per_round[name]) for name in implementations}


def isolated(workload: str, implementations: list[str]) -> dict[str, tuple[float, float, list[float]]] | None:
    """`run` in a fresh process, so no thread pool outlives its workload, with an empty kiln compile cache."""
    argv = [sys.executable, __file__, "--run", f"{workload}:{','.join(implementations)}", "--threads",
            str(ARGS.threads), "--rounds", str(ARGS.rounds)]
    with tempfile.TemporaryDirectory() as cache:  # an empty compile cache: the first step compiles
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "KILN_CACHE_DIR": cache})
    if proc.returncode:
        print(f"note: {workload} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    if ARGS.run:
        workload, implementations = ARGS.run.split(":")
        print(json.dumps(run(workload, implementations.split(","))))
        return
    implementations = [f"kiln-{b}" for b in ARGS.backends.split(",")] + ["torch-eager"]
    if importlib.util.find_spec("kiln.runtime.tvm.backend") is None and "kiln-tvm" in implementations:
        print("note: kiln.runtime.tvm.backend does not exist; TVM skipped", file=sys.stderr)
        implementations.remove("kiln-tvm")
    if not ARGS.no_compile:
        implementations.append("torch-compile")
    per_core = peak_gflops(ARGS.threads, cpu_time=True)  # per CPU-second: what the cores do, not the share we got
    peak, loads = per_core and per_core * ARGS.threads, [os.getloadavg()[0]]
    rows, memory = [], []
    for key in ARGS.workloads.split(","):
        w = WORKLOADS[key]()
        print(f"{w.name}: {', '.join(implementations)} ...", file=sys.stderr, flush=True)
        flops = step_flops(w)
        results = isolated(key, implementations)
        loads.append(os.getloadavg()[0])
        if results is None:
            rows += [f"| {w.name} | {IMPLEMENTATIONS[i]} | failed | | | | | |" for i in implementations]
            continue
        eager = results["torch-eager"][2]
        for implementation, (first, loss, per_round) in results.items():
            ms = statistics.median(per_round)
            ratio = statistics.median(t / e for t, e in zip(per_round, eager, strict=True))
            rate = flops / ms / 1e6
            share = f"{100 * rate / peak:.0f}%" if peak else "-"
            rows.append(f"| {w.name} | {IMPLEMENTATIONS[implementation]} | {ms:.1f} | {ratio:.2f} | "
                        f"{flops / 1e9:.2f} | {rate:.1f} | {share} | {first:.2f} | {loss:.6f} |")
        memory += checkpoint_rows(w)
    print(f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}: {cpu_model()}, CPython "
          f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, {ARGS.threads} threads "
          f"(torch.set_num_threads, BLAS, TVM_NUM_THREADS), {os.cpu_count()} CPUs, FMA peak {peak or 0:.1f} GFLOP/s "
          f"on {ARGS.threads} cores (bench/peak.c, per CPU-second x cores), load average "
          f"{' / '.join(f'{x:.1f}' for x in loads)} (start / after each workload); each workload in its own process, "
          f"{ARGS.rounds} interleaved rounds, Adam lr {LR}, identical initial weights and inputs.\n")
    print("| workload | implementation | ms / step | x torch eager | GFLOP / step | GFLOP/s | % peak | "
          "first step s (trace + compile) | first loss |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nPeak live activation bytes of `forward_backward` (liveness over the op order; op results, gradients "
          "included, parameters and inputs not):\n")
    print("| workload | checkpointing | peak MiB | x none | ops |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(memory))


if __name__ == "__main__":
    main()
