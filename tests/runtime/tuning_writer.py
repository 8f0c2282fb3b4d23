"""Real tuning-database writes for the kill tests: `rewrite_database` with MetaSchedule's own JSONDatabase adding a
batch of records for tiny kernels, as `tune_graph` does around its search."""

from __future__ import annotations

from pathlib import Path

import tvm
from tvm import te
from tvm.s_tir import meta_schedule as ms

from kiln.runtime.tvm.target import resolve_target
from kiln.runtime.tvm.tune_db import RECORD_FILE, WORKLOAD_FILE, mark_done, rewrite_database

BATCH = 3  # records one run adds: a database whose count is not a multiple of it holds a partial run


def kernel(n: int) -> tvm.IRModule:
    """A one-loop kernel of extent `n` (each extent is another workload)."""
    x = te.placeholder((n,), name="x")
    y = te.compute((n,), lambda i: x[i] + 1.0, name="y")
    return tvm.IRModule({"main": te.create_prim_func([x, y])})


def tune_once(path: Path, run: int) -> None:
    """One run's writes: stage, add BATCH records of kernel `8 + run % 5`, mark done, install."""
    target = resolve_target("llvm")
    with rewrite_database(path) as stage:
        db = ms.database.JSONDatabase(path_workload=str(stage / WORKLOAD_FILE),
                                      path_tuning_record=str(stage / RECORD_FILE))
        mod = kernel(8 + run % 5)
        workload = db.commit_workload(mod)
        trace = tvm.s_tir.Schedule(mod).trace
        for i in range(BATCH):
            db.commit_tuning_record(ms.database.TuningRecord(trace, workload, run_secs=[1e-6 * (i + 1)],
                                                             target=target))
        mark_done(stage, {"trials": BATCH, "kept": 1, "dropped": 0})

