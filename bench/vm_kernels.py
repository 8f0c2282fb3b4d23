"""Per-kernel times of a kiln executable under TVM's VM instrument, for the kernel-by-kernel benches
(`step_kernels.py`, `encoder_kernels.py`)."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

from kiln.runtime.tvm.executable import Executable

Kernel = tuple[float, int, list[tuple[int, ...]]]  # best ms per run (all its calls), calls per run, arg shapes


def kernel_times(exe: Executable, run: Callable[[], object], repeats: int,
                 clock: Callable[[], float] = time.process_time) -> dict[str, Kernel]:
    """Per VM call name over `repeats` calls of `run` (which calls `exe`): its best ms summed over its calls in one
    run, its calls per run and the shapes of its first call's arguments. The instrument costs a few µs of Python
    per call; VM builtins such as allocations appear under their own names."""
    per: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    shapes: dict[str, list[tuple[int, ...]]] = {}
    started: list[float] = []

    def instrument(func, name, before, ret, *args) -> int:  # noqa: ANN001 (TVM's callback signature)
        if before:
            started.append(clock())
            shapes.setdefault(str(name), [tuple(a.shape) for a in args if hasattr(a, "shape")])
            calls[str(name)] += 1
        else:
            per[str(name)] += (clock() - started.pop()) * 1e3
        return 0  # VMInstrumentReturnKind.NO_OP

    exe._machine().set_instrument(instrument)
    best: dict[str, float] = {}
    for _ in range(repeats):
        per.clear()
        calls.clear()
        run()
        for name, ms in per.items():
            best[name] = min(best.get(name, float("inf")), ms)
    return {name: (ms, calls[name], shapes[name]) for name, ms in best.items()}
