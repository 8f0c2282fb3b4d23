"""Auto-tuning with TVM MetaSchedule: `tune_graph` searches schedules for a graph's kernels and stores them in a
database that later `compile_graph` builds of the same graph, target and options apply automatically.

The database lives under `$KILN_CACHE_DIR/tuning/<key>/` (`database_workload.json` and
`database_tuning_record.json`, MetaSchedule's JSONDatabase). The key is the graph's structure without its
parameter data (weights are Relax constants passed to the kernels, not part of them, so retrained weights
keep their tuning), the target, the parameter mode, fast-math, and the lowering and TVM versions.

What is tuned is the *fused* Relax module: the same pass prefix as `cpu_pipeline` up to fusion, so the
kernels' structural hashes, MetaSchedule's workload keys, match those of the compile pipeline. Kernels the
database does not cover (a changed pass, an untuned kernel, or one where kiln's rules were at least as fast
as the tuned schedule: `tune_prune` drops those records after every run) fall back to kiln's schedule rules.
A finished run writes `kiln_tuned.json` (budget, what was kept, the records' digest). A run tunes a staging copy
that replaces the database when it finishes, and a damaged database is never applied (`tune_db`).

MetaSchedule needs `psutil`, `cloudpickle` and `xgboost` (the `xgboost-cpu` wheel), imported only here.
Gotchas avoided (see the TVM CPU research notes): the default LocalBuilder imports `tvm.s_tir.tensor_intrin` in
every fresh worker (~20 s) and times out, so trials build with `fast_build`; MetaSchedule's console log is
silenced in favour of a one-line progress bar on stderr (a start and a final line when stderr is not a
terminal; its full log stays in `<dir>/logs`). Creating the
tuning tasks still imports `tvm.s_tir.tensor_intrin` once (~20-30 s) in this process.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import threading
import time
from pathlib import Path

import tvm
from tvm.target import Target

from kiln.ir import Graph, KilnError, structural_hash
from kiln.runtime.progress import is_terminal

from . import compile_cache
from .lower import PARAM_MODES, lower
from .pipeline import cpu_fusion_passes
from .source_digest import compiler_version
from .target import resolve_target
from .tir_pipeline import CPU_TIR_PIPELINE
from .tune_db import DONE_FILE, RECORD_FILE, WORKLOAD_FILE, damage, mark_done, rewrite_database
from .tune_prune import prune_database

TUNING_VERSION = "2"  # bump when the fused prefix or the database layout changes (2: pruned, marked done)

_log = logging.getLogger(__name__)
_MS_LOGGER = "tvm.s_tir.meta_schedule"


def tuning_key(graph: Graph, target: Target, params: str = "bound", fast_math: bool = True) -> str:
    """The digest naming the tuning database of (graph structure, target, options)."""

    parts = [structural_hash(graph, include_data=False), str(target), params, fast_math, compiler_version(),
             TUNING_VERSION, tvm.__version__]
    return hashlib.blake2b(repr(parts).encode(), digest_size=20).hexdigest()


def tuning_dir(graph: Graph, target: Target, params: str = "bound", fast_math: bool = True) -> Path:
    """Where the tuning database of this graph, target and options lives (whether or not it exists yet)."""
    return Path(compile_cache.cache_dir()) / "tuning" / tuning_key(graph, target, params, fast_math)


def find_database(graph: Graph, target: Target, params: str = "bound", fast_math: bool = True) -> Path | None:
    """The tuning database directory for this build if a whole one with at least one record exists, else None (a
    damaged one is reported and left to `kiln tune` to rebuild)."""
    if target.kind.name != "llvm":
        return None
    path = tuning_dir(graph, target, params, fast_math)
    records = path / RECORD_FILE
    if not ((path / WORKLOAD_FILE).exists() and records.exists()):
        return None
    reason = damage(path)
    if reason is not None:
        _log.warning("%s; building with kiln's schedule rules (kiln tune rebuilds it)", reason)
        return None
    return path if records.stat().st_size > 0 else None


def was_tuned(graph: Graph, target: Target, params: str = "bound", fast_math: bool = True) -> bool:
    """Whether a tuning run for this build finished, even one whose database kept no records (kiln's rules were
    as fast everywhere), so `kiln.compile(tune=N)` does not tune again."""
    path = tuning_dir(graph, target, params, fast_math)
    return (path / DONE_FILE).is_file() and damage(path) is None


def database_digest(path: Path) -> str:
    """A digest of a database's contents, so a re-tuned database yields a new compile-cache key."""
    h = hashlib.blake2b(digest_size=16)
    for name in (WORKLOAD_FILE, RECORD_FILE):
        h.update((path / name).read_bytes())
    return h.hexdigest()


