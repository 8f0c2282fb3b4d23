"""Compile a kiln graph to an `Executable`: lower to Relax, build with kiln's CPU or CUDA pipeline, and cache.

The cache key is `structural_hash(graph, include_data=<params bound>)` plus the target, the options, and the
versions of this lowering and of TVM, and the CPU model the schedules were sized for (with its calibration, if
one is stored: `KILN_CALIBRATE=1` makes one on a CPU's first build). Bound builds also key on the seed (ParamId)
and initializer of every parameter that has no data yet, since those decide the constants baked into the library.

A CPU build whose graph, target and options have a tuning database (`kiln tune`, `tune.py`) applies it before
kiln's schedule rules, which stay the fallback; the database's digest joins the key, so tuned and untuned builds
(and builds from successive tunings) are cached apart.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path

import tvm
from tvm.target import Target

from kiln.ir import Graph, KilnError, structural_hash
from kiln.ir import init as initializers
from kiln.ir.interpreter import param_value
from kiln.passes import PassManager
from kiln.passes.factor_lora import FactorLora
from kiln.runtime.debug.reproducer import run_with_reproducer
from kiln.runtime.progress import log, stage

from . import compile_cache
from .artifact import Program
from .calibrate import calibrate_on_first_use
from .calibration import stored_tile
from .cpu import cpu_model
from .executable import Executable
from .lower import PARAM_MODES, lower, used_params
from .lowp import resolve_precision
from .memory_plan import DEFAULT_MAX_BATCH, batch_dims
from .op_map import build_map, describe
from .pipeline import cpu_compile, cpu_pipeline, cuda_pipeline
from .source_digest import compiler_version
from .target import TargetLike, resolve_target
from .tune import apply_database_pass, database_digest, find_database


def _device(target: Target) -> str:
    return "cuda" if target.kind.name == "cuda" else "cpu"


def cache_key(graph: Graph, functions: Sequence[str], target: Target, params: str, fast_math: bool,
              tuning: str | None = None, precision: str = "f32", donated: Mapping[str, tuple[int, ...]] | None = None,
              max_batch: int | None = DEFAULT_MAX_BATCH) -> str:
    """The compile-cache key of one build; `tuning` is the digest of the tuning database it applies, if any,
    `precision` the resolved precision mode (`lowp.resolve_precision`), `donated` the donated inputs and
    `max_batch` the dynamic batch its memory plan covers."""
    h = hashlib.blake2b(digest_size=20)
    model = cpu_model(target)  # the schedules' sizes: sysfs caches and a calibration are not in str(target)
    parts = [structural_hash(graph, include_data=params == "bound"), tuple(functions), str(target), params,
             fast_math, compiler_version(), tvm.__version__, model.key, stored_tile(model)]
    if params == "bound":
        parts += [(p.name, int(p.id), initializers.identity(p.init, p.type, p.id)) for p in graph.params.values()
                  if p.data is None and p.init is not None]
    if tuning is not None:
        parts.append(("tuning", tuning))
    if precision != "f32":
        parts.append(("precision", precision))
    if donated:
        parts.append(("donated", sorted(donated.items())))
    if max_batch != DEFAULT_MAX_BATCH:  # the default is left out, as the other options' defaults are
        parts.append(("max_batch", max_batch))
    h.update(repr(parts).encode())
    return h.hexdigest()


def lowering_input(graph: Graph) -> Graph:
    """The graph as lowering sees it: a (Q)LoRA weight is never formed dense."""
    return run_with_reproducer(PassManager([FactorLora()]), graph)


def donated_positions(graph: Graph, functions: Sequence[str], donate: Mapping[str, Collection[str]] | None
                      ) -> dict[str, tuple[int, ...]]:
    """Each compiled function's donated inputs by position, from their names; an unknown function or input name
    is a `KilnError` naming it."""
    positions = {}
    for function, names in (donate or {}).items():
        if function not in functions:
            raise KilnError(f"cannot donate inputs of @{function}: the build has {', '.join(functions)}")
        args = [a.name for a in graph.functions[function].args]
        unknown = sorted(set(names) - set(args))
        if unknown:
            raise KilnError(f"@{function} has no input %{unknown[0]} to donate (its inputs: {', '.join(args)})")
        positions[function] = tuple(i for i, name in enumerate(args) if name in names)
    return {f: p for f, p in positions.items() if p}


def build(graph: Graph, functions: Sequence[str], target: Target, params: str, fast_math: bool,
          tuning_dir: Path | None = None, precision: str = "f32", donated: Mapping[str, tuple[int, ...]] | None = None,
          max_batch: int | None = None) -> Program:
    """Lower and build without the cache, applying the tuning database in `tuning_dir` (CPU only) if given, in a
    resolved `precision` mode; `donated` (`donated_positions`) lets CPU kernels write into those inputs; a CPU
    build plans memory for dynamic batches up to `max_batch`."""
    with stage(f"lowering @{graph.name} to Relax"):
        lowered = lower(lowering_input(graph), params, functions, precision, target)
    signatures = lowered.signatures
    if _device(target) == "cuda":
        pipeline = cuda_pipeline(target)
    else:
        extra = (apply_database_pass(tuning_dir, target),) if tuning_dir is not None else ()
        batches = {n: batch_dims(lowered.module[n]) for n in signatures} if max_batch is not None else {}
        pipeline = cpu_pipeline(target, fast_math, extra_schedule_passes=extra, donated=donated,
                                batch_bounds={n: dict.fromkeys(dims, max_batch) for n, dims in batches.items()},
                                precision=precision)
        signatures = {n: dataclasses.replace(sig, donated=(donated or {}).get(n, ()), bounds=tuple(
            (i, axis, max_batch) for at in batches.get(n, {}).values() for i, axis in at))
            for n, sig in signatures.items()}
    try:
        with stage(f"building @{graph.name} for {target.kind.name}"):
            library = cpu_compile(lowered.module, target, pipeline) if _device(target) == "cpu" else \
                tvm.compile(lowered.module, target=target, relax_pipeline=pipeline)
    except (RuntimeError, TypeError, ValueError) as e:  # what TVM raises on a failed build
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise KilnError(f"TVM could not build module @{graph.name} for {target.kind.name}: {first}") from e
    return Program(library, signatures, str(target), _device(target), params,
                   build_map(lowered.module, lowered.sources))


def compile_graph(graph: Graph, *, target: TargetLike = "llvm", params: str = "bound", fast_math: bool = True,
                  functions: Sequence[str] | None = None, cache: bool = True, precision: str = "f32",
                  donate: Mapping[str, Collection[str]] | None = None,
                  max_batch: int | None = DEFAULT_MAX_BATCH) -> Executable:
    """Compile `functions` (default: all) of `graph`; a cached build (memory, then disk) is reused.

    `params="bound"` bakes the parameters in as constants (deployment); `params="inputs"` passes them at run time
    (the executable holds the graph's current values), so one build serves any weights. `precision` is one of
    `lowp.PRECISIONS` (f32, bf16, bf16! for emulated bf16, int8: docs/precision.md). `donate` names, per function,
    inputs the caller gives up on each call (a training step's parameters and optimizer state): a CPU build writes
    results into them where a kernel can, and the executable copies an array passed there first unless it is one
    of the function's own last `run(copy=False)` outputs, so a caller's arrays are never written. A CPU build
    shares storage between intermediates over a dynamic batch up to `max_batch` (`memory_plan.py`); a call with a
    larger batch runs a build without that bound, made on first need (`max_batch=None` builds only that one).
    """
    if params not in PARAM_MODES:
        raise KilnError(f"params must be one of {', '.join(PARAM_MODES)}, not {params!r}")
    if max_batch is not None and (isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1):
        raise KilnError(f"max_batch must be a positive int or None, not {max_batch!r}")
    names = tuple(functions) if functions is not None else tuple(graph.functions)
    donated = donated_positions(graph, names, donate)
    tgt = resolve_target(target)
    calibrate_on_first_use(tgt)
    mode = resolve_precision(precision, tgt)
    tuned = find_database(graph, tgt, params, fast_math)
    key = cache_key(graph, names, tgt, params, fast_math, database_digest(tuned) if tuned is not None else None, mode,
                    donated, max_batch)
    hit = compile_cache.lookup(key) if cache else None
    if cache:
        log.info("compile cache %s for @%s (%s)", "hit" if hit is not None else "miss", graph.name, key[:12])
    if hit is not None:
        program, path = hit
    else:
        program, path = build(graph, names, tgt, params, fast_math, tuned, mode, donated, max_batch), None
        if cache:
            with stage(f"storing @{graph.name} in the compile cache"):
                program, path = compile_cache.store(key, program, program.library.export_library)
    values = None
    if params == "inputs":
        values = {p.name: param_value(p) for name in names for p in used_params(graph, name)}
    bounded = any(sig.bounds for sig in program.signatures.values())
    return Executable(program, values, library_path=path,
                      ops=lambda: {n: describe(f) for n, f in lowering_input(graph).functions.items()},
                      unbounded=(lambda: compile_graph(graph, target=target, params=params, fast_math=fast_math,
                                                       functions=functions, cache=cache, precision=precision,
                                                       donate=donate, max_batch=None)) if bounded else None)
