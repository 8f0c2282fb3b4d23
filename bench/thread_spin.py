"""A/B of TVM's thread-pool spin count (`TVM_THREAD_POOL_SPIN_COUNT`, polls of an idle worker before it blocks):
TVM's 300,000, 0 (block at once) and others, on the MLP 784-512-512-10 at batch 1 and 256, 2 threads.

    .venv/bin/python bench/thread_spin.py [--rounds 4] [--load N] [--counts 300000,0] [--batches 1,256]

A pool reads the count once, so every setting runs in its own child process; rounds alternate the order.
`--load N` adds N busy-looping processes for the run (a loaded host). Prints p50/p90 ms per call and the share of
calls over 5x the best setting's p50.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

SPIN_ENV = "TVM_THREAD_POOL_SPIN_COUNT"


def _child(batch: int, seconds: float) -> None:
    """Time one compiled MLP call after call for `seconds` and print the per-call ms as JSON."""
    import numpy as np

    import kiln
    from kiln import nn

    mlp = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    exe = kiln.compile(kiln.trace(mlp, ((batch, 784), "f32")))
    x = kiln.aligned(np.random.default_rng(0).standard_normal((batch, 784)).astype(np.float32))
    for _ in range(20):
        exe(x)
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        exe(x)
        times.append((time.perf_counter() - t0) * 1e3)
    print(json.dumps(times))


def _spin() -> None:
    while True:
        pass


def _run(spin: str, batch: int, seconds: float) -> list[float]:
    env = {**os.environ, SPIN_ENV: spin}
    out = subprocess.run([sys.executable, __file__, "--child", str(batch), str(seconds)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--load", type=int, default=0, help="busy-looping processes to add")
    parser.add_argument("--counts", default="300000,0", help="spin counts to compare (set explicitly: kiln keeps it)")
    parser.add_argument("--batches", default="1,256")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(int(args.child[0]), float(args.child[1]))
        return
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for hog in hogs:
        hog.start()
    print(f"load average {os.getloadavg()[0]:.1f} at the start, {args.load} busy processes added")
    print("| batch | spin count | p50 ms | p90 ms | calls > 5x best p50 |\n|---|---|---:|---:|---:|")
    try:
        counts = args.counts.split(",")
        for batch in map(int, args.batches.split(",")):
            times: dict[str, list[float]] = {count: [] for count in counts}
            for r in range(args.rounds):
                for count in counts[:: 1 if r % 2 == 0 else -1]:
                    times[count] += _run(count, batch, args.seconds)
            best = min(statistics.median(t) for t in times.values())
            for name, t in times.items():
                cut = statistics.quantiles(t, n=10)
                slow = sum(v > 5 * best for v in t) / len(t)
                print(f"| {batch} | {name} | {statistics.median(t):.3f} | {cut[-1]:.3f} | {100 * slow:.1f}% |",
                      flush=True)
    finally:
        for hog in hogs:
            hog.terminate()


if __name__ == "__main__":
    main()