def apply_database_pass(path: Path, target: Target) -> tvm.transform.Pass:
    """`MetaScheduleApplyDatabase(path)` (constructed inside `with target:`, as it requires), logging how many
    of the module's kernels the database scheduled; for `cpu_pipeline(extra_schedule_passes=...)`."""
    from tvm import relax, tirx

    with target:
        apply = relax.transform.MetaScheduleApplyDatabase(str(path))

    def _scheduled(mod: tvm.IRModule) -> int:
        return sum(1 for f in mod.functions.values() if isinstance(f, tirx.PrimFunc) and f.attrs is not None
                   and int(f.attrs.get("tirx.is_scheduled", 0)) == 1)

    @tvm.transform.module_pass(opt_level=0, name="KilnApplyTuningDatabase")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        before = _scheduled(mod)
        out = apply(mod)
        kernels = sum(1 for f in out.functions.values() if isinstance(f, tirx.PrimFunc))
        scheduled = _scheduled(out) - before
        _log.info("kiln tuning: database %s scheduled %d of %d kernels", path, scheduled, kernels,
                  extra={"kiln_tuning_dir": str(path), "kiln_tuned_kernels": scheduled})
        return out

    return _pass


def fused_module(graph: Graph, target: Target, params: str = "bound", fast_math: bool = True) -> tvm.IRModule:
    """The graph's Relax module after `cpu_pipeline`'s passes up to fusion, the module MetaSchedule tunes."""
    mod = lower(graph, params).module
    with target:
        return tvm.transform.Sequential(cpu_fusion_passes(target, fast_math))(mod)


def fast_build(mod: tvm.IRModule, target: Target, _params: object) -> tvm.runtime.Module:
    """MetaSchedule's default_build without its `import tvm.s_tir.tensor_intrin` (20+ s in every worker)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target,
                     pipeline=CPU_TIR_PIPELINE)


def _count_records(path: Path) -> int:
    try:
        with open(path / RECORD_FILE, "rb") as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


class _Progress:
    """A one-line progress bar on stderr, fed by polling the database's record count; when stderr is not a
    terminal (a log, a pipe), only a start line and the final count, never redraws."""

    def __init__(self, path: Path, total: int, interval: float = 0.5):
        self.path, self.total, self.interval = path, total, interval
        self.start = time.monotonic()
        self.stream = sys.stderr
        self.live = is_terminal(self.stream)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-tune-progress", daemon=True)

    def __enter__(self) -> _Progress:
        if self.live:
            self._thread.start()
        else:
            self.stream.write(f"kiln tune: {self.total} trials into {self.path}\n")
            self.stream.flush()
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.live:
            self.stream.write(f"kiln tune: {_count_records(self.path)}/{self.total} trials, "
                              f"{time.monotonic() - self.start:.0f}s\n")
            self.stream.flush()
            return
        self._stop.set()
        self._thread.join()
        self._draw(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _draw(self, final: bool = False) -> None:
        done = _count_records(self.path)
        width = 30
        filled = min(width, width * done // max(self.total, 1))
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\rkiln tune [{bar}] {done}/{self.total} trials, {time.monotonic() - self.start:.0f}s")
        self.stream.write("\n" if final else "")
        self.stream.flush()


def _drop_ms_handlers() -> None:
    """Close and detach the handlers MetaSchedule's logging config put on its loggers."""
    for name in list(logging.Logger.manager.loggerDict):
        if name == _MS_LOGGER or name.startswith(_MS_LOGGER + "."):
            logger = logging.getLogger(name)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
                handler.close()


