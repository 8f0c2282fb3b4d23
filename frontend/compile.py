"""kiln.compile: trace a module (or take a graph) and compile it through TVM into an `Executable`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kiln.ir import Graph, KilnError, TrainingStateWarning
from kiln.runtime.progress import stage
from kiln.runtime.tvm.memory_plan import DEFAULT_MAX_BATCH

from .module import Module
from .trace import InputSpec, as_type, trace
from .warn_once import warn_once

if TYPE_CHECKING:
    from kiln.runtime.tvm.executable import Executable


def compile(model: Module | Graph, *input_specs: InputSpec, target: Any = "llvm", params: str = "bound",
            fast_math: bool = True, functions: Sequence[str] | None = None, tune: int = 0,
            precision: str = "f32", max_batch: int | None = DEFAULT_MAX_BATCH) -> Executable:
    """Compile a module traced on `input_specs` (`None` dims stay dynamic), or a graph as it is.

    `params="bound"` bakes the weights in (deployment); `params="inputs"` passes them at run time. A graph's
    input specs, if given, must be instances of its function's argument types; it compiles with its own types.
    `tune=N` (CPU only) first tunes the kernels with MetaSchedule for N trials, unless this graph, target and
    options were tuned already; builds use an existing database either way. A module with training flags on
    (dropout, batch norm) builds as it is, with a `TrainingStateWarning`: compile `model.valid()` for inference.
    Each stage is logged with its seconds on the `kiln.compile` logger (INFO). `precision` ("f32", "bf16",
    "bf16!" for emulated bf16, "int8") chooses how matmuls and convolutions lower (docs/precision.md).
    A dynamic batch (`None` as the first dim) shares memory between intermediates for batches up to `max_batch`;
    a larger batch runs a second build made on first need (`max_batch=None`: that build only).
    """
    from kiln.runtime.tvm.compile import compile_graph

    if isinstance(model, Module):
        with stage(f"tracing {type(model).__name__}"):
            graph = trace(model, *input_specs)
        _warn_training_flags(graph)
    else:
        graph = model
        _check_specs(graph, functions, input_specs)
    if tune:
        from kiln.runtime.tvm.target import resolve_target
        from kiln.runtime.tvm.tune import tune_graph, was_tuned

        tgt = resolve_target(target)
        if not was_tuned(graph, tgt, params, fast_math):
            tune_graph(graph, target=tgt, trials=tune, fast_math=fast_math, params=params)
    return compile_graph(graph, target=target, params=params, fast_math=fast_math, functions=functions,
                         precision=precision, max_batch=max_batch)


def _warn_training_flags(graph: Graph) -> None:
    """Warn, once per call site of `kiln.compile`, that flags on keep training behaviour in the build."""
    on = [name for name, flag in graph.flags.items() if flag.value]
    if on:
        caller = sys._getframe(2)
        warn_once(("compile", caller.f_code.co_filename, caller.f_lineno),
                  f"kiln.compile: module @{graph.name} has training flags on ({', '.join(on)}): dropout and "
                  "batch-norm statistics stay in training behaviour in the build; compile model.valid() for "
                  "inference", TrainingStateWarning, 3)


def _check_specs(graph: Graph, functions: Sequence[str] | None, specs: Sequence[InputSpec]) -> None:
    """Input specs given with a graph must agree with (or narrow) its first compiled function's argument types."""
    if not specs:
        return
    names = list(functions or graph.functions)
    name = names[0] if functions or "forward" not in names else "forward"
    args = graph.functions[name].args
    if len(specs) != len(args):
        raise KilnError(f"@{name} takes {len(args)} inputs but {len(specs)} specs were given")
    for arg, spec in zip(args, specs):
        t = as_type(spec)
        compatible = t.dtype is arg.type.dtype and t.rank == arg.type.rank and all(
            a is None or a == b for a, b in zip(arg.type.shape, t.shape))
        if not compatible:
            raise KilnError(f"input spec {t} does not fit @{name} argument %{arg.name}: {arg.type}")
