"""trace: run a module's forward on placeholders and return its `ir.Graph` (state nodes plus `forward`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from kiln.ir import DType, FunctionBuilder, TensorType, prune, verify
from kiln.ir import Graph as IRGraph

from .dag import lower
from .device import Device
from .module import Module, submodule_paths
from .tensor import Tensor, placeholder
from .tracing import tracing

InputSpec = TensorType | tuple[Sequence[int | None], DType | str]


def as_type(spec: InputSpec) -> TensorType:
    if isinstance(spec, TensorType):
        return spec
    shape, dtype = spec
    return TensorType(tuple(shape), DType(dtype) if isinstance(dtype, str) else dtype)


def trace(module: Module, *input_specs: InputSpec, names: Sequence[str] = ()) -> IRGraph:
    """The module's graph: its parameter and flag nodes and a `forward` function over inputs of these types.

    `None` dims in the specs stay dynamic (`?`), so one traced graph serves any batch size.
    """
    graph, updated = trace_function(module, module.forward, *input_specs, names=names)
    if not updated:
        return graph
    fn = graph.functions["forward"]
    return graph.with_function(prune(replace(fn, results=fn.results[:len(fn.results) - len(updated)])))


def trace_function(module: Module, fn: Callable[..., Any], *input_specs: InputSpec, names: Sequence[str] = ()
                   ) -> tuple[IRGraph, tuple[str, ...]]:
    """Trace `fn(*inputs)` over the module's state: `forward` returns fn's tensors, then the new value of each
    running-state buffer fn updated (batch-norm statistics in training), whose paths come back in that order."""
    state = module.state_graph()
    paths = {id(leaf): path for path, leaf in module.leaves()}
    device = next(iter(module.devices()), Device("cpu"))
    arg_names = list(names) + [f"x{i}" if i else "x" for i in range(len(names), len(input_specs))]
    inputs = [placeholder(n, as_type(s), device) for n, s in zip(arg_names, input_specs)]
    with tracing(paths, submodule_paths(module)) as ctx:
        out = fn(*inputs)
    outputs = list(out) if isinstance(out, tuple | list) else [out]
    if not all(isinstance(o, Tensor) for o in outputs):
        raise TypeError(f"{getattr(fn, '__qualname__', fn)} must return tensors, got {type(out).__name__}")
    fb = FunctionBuilder("forward", state.symbol)
    bound = {id(t.node): (fb.input(name, t.type),) for name, t in zip(arg_names, inputs)}
    results, _ = lower(fb, [*outputs, *ctx.updates.values()], data_as_inputs=False, bound=bound)
    return verify(state.with_function(fb.finish(results))), tuple(ctx.updates)
