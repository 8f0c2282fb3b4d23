"""Data-parallel scaling of the captured training step on torch.distributed (gloo, 127.0.0.1): steps/s and scaling
efficiency of 1, 2 and 4 processes of one thread each (weak scaling: 64 samples per rank and step) against one process
with as many threads taking the same global batch, and the bytes each step communicates (payload, and on the wire per
rank by the ring model: 2 (N-1)/N of an all_reduce's payload, (N-1)/N of a broadcast's; `--zero 1` shards the
update, ZeRO-1, whose gather is a broadcast from each owner). The interpreter backend runs
the step (numpy; `--backend tvm` builds it with TVM, one thread per process). The cores column says when a run asks
for more processes (or threads) than the host has cores: those rows are oversubscribed, not a scaling figure. The
figures feed docs/distributed.md's model of larger clusters.

    .venv/bin/python bench/distributed.py [--procs 1,2,4] [--steps 20] [--backend interpreter|tvm] [--zero 0|1]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

MODEL = "MLP 784 -> 512 -> 512 -> 10, cross-entropy, AdamW"
PER_RANK = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", default="1,2,4")
    parser.add_argument("--steps", type=int, default=20, help="timed steps (after 3 untimed ones)")
    parser.add_argument("--backend", default="interpreter", choices=("interpreter", "tvm"))
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1), help="ZeRO stage of the data-parallel runs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # "ddp" (a rank) or "threads:N" (one process)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One measured run: a rank of a data-parallel group, or one process with several threads."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    import kiln
    from kiln import nn, optim
    from kiln.passes.data_parallel import DataParallel
    from kiln.runtime.backend import set_default_backend

    if args.backend == "tvm":
        from kiln.runtime.tvm.backend import TVMBackend
        set_default_backend(TVMBackend())
    device = kiln.Device("cpu").autodiff()

    class MLP(kiln.Module):
        def __init__(self) -> None:
            self.fc1, self.fc2 = nn.Linear(784, 512, device=device), nn.Linear(512, 512, device=device)
            self.out = nn.Linear(512, 10, device=device)

        def forward(self, x: kiln.Tensor) -> kiln.Tensor:
            return self.out(self.fc2(self.fc1(x).relu()).relu())

    def loss(model: MLP, x: kiln.Tensor, y: kiln.Tensor) -> kiln.Tensor:
        return nn.cross_entropy(model(x), y)

    kind, _, n = args.worker.partition(":")
    engine = None
    if kind == "ddp":
        from kiln.runtime.distributed import TorchEngine
        engine = TorchEngine()
        threads, batch = 1, PER_RANK
    else:
        threads, batch = int(n), PER_RANK * int(n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch).astype(np.int64)
    kiln.seed(0)
    step = kiln.compile_step(MLP(), loss, optim.AdamW(), ((batch, 784), "f32"), ((batch,), "i64"),
                             data_parallel=DataParallel(zero=args.zero) if engine else None, communicator=engine)
    with threadpool_limits(limits=threads):
        for _ in range(3):
            step(1e-3, x, y)
        sent, wire = (engine.bytes_sent, engine.wire_bytes) if engine else (0, 0)
        if engine:
            engine.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step(1e-3, x, y)
        seconds = (time.perf_counter() - start) / args.steps
    if engine is None or engine.rank == 0:
        per_step = (engine.bytes_sent - sent) // args.steps if engine else 0
        wire_step = (engine.wire_bytes - wire) // args.steps if engine else 0
        Path(args.out).write_text(json.dumps({"seconds": seconds, "bytes": per_step, "wire": wire_step,
                                              "batch": batch}))
    if engine:
        engine.dist.destroy_process_group()


def run(args: argparse.Namespace, mode: str, procs: int, out: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1" if mode == "ddp" else str(procs), "TVM_NUM_THREADS":
           "1" if mode == "ddp" else str(procs), "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(procs)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    cmd = [sys.executable, __file__, "--worker", f"{mode}:{procs}", "--out", str(out), "--steps", str(args.steps),
           "--backend", args.backend, "--zero", str(args.zero)]
    ranks = procs if mode == "ddp" else 1
    ps = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
    for p in ps:
        if p.wait(timeout=1800) != 0:
            sys.exit(f"{mode} x{procs} failed")
    return json.loads(out.read_text())


HOP_LATENCY_S = 50e-6  # one message between two nodes over TCP, a typical figure for 10-100 Gb/s Ethernet


def model(compute_s: float, nbytes: int, backend: str) -> None:
    """docs/distributed.md's model: a ring all-reduce sends 2(N-1)/N x bytes per rank in 2(N-1) messages, after the
    backward (no overlap: an upper bound on communication); efficiency = compute / (compute + communication)."""
    print(f"\nModel (compute {compute_s * 1e3:.1f} ms/step measured at 1 x 1 on the {backend} backend, {nbytes} bytes "
          f"all-reduced per step, {HOP_LATENCY_S * 1e6:.0f} us per message):")
    print("| nodes | 10 Gb/s: comm ms | efficiency | 100 Gb/s: comm ms | efficiency |")
    print("|---|---|---|---|---|")
    for n in (8, 16, 32, 64):
        cells = []
        for gbps in (10, 100):
            comm = 2 * (n - 1) / n * nbytes * 8 / (gbps * 1e9) + 2 * (n - 1) * HOP_LATENCY_S
            cells += [f"{comm * 1e3:.2f}", f"{compute_s / (compute_s + comm):.2f}"]
        print(f"| {n} | " + " | ".join(cells) + " |")


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    import tempfile
    procs = [int(p) for p in args.procs.split(",")]
    load = os.getloadavg()[0]
    print(f"{MODEL}; {PER_RANK} samples per rank and step; backend {args.backend}; ZeRO stage {args.zero}; "
          f"{os.cpu_count()} cores, "
          f"load average {load:.1f} at start")
    cores = os.cpu_count() or 1
    print("| processes x threads | cores | global batch | step ms | steps/s | samples/s | scaling efficiency "
          "| vs 1 process x N threads | payload bytes/step | wire bytes/step per rank |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        base, one = None, None
        for n in procs:
            ddp = run(args, "ddp", n, Path(tmp) / f"ddp{n}.json")
            threaded = run(args, "threads", n, Path(tmp) / f"threads{n}.json")
            rate = ddp["batch"] * n / ddp["seconds"]
            base = base or rate
            one = one or ddp
            peer = threaded["batch"] / threaded["seconds"]
            print(f"| {n} x 1 | {cores_cell(n, cores)} | {ddp['batch'] * n} | {ddp['seconds'] * 1e3:.1f} "
                  f"| {1 / ddp['seconds']:.1f} | {rate:.0f} | {rate / (n * base):.2f} "
                  f"| {rate / peer:.2f} (1 x {n}: {threaded['seconds'] * 1e3:.1f} ms) | {ddp['bytes']} "
                  f"| {ddp['wire']} |")
        if one is not None:
            model(one["seconds"], one["bytes"], args.backend)


def cores_cell(n: int, cores: int) -> str:
    """The host's cores, and whether `n` processes (or threads) oversubscribe them."""
    return f"{cores}" + (f" (oversubscribed {n / cores:.1f}x)" if n > cores else "")


if __name__ == "__main__":
    main()
