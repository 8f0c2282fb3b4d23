"""Keep a tuned schedule only where it beats kiln's own rules, so tuning never makes a kernel slower.

MetaSchedule records the best schedule it found for every kernel it tried, however few its trials: at 64 trials
for a whole model, many kernels get a handful, and those records override kiln's rules in every later build (a
tuned transformer block ran 1.37x and a tuned CNN 2x slower than the default build). After tuning, each kernel
is built with kiln's rules and timed like MetaSchedule times its candidates; the records of kernels where the
rules are at least as fast are dropped, and builds fall back to the rules there.
"""

from __future__ import annotations

import logging
import shutil
import statistics
from pathlib import Path

import numpy as np
import tvm
import tvm_ffi
from tvm.s_tir import dlight as dl
from tvm.target import Target

from kiln.runtime.atomic import atomic_path

from .pipeline import cpu_compile
from .schedules import default_cpu_rules

_log = logging.getLogger(__name__)


def rules_seconds(mod: tvm.IRModule, target: Target, number: int = 3, min_repeat_ms: int = 50) -> float:
    """Seconds per call of a kernel module's `main` scheduled by kiln's rules, timed like MetaSchedule's runner."""
    from tvm.s_tir import meta_schedule as ms

    with target:
        scheduled = dl.ApplyDefaultSchedule(*default_cpu_rules())(mod)
    library = cpu_compile(scheduled, target).jit()
    rng = np.random.default_rng(0)
    args = [tvm.runtime.tensor(rng.uniform(-1, 1, [int(d) for d in info.shape]).astype(info.dtype))
            for info in ms.arg_info.ArgInfo.from_prim_func(mod["main"])]
    timer = library.time_evaluator("main", tvm.cpu(), number=number, repeat=1, min_repeat_ms=min_repeat_ms)
    return float(timer(*args).mean)


def prune_database(path: Path, target: Target, workload_file: str, record_file: str) -> tuple[int, int]:
    """Drop the records of every kernel that kiln's rules run at least as fast as its best tuned schedule;
    returns (kernels kept, kernels dropped). The records file is rewritten atomically."""
    from tvm.s_tir import meta_schedule as ms

    db = ms.database.JSONDatabase(path_workload=str(path / workload_file), path_tuning_record=str(path / record_file))
    hashed = [(tvm_ffi.structural_hash(r.workload.mod), r) for r in db.get_all_tuning_records()]
    best: dict[int, tuple[float, tvm.IRModule]] = {}
    for key, record in hashed:
        if not record.run_secs:
            continue
        seconds = statistics.mean(float(s) for s in record.run_secs)
        if key not in best or seconds < best[key][0]:
            best[key] = (seconds, record.workload.mod)
    keep = set()
    for key, (tuned, mod) in best.items():
        rules = rules_seconds(mod, target)
        _log.info("kiln tuning: kernel %x tuned %.1f us, kiln's rules %.1f us", key, tuned * 1e6, rules * 1e6)
        if tuned < rules:
            keep.add(key)
    if len(keep) == len(best):
        return len(keep), 0
    # Only the records file is rewritten: a scratch copy of the workload file gives the kept records the same
    # workload indices, so the database changes in one atomic rename.
    scratch = path / (workload_file + ".scratch")
    shutil.copyfile(path / workload_file, scratch)
    try:
        with atomic_path(path / record_file) as records:
            pruned = ms.database.JSONDatabase(path_workload=str(scratch), path_tuning_record=str(records))
            for key, record in hashed:
                if key in keep:
                    workload = pruned.commit_workload(record.workload.mod)
                    pruned.commit_tuning_record(ms.database.TuningRecord(
                        record.trace, workload, record.run_secs, record.target, record.args_info))
    finally:
        scratch.unlink(missing_ok=True)
    return len(keep), len(best) - len(keep)