def tune_graph(graph: Graph, target: str | Target | None = None, trials: int = 64, trials_per_task: int | None = None,
               progress: bool = True, fast_math: bool = True, params: str = "bound") -> Path:
    """Tune the kernels of `graph` (all functions) with MetaSchedule and return the database directory.

    `trials` is the global budget; `trials_per_task` defaults to an even share (at least 1) over the kernels,
    since MetaSchedule leaves kernels untried when per-task x tasks exceeds the budget. Afterwards only the
    kernels whose tuned schedule beats kiln's rules keep their records (`tune_prune`). Tuning again adds
    records to the same database; later `compile_graph` calls with the same target and options use it.
    Only LLVM targets and static input shapes are supported.
    """

    if params not in PARAM_MODES:
        raise KilnError(f"params must be one of {', '.join(PARAM_MODES)}, not {params!r}")
    if trials < 1:
        raise KilnError(f"trials must be at least 1, not {trials}")
    tgt = resolve_target(target or "llvm")
    if tgt.kind.name != "llvm":
        raise KilnError(f"kiln tune supports LLVM (CPU) targets only, not {tgt.kind.name}")
    for name, function in graph.functions.items():
        for arg in function.args:
            if any(not isinstance(d, int) for d in arg.type.shape):
                raise KilnError(f"kiln tune needs static shapes: @{name} argument %{arg.name} is {arg.type}")
    try:
        from tvm.s_tir import meta_schedule as ms
    except ImportError as e:  # pragma: no cover - the tvm wheel always has it
        raise KilnError(f"MetaSchedule is not available: {e}") from e
    for module in ("psutil", "cloudpickle", "xgboost"):
        try:
            __import__(module)
        except ImportError as e:
            raise KilnError(f"kiln tune needs the {module!r} package ({e}); pip install psutil cloudpickle "
                            "xgboost-cpu") from e

    from .target import configure_threads, cpu_count

    configure_threads()
    fused = fused_module(graph, tgt, params, fast_math)
    tasks = ms.relax_integration.extract_tasks(fused, tgt)
    if not tasks:
        raise KilnError(f"module @{graph.name} has no kernels to tune")
    per_task = trials_per_task or max(1, trials // len(tasks))
    path = tuning_dir(graph, tgt, params, fast_math)
    _log.info("kiln tuning: %d kernels, %d trials (%d per kernel) into %s", len(tasks), trials, per_task, path)

    ms_logger = logging.getLogger(_MS_LOGGER)
    old_level = ms_logger.level
    _drop_ms_handlers()  # a second tuning run in one process fails on the handlers the first one left
    ms_logger.setLevel(logging.ERROR)  # its console handler takes this level; the file log keeps DEBUG
    workers = max(1, cpu_count())
    started = time.monotonic()
    with rewrite_database(path) as stage:
        try:
            bar = _Progress(stage, trials) if progress else None
            with bar if bar is not None else contextlib.nullcontext():
                ms.relax_integration.tune_relax(
                    mod=fused, params={}, target=tgt, work_dir=str(stage), max_trials_global=trials,
                    max_trials_per_task=per_task, num_trials_per_iter=min(64, per_task),
                    builder=ms.builder.LocalBuilder(f_build=fast_build, timeout_sec=120, max_workers=workers),
                    runner=ms.runner.LocalRunner(
                        evaluator_config=ms.runner.EvaluatorConfig(number=3, repeat=1, min_repeat_ms=50)),
                    cost_model="xgb", strategy="evolutionary", seed=0)
        except (RuntimeError, TypeError, ValueError) as e:
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise KilnError(f"tuning module @{graph.name} failed: {first}") from e
        finally:
            ms_logger.setLevel(old_level)
            _drop_ms_handlers()  # close its log files in the staging folder
        kept, dropped = prune_database(stage, tgt, WORKLOAD_FILE, RECORD_FILE)
        mark_done(stage, {"trials": trials, "kept": kept, "dropped": dropped})
    _log.info("kiln tuning: %d records in %.1fs; tuned schedules kept for %d kernels, %d left to kiln's rules "
              "(as fast or faster)", _count_records(path), time.monotonic() - started, kept, dropped)
    if progress:
        print(f"kiln tune: kept tuned schedules for {kept} of {kept + dropped} kernels; kiln's rules are as fast "
              "on the rest", file=sys.stderr)
    return path


def record_count(path: Path) -> int:
    """How many tuning records the database at `path` holds (0 when there is none)."""
    return _count_records(path)
