"""Benchmark of one training step (forward, loss, backward, Adam update): kiln's captured step against torch 2.13
eager and torch.compile, with identical initial weights and inputs and the same thread count; and the peak live
activation bytes of `forward_backward` under each checkpointing strategy.

Workloads: an MLP 784 -> 512 -> 512 -> 10 on a batch of 64 (cross-entropy), and a transformer encoder layer
(d 256, 4 heads, feed-forward 1024, dropout 0) on a batch of 8 x 128 tokens (squared error against a target).
kiln runs on each backend named by --backends (the interpreter; TVM when `kiln.runtime.tvm.backend` exists);
torch.compile compiles the model (forward and backward) and keeps the optimizer eager.

    .venv/bin/python bench/train_step.py                    # every workload and backend, 2 threads
    .venv/bin/python bench/train_step.py --steps 5 --backends interpreter --no-compile   # a quick run
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--backends", default="interpreter,tvm")
    parser.add_argument("--workloads", default="mlp,transformer")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # WORKLOAD:IMPLEMENTATION, in a child process
    return parser.parse_args()


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts: before kiln imports TVM

import torch  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

import kiln  # noqa: E402
from kiln import nn, optim  # noqa: E402
from kiln.frontend.optim.optimizer import with_values  # noqa: E402
from kiln.frontend.trace import trace_function  # noqa: E402
from kiln.ir.liveness import peak_live_bytes  # noqa: E402
from kiln.passes import PassManager  # noqa: E402
from kiln.runtime.backend import Backend, InterpreterBackend, set_default_backend  # noqa: E402

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


def transformer() -> Workload:
    d, heads, ffn = 256, 4, 1024
    model = seeded(nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, device=DEVICE))
    reference = torch.nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, activation="gelu", batch_first=True)
    a = model.attention

    def t(p: kiln.Param) -> torch.Tensor:
        return torch.from_numpy(p.state.get().T.copy())

    def v(p: kiln.Param) -> torch.Tensor:
        return torch.from_numpy(p.state.get().copy())

    with torch.no_grad():
        attn = reference.self_attn
        attn.in_proj_weight.copy_(torch.cat([t(a.query.weight), t(a.key.weight), t(a.value.weight)]))
        attn.in_proj_bias.copy_(torch.cat([v(a.query.bias), v(a.key.bias), v(a.value.bias)]))
        attn.out_proj.weight.copy_(t(a.output.weight))
        attn.out_proj.bias.copy_(v(a.output.bias))
        for ours, theirs in ((model.ff_in, reference.linear1), (model.ff_out, reference.linear2)):
            theirs.weight.copy_(t(ours.weight))
            theirs.bias.copy_(v(ours.bias))
        for ours, theirs in ((model.norm1, reference.norm1), (model.norm2, reference.norm2)):
            theirs.weight.copy_(v(ours.gamma))
            theirs.bias.copy_(v(ours.beta))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((8, 128, d)).astype(np.float32) for _ in range(2)]
    return Workload(f"transformer layer d{d} h{heads} ffn{ffn}, batch 8x128", model,
                    lambda m, x, y: nn.mse_loss(m(x), y), inputs, reference, torch.nn.functional.mse_loss)


WORKLOADS = {"mlp": mlp, "transformer": transformer}


def timed(step: Callable[[], float]) -> tuple[float, float, float]:
    """(first call seconds, first loss, median seconds of the timed steps)."""
    start = time.perf_counter()
    loss = step()
    first = time.perf_counter() - start
    for _ in range(ARGS.warmup):
        step()
    times = []
    for _ in range(ARGS.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, loss, statistics.median(times)


def run_kiln(w: Workload, backend: Backend) -> tuple[float, float, float]:
    previous = set_default_backend(backend)
    try:
        specs = [(x.shape, kiln.ir.DType.from_numpy(x.dtype)) for x in w.inputs]
        step = kiln.compile_step(w.model, w.loss_fn, optim.Adam(), *specs)
        return timed(lambda: step(LR, *w.inputs))
    finally:
        set_default_backend(previous)


def run_torch(w: Workload, compiled: bool) -> tuple[float, float, float]:
    model = torch.compile(w.torch_model) if compiled else w.torch_model
    opt = torch.optim.Adam(w.torch_model.parameters(), LR)
    inputs = [torch.from_numpy(x) for x in w.inputs]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = w.torch_loss(model(inputs[0]), inputs[1])
        loss.backward()
        opt.step()
        return loss.item()

    return timed(step)


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


def run(workload: str, implementation: str) -> tuple[float, float, float]:
    """One implementation on one workload, in this process."""
    torch.manual_seed(0)
    torch.set_num_threads(ARGS.threads)
    w = WORKLOADS[workload]()
    with threadpool_limits(limits=ARGS.threads, user_api="blas"):
        if implementation == "kiln-interpreter":
            return run_kiln(w, InterpreterBackend())
        if implementation == "kiln-tvm":
            from kiln.runtime.tvm.backend import TVMBackend
            return run_kiln(w, TVMBackend())
        return run_torch(w, compiled=implementation == "torch-compile")


def isolated(workload: str, implementation: str) -> tuple[float, float, float] | None:
    """`run` in a fresh process, so no thread pool (TVM's spin-waiting workers, OpenMP) outlives its run, with an
    empty kiln compile cache."""
    argv = [sys.executable, __file__, "--run", f"{workload}:{implementation}", "--threads", str(ARGS.threads),
            "--steps", str(ARGS.steps), "--warmup", str(ARGS.warmup)]
    with tempfile.TemporaryDirectory() as cache:  # an empty compile cache: the first step compiles
        proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "KILN_CACHE_DIR": cache})
    if proc.returncode:
        print(f"note: {workload} {implementation} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return tuple(json.loads(proc.stdout.splitlines()[-1]))  # type: ignore[return-value]


def main() -> None:
    if ARGS.run:
        workload, implementation = ARGS.run.split(":")
        print(json.dumps(run(workload, implementation)))
        return
    implementations = [f"kiln-{b}" for b in ARGS.backends.split(",")] + ["torch-eager"]
    if importlib.util.find_spec("kiln.runtime.tvm.backend") is None and "kiln-tvm" in implementations:
        print("note: kiln.runtime.tvm.backend does not exist; TVM skipped", file=sys.stderr)
        implementations.remove("kiln-tvm")
    if not ARGS.no_compile:
        implementations.append("torch-compile")
    rows, memory = [], []
    for key in ARGS.workloads.split(","):
        w = WORKLOADS[key]()
        results = {}
        for implementation in implementations:
            print(f"{w.name}: {IMPLEMENTATIONS[implementation]} ...", file=sys.stderr, flush=True)
            results[implementation] = isolated(key, implementation)
        eager = results["torch-eager"]
        for implementation, result in results.items():
            if result is None:
                rows.append(f"| {w.name} | {IMPLEMENTATIONS[implementation]} | failed | | | |")
                continue
            first, loss, median = result
            ratio = f"{median / eager[2]:.2f}" if eager else ""
            rows.append(f"| {w.name} | {IMPLEMENTATIONS[implementation]} | {median * 1e3:.1f} | {ratio} | "
                        f"{first:.2f} | {loss:.6f} |")
        memory += checkpoint_rows(w)
    print(f"`{' '.join(['.venv/bin/python', *sys.argv])}` on {datetime.date.today()}, CPython "
          f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, {ARGS.threads} threads "
          f"(torch.set_num_threads, BLAS, TVM_NUM_THREADS), {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; each row in its own process, median of {ARGS.steps} steps after "
          f"{ARGS.warmup} warm-up steps, Adam lr {LR}, identical initial weights and inputs.\n")
    print("| workload | implementation | ms / step | x torch eager | first step s (trace + compile) | "
          "first loss |")
    print("|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    print("\nPeak live activation bytes of `forward_backward` (liveness over the op order; op results, gradients "
          "included, parameters and inputs not):\n")
    print("| workload | checkpointing | peak MiB | x none | ops |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(memory))


if __name__ == "__main__":
    main()
