"""The one-time calibration of a CPU: time a few candidate contraction tiles and store the fastest.

The model (`cpu.py`) fixes vector width, registers and caches, but not how well LLVM allocates a tile or how a core
overlaps loads with FMAs; a few seconds of timing do. Each candidate `CPUMatmul` tile builds a matmul and a 3x3 conv
(the two shapes of the contraction class) and runs them; the tile with the least total time wins and is stored
(`calibration.py`) for every later build of that CPU model. Opt-in: `kiln calibrate`, or `KILN_CALIBRATE=1`, which
calibrates a model on its first build.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import tvm
from tvm import relax
from tvm.target import Target

from .calibration import CALIBRATE_ENV, store_tile, stored_tile
from .cpu import CPUModel, cpu_model
from .pipeline import cpu_compile, cpu_pipeline
from .schedules import default_cpu_rules
from .schedules.matmul import CPUMatmul

# (operand shapes, relax body): big enough that the tile decides the time, small enough for ~0.1 s a candidate
WORKLOADS = (
    ([(128, 256), (256, 256)], relax.op.matmul),
    ([(1, 32, 28, 28), (32, 32, 3, 3)], lambda x, w: relax.op.nn.conv2d(x, w, padding=1)),
)


def candidates(model: CPUModel) -> list[dict[str, int]]:
    """The model's own tile first, then twice its rows, twice its columns and both with twice the accumulators."""
    base = CPUMatmul().for_cpu(model)
    return [{"mr": base.mr, "nr": base.nr},
            {"mr": 2 * base.mr, "nr": base.nr, "accumulators": 2 * base.accumulators},
            {"mr": base.mr, "nr": 2 * base.nr, "accumulators": 2 * base.accumulators},
            {"mr": max(1, base.mr // 2), "nr": 2 * base.nr}]


def relax_module(shapes: list[tuple[int, ...]], body: Callable[..., relax.Expr]) -> tvm.IRModule:
    """`main(p0, p1, ...) = body(p0, p1, ...)` over float32 tensors of the given shapes: one kernel to time."""
    bb = relax.BlockBuilder()
    params = [relax.Var(f"p{i}", relax.TensorType(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(*params))
        bb.emit_func_output(out)
    return bb.get()

def _seconds(target: Target, tile: dict[str, int], workloads: Sequence, runs: int) -> float:
    """Total best-of-`runs` seconds of the workloads built with `tile` as the contraction rule."""

    @tvm.transform.module_pass(opt_level=0, name="KilnCalibrationTile")
    def _schedule(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return tvm.s_tir.dlight.ApplyDefaultSchedule(*default_cpu_rules(tile=tile))(mod)

    total = 0.0
    rng = np.random.default_rng(0)
    for shapes, body in workloads:
        pipeline = cpu_pipeline(target, True, [_schedule])
        library = cpu_compile(relax_module(shapes, body), target, pipeline)
        main = relax.VirtualMachine(library, tvm.cpu())["main"]
        args = [tvm.runtime.tensor(rng.standard_normal(s).astype(np.float32)) for s in shapes]
        main(*args)
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            main(*args)
            best = min(best, time.perf_counter() - start)
        total += best
    return total


def calibrate(target: Target, tiles: Sequence[dict[str, int]] | None = None, workloads: Sequence = WORKLOADS,
              runs: int = 10) -> tuple[dict[str, int], dict[str, float]]:
    """Time each tile (default: `candidates`) on this machine, store the fastest for the target's CPU model and
    return (winner, seconds per tile as text). The target must be this host: a cross-compile cannot run here."""
    model = cpu_model(target)
    tiles = list(tiles) if tiles is not None else candidates(model)
    seconds = {repr(tile): _seconds(target, tile, workloads, runs) for tile in tiles}
    winner = min(tiles, key=lambda tile: seconds[repr(tile)])
    store_tile(model, winner)
    return winner, seconds


def calibrate_on_first_use(target: Target) -> None:
    """With `KILN_CALIBRATE=1`, calibrate this host's CPU model unless a calibration is stored (the default builds
    never time anything)."""
    model = cpu_model(target)
    if os.environ.get(CALIBRATE_ENV) == "1" and target.kind.name == "llvm" and model.host and \
            stored_tile(model) is None:
        calibrate(target)
