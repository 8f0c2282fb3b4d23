"""Benchmark of the IR and the program passes on synthetic graphs of 1k to 1M ops.

For each size it times building the graph, printing it, parsing the text back, verifying, hashing, and the
pipeline `canonicalize,cse,dce`, each as microseconds per op, and prints a markdown table. Per-op times
should stay flat as graphs grow: a column that rises from 10k to 1M ops is quadratic behaviour somewhere.
`--passes` adds a second table: every other pass on the same graph ending in a scalar loss (autodiff, each
checkpoint strategy on its output, fold-constants, factor-lora, the state passes, reparameterize + materialize,
and cse under equivalence checking), also per op of the forward function.

    .venv/bin/python bench/passes.py                     # 1k, 10k, 100k and 1M ops
    .venv/bin/python bench/passes.py --sizes 1000,10000  # a quick run
    .venv/bin/python bench/passes.py --passes --sizes 10000,100000,1000000
    .venv/bin/python bench/passes.py --passes --sizes 10000 --only autodiff --only "cse, checked"
    .venv/bin/python bench/passes.py --passes --sizes 10000,100000 --repeat 3   # best of 3: steadier under load
    .venv/bin/python bench/passes.py --no-gc             # without Python's cyclic GC, to see its share
    .venv/bin/python bench/passes.py --passes --gc-stats --sizes 100000 --only factor-lora   # what the GC walks

`--gc-stats` adds, per size and column, the collector-tracked objects per forward op (of the graph built, and
the new ones alive after the pass, by type) and the collector's CPU time per op in each generation, the mean of
`--repeat` runs (3 by default), so a full collection that lands in one of them counts at its amortized cost.
`--only` skips the first table (it times the IR stages on every size, minutes at 1M ops) to time just those columns.
"""

from __future__ import annotations

import argparse
import collections
import gc
import platform
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kiln.ir import Builder, Graph, Init, parse, print_graph, structural_hash, verify
from kiln.passes import PassManager

PIPELINE = "canonicalize,cse,dce"
WIDTH = 16
STAGES = ["build", "print", "parse", "verify", "hash", PIPELINE]
# (column, pipeline run first and not timed, pipeline timed): every pass beyond PIPELINE, on a trainable graph
PASS_STAGES = [
    ("autodiff", "", "autodiff"),
    ("checkpoint none", "autodiff", "checkpoint{strategy=none}"),
    ("checkpoint balanced", "autodiff", "checkpoint{strategy=balanced}"),
    ("checkpoint all", "autodiff", "checkpoint{strategy=all}"),
    ("fold-constants", "", "fold-constants"),
    ("factor-lora", "reparameterize{rank=2}", "factor-lora"),
    ("valid,train,freeze,unfreeze", "", "valid,train,freeze,unfreeze"),
    ("to-device,fork", "", "to-device{device=cuda:0},fork{device=cpu}"),
    ("reparameterize,materialize", "", "reparameterize{rank=2},materialize"),
    ("cse, checked", "", "cse"),  # with --check-equivalence: both graphs interpreted on random inputs
]


def synthetic(n_ops: int) -> Graph:
    """A chain of MLP-like blocks with what the passes look for: a duplicated matmul + bias (cse), a multiply
    by a fresh constant one (canonicalize), double negation and transposes (canonicalize), and a dead op (dce).
    Four weights, a bias and a dropout flag are shared by every block. Stops at `n_ops` ops or just past it."""
    b = Builder(f"Synthetic{n_ops}")
    weights = [b.param(f"layers.{i}.weight", (WIDTH, WIDTH), init=Init("kaiming_uniform", (("fan_in", WIDTH),)))
               for i in range(4)]
    bias = b.param("layers.bias", (WIDTH,), init=Init("zeros"))
    train = b.flag("train", False, configured=True)
    x = b.input("x", ((None, WIDTH), "f32"))
    fn = b.fn
    i = 0
    while len(fn.ops) < n_ops:
        w = weights[i % 4]
        h = b.add(b.matmul(x, w), bias)
        dup = b.add(b.matmul(x, w), bias)                          # the same expression again
        y = b.relu(b.add(h, dup))
        y = b.mul(y, b.constant(np.ones((), np.float32)))           # * 1
        b.exp(y)                                                    # dead
        if i % 2:
            y = b.neg(b.neg(y))
        else:
            y = b.transpose(b.transpose(y))
        if i % 8 == 7:
            y = b.dropout(y, train, p=0.1, seed=i)                  # a dropout whose flag is off
        x = y
        i += 1
    b.ret(x)
    return b.build()


