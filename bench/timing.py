"""Timing helpers for the benchmarks: wait for a quiet host, time a block of calls, interleave rounds.

The method is the one in the TVM CPU research notes: each block is >= `min_runs` calls and >= `min_s` seconds
after warm-ups, redone (up to 3x) when other processes got busy meanwhile; rounds rotate and reverse the order of
approaches; results are medians of per-round medians, and ratios are medians of per-round ratios. `quiet=False` drops
the wait and the redo: on a lent GPU machine /proc/stat may count other tenants, and device time is scarce.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

Runner = Callable[[], object]
SETTLE_S = 0.3  # a pause longer than the spin-wait of OpenMP (200 ms by default), TBB and TVM's thread pool


def _busy_ticks() -> tuple[int, int]:
    """(CPU ticks used by the whole machine, ticks used by this process) so far."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return user + nice + system + irq + softirq + steal, int(fields[11]) + int(fields[12])


def _others_load(since: tuple[int, int], seconds: float) -> float:
    """Cores used by other processes since the `since` sample, `seconds` ago."""
    now = _busy_ticks()
    return ((now[0] - since[0]) - (now[1] - since[1])) / os.sysconf("SC_CLK_TCK") / seconds


def wait_quiet(limit: float = 0.05, patience_s: float = 5.0) -> None:
    """Wait (at most `patience_s`) until other processes use under `limit` of a core."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        before = _busy_ticks()
        time.sleep(0.25)
        if _others_load(before, 0.25) < limit:
            return


def best_ms(run: Runner, clock: Callable[[], float] = time.perf_counter, calls: int = 5) -> float:
    """The best of 5 blocks of `calls` calls, in ms per call, after one warm-up call; `clock` is
    `time.process_time` where a loaded host makes wall time meaningless (one-thread kernels)."""
    run()
    best = float("inf")
    for _ in range(5):
        start = clock()
        for _ in range(calls):
            run()
        best = min(best, (clock() - start) / calls * 1e3)
    return best


def time_block(run: Runner, warmup: int = 5, min_runs: int = 20, min_s: float = 0.2, quiet: bool = True,
               settle_s: float = 0.0) -> float:
    """Median ms per call of one block; `quiet` waits for a quiet host first and redoes a block that was disturbed;
    `settle_s` sleeps first, so the worker threads the previous engine left spinning (OpenMP, TBB, TVM's pool) go
    idle instead of competing with this one."""
    times: list[float] = []
    for _attempt in range(3 if quiet else 1):
        time.sleep(settle_s)
        if quiet:
            wait_quiet()
        for _ in range(warmup):
            run()
        times = []
        before, start = _busy_ticks(), time.perf_counter()
        while len(times) < min_runs or time.perf_counter() - start < min_s:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
        if _others_load(before, time.perf_counter() - start) < 0.08:
            break
    return statistics.median(times)


def interleaved(runners: dict[str, Runner], rounds: int, quiet: bool = True, settle_s: float = 0.0
                ) -> dict[str, list[float]]:
    """Per-round median ms of every runner, rounds in rotated and alternately reversed order."""
    names = list(runners)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
            per_round[name].append(time_block(runners[name], quiet=quiet, settle_s=settle_s))
    return per_round
