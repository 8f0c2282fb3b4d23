"""Benchmark of the gradient pipeline (`autodiff,cse,checkpoint,dce`) on traced transformer stacks.

It times the passes `Tensor.backward` and `compile_step` run, pass by pass and whole, as CPU milliseconds (best of
`--repeat`), for stacks of 1 to `--layers` encoder layers; these passes rebuild functions through the rewrite
driver, so this is where a slower driver shows.

    .venv/bin/python bench/gradient_pipeline.py              # 1, 2, 4 and 8 layers
    .venv/bin/python bench/gradient_pipeline.py --layers 2   # a quick run
"""

from __future__ import annotations

import argparse
import platform
import time

import kiln
from kiln import nn
from kiln.ir import Graph
from kiln.passes import PassManager

PASSES = ["autodiff", "cse", "checkpoint{strategy=balanced}", "dce"]
D_MODEL, HEADS, FFN, BATCH, SEQ = 128, 4, 512, 8, 16


class Stack(kiln.Module):
    """`n` encoder layers and a linear head whose mean is the loss."""

    def __init__(self, n: int):
        device = kiln.Device("cpu").autodiff()
        self.layers = [nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, device=device) for _ in range(n)]
        self.head = nn.Linear(D_MODEL, 10, device=device)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).mean()


def best_ms(pm: PassManager, graph: Graph, repeat: int) -> tuple[Graph, float]:
    best = float("inf")
    for _ in range(repeat):
        start = time.process_time()
        out = pm.run(graph)
        best = min(best, time.process_time() - start)
    return out, best * 1e3


def row(n: int, repeat: int) -> str:
    graph = kiln.trace(Stack(n), ((BATCH, SEQ, D_MODEL), "f32"))
    times, current = [], graph
    for name in PASSES:
        current, ms = best_ms(PassManager.parse(name), current, repeat)
        times.append(ms)
    out, whole = best_ms(PassManager.parse(",".join(PASSES)), graph, repeat)
    cells = [n, len(graph.functions["forward"].ops), len(out.functions["forward_backward"].ops), *times, whole]
    return "| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else f"{c:,}" for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8, help="the largest stack (doubling from 1; default 8)")
    parser.add_argument("--repeat", type=int, default=15, help="runs per measurement; the best is shown")
    args = parser.parse_args(argv)
    print(f"Python {platform.python_version()}, {platform.machine()}, best of {args.repeat}, CPU ms\n")
    print("| layers | forward ops | forward_backward ops | " + " | ".join(PASSES) + " | whole pipeline |")
    print("|---:|---:|---:|" + "---:|" * (len(PASSES) + 1))
    n = 1
    while n <= args.layers:
        print(row(n, args.repeat), flush=True)
        n *= 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