def trainable(n_ops: int) -> Graph:
    """The synthetic graph with trainable weights and a scalar loss (the sum of its output), as autodiff wants."""
    graph = PassManager.parse("unfreeze").run(synthetic(n_ops))
    fn = graph.functions["forward"]
    b = Builder(graph.name)
    b.fn.ops, b.fn.args, b.fn.taken = list(fn.ops), list(fn.args), {v.name for op in fn.ops for v in op.results}
    b.fn.taken.update(a.name for a in fn.args)
    loss = b.fn.emit("sum", fn.results[0])
    return graph.with_function(b.fn.finish([loss]))


def measure_passes(n_ops: int, stages: list[tuple[str, str, str]], repeat: int = 1) -> dict[str, Any]:
    """CPU µs per forward op of each of `stages` (PASS_STAGES rows; preparation untimed), best of `repeat` runs."""
    base = trainable(n_ops)
    ops = len(base.functions["forward"].ops)
    row: dict[str, Any] = {"ops": ops, "us_per_op": {}}
    for column, before, pipeline in stages:
        prepared = PassManager.parse(before).run(base) if before else base
        manager = PassManager.parse(pipeline, check_equivalence=column.endswith("checked"))
        best = float("inf")
        for _ in range(repeat):
            gc.collect()
            _, seconds = timed(lambda manager=manager, prepared=prepared: manager.run(prepared))
            best = min(best, seconds)
        row["us_per_op"][column] = 1e6 * best / ops
    row["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return row


def census_since(before: set[int], ops: int) -> str:
    """Collector-tracked objects alive and not in `before` (ids) per op, their bytes per op (`sys.getsizeof`, the
    collector's header included) and the four commonest types per op."""
    gc.collect()  # what was built and dropped is not counted
    new = [o for o in gc.get_objects() if id(o) not in before and o is not before]
    counts = collections.Counter(type(o).__name__ for o in new)
    top = ", ".join(f"{name} {n / ops:.2f}" for name, n in counts.most_common(4))
    return f"{len(new) / ops:.2f}, {sum(map(sys.getsizeof, new)) / ops:.0f} B ({top})"


class CollectorClock:
    """The collector's CPU seconds and collections per generation (`gc.callbacks`) while the block runs."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[int] = collections.Counter()
        self.count: collections.Counter[int] = collections.Counter()
        self.started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.process_time()
        else:
            self.seconds[info["generation"]] += time.process_time() - self.started
            self.count[info["generation"]] += 1

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)


def collector_stats(n_ops: int, stages: list[tuple[str, str, str]], runs: int) -> list[dict[str, Any]]:
    """Per column: tracked objects per forward op of the graph and of what the pass keeps alive (built with the
    collector off), then the mean CPU µs per op of `runs` runs with it on and the collector's share of that per
    generation (so a full collection that lands in one run of several is counted at its amortized cost)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    before = {id(o) for o in gc.get_objects()}
    base = trainable(n_ops)
    ops = len(base.functions["forward"].ops)
    graph = census_since(before, ops)
    rows = []
    for column, prep, pipeline in stages:
        prepared = PassManager.parse(prep).run(base) if prep else base
        manager = PassManager.parse(pipeline, check_equivalence=column.endswith("checked"))
        gc.collect()
        gc.disable()
        before = {id(o) for o in gc.get_objects()}
        out = manager.run(prepared)
        kept = census_since(before, ops)
        del out, before
        gc.enable()
        total = 0.0
        with CollectorClock() as clock:
            for _ in range(runs):
                total += timed(lambda manager=manager, prepared=prepared: manager.run(prepared))[1]
        collector = ", ".join(f"gen{g} {1e6 * clock.seconds[g] / ops / runs:.2f} ({clock.count[g]}x)"
                              for g in sorted(clock.count)) or "none"
        rows.append({"ops": ops, "column": column, "graph": graph, "kept": kept, "collector": collector,
                     "us_per_op": 1e6 * total / ops / runs, "runs": runs})
    (gc.enable if was_enabled else gc.disable)()
    return rows


def collector_table(rows: list[dict[str, Any]]) -> str:
    head = ["forward ops", "column", "graph: tracked/op, bytes/op (top types)",
            "new and alive after the pass: tracked/op, bytes/op (top types)",
            "collector µs/op (collections)", "pass µs/op", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|---:|---|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['ops']:,} | {r['column']} | {r['graph']} | {r['kept']} | {r['collector']} | "
                     f"{r['us_per_op']:.2f} | {r['runs']} |")
    return "\n".join(lines)


def passes_table(rows: list[dict[str, Any]], stages: list[tuple[str, str, str]]) -> str:
    head = ["forward ops", *(f"{c} µs/op" for c, _, _ in stages), "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['ops']:,}", *(f"{r['us_per_op'][c]:.2f}" for c, _, _ in stages), f"{r['rss_mib']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """The result and the CPU seconds this process spent (steadier than wall time on a shared machine)."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def measure_once(n_ops: int) -> dict[str, Any]:
    gc.collect()
    graph, t_build = timed(lambda: synthetic(n_ops))
    ops = len(graph.functions["forward"].ops)
    text, t_print = timed(lambda: print_graph(graph))
    parsed, t_parse = timed(lambda: parse(text))
    _, t_verify = timed(lambda: verify(parsed))
    digest, t_hash = timed(lambda: structural_hash(parsed))
    assert digest == structural_hash(graph)
    out, t_pipeline = timed(lambda: PassManager.parse(PIPELINE).run(parsed))
    verify(out)
    times = dict(zip(STAGES, [t_build, t_print, t_parse, t_verify, t_hash, t_pipeline]))
    return {"ops": ops, "after": len(out.functions["forward"].ops), "bytes": len(text), "times": times}


def measure(n_ops: int, repeat: int) -> dict[str, Any]:
    """The best of `repeat` runs for each stage, as microseconds per op."""
    runs = [measure_once(n_ops) for _ in range(repeat)]
    row = runs[0]
    row["us_per_op"] = {k: 1e6 * min(r["times"][k] for r in runs) / row["ops"] for k in STAGES}
    row["seconds"] = sum(sum(r["times"].values()) for r in runs)
    row["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    row["repeat"] = repeat
    return row


def table(rows: list[dict[str, Any]]) -> str:
    head = ["ops", *(f"{s} µs/op" for s in STAGES), "ops after", "text MiB", "runs", "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in rows:
        cells = [f"{r['ops']:,}", *(f"{r['us_per_op'][s]:.2f}" for s in STAGES), f"{r['after']:,}",
                 f"{r['bytes'] / 2**20:.1f}", str(r["repeat"]), f"{r['rss_mib']:,.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000,100000,1000000",
                        help="comma-separated op counts, run in increasing order (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=None,
                        help="runs per size, best taken (default: 5 up to 10k ops, 3 up to 100k, then 1; "
                             "the --passes table: 1)")
    parser.add_argument("--passes", action="store_true", help="also time every other pass (a second table)")
    parser.add_argument("--only", action="append", choices=[c for c, _, _ in PASS_STAGES], metavar="COLUMN",
                        help="with --passes, time only this column (repeatable), e.g. --only autodiff")
    parser.add_argument("--gc-stats", action="store_true",
                        help="with --passes, also count collector-tracked objects and time the collector over "
                             "--repeat runs (default 3) of each column, their mean (a third table)")
    parser.add_argument("--no-gc", action="store_true",
                        help="disable Python's cyclic garbage collector while timing, to see what it costs")
    args = parser.parse_args(argv)
    if args.no_gc:
        gc.disable()  # measure_once still collects between runs
    sizes = sorted(int(s.replace("_", "")) for s in args.sizes.split(",") if s.strip())
    rows = []
    for n in ([] if args.only else sizes):
        repeat = args.repeat or (5 if n <= 10_000 else 3 if n <= 100_000 else 1)
        rows.append(measure(n, repeat))
        print(f"{n:>9,} ops: {rows[-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    print(f"Python {platform.python_version()}, numpy {np.__version__}, {platform.machine()}"
          f"{', cyclic GC off' if args.no_gc else ''}; CPU time per op, best of `runs`; peak RSS is the process's "
          f"maximum so far (sizes run smallest first).\n")
    if rows:
        print(table(rows))
    if args.passes:
        stages = [s for s in PASS_STAGES if not args.only or s[0] in args.only]
        pass_rows = []
        for n in sizes:
            pass_rows.append(measure_passes(n, stages, args.repeat or 1))
            print(f"{n:>9,} ops: every pass timed", file=sys.stderr, flush=True)
        print("\n" + passes_table(pass_rows, stages))
        if args.gc_stats:
            print("\n" + collector_table([r for n in sizes for r in collector_stats(n, stages, args.repeat or 3)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
