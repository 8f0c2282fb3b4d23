"""Eager reverse mode: `Tensor.backward()` lowers the loss's lazy DAG into a graph whose parameter leaves are
parameter nodes, runs the gradient pipeline (the same passes the captured step runs) and evaluates
`forward_backward` through the default backend."""

from __future__ import annotations

import itertools

from kiln.ir import AutodiffWarning, FunctionBuilder, Graph, ParamNode
from kiln.passes import PassManager
from kiln.runtime.backend import default_backend

from .dag import Output, lower, topological
from .gradients import Gradients
from .warn_once import warn_once

GRADIENT_PIPELINE = "factor-lora,autodiff,cse,checkpoint,dce"  # factor-lora: no dense (Q)LoRA weight or its gradient
_runs = itertools.count(1)


def warn_if_untrainable(graph: Graph, stacklevel: int) -> None:
    """Warn (once) when `graph` has parameters and none lives on an autodiff device: Burn would not compile such a
    backward; here it silently yields no gradient, so a training loop would leave every parameter unchanged."""
    params = list(graph.params.values())
    if not params or any(p.autodiff for p in params):
        return
    device = sorted({p.device for p in params})[0]
    warn_once("untrainable", f"no parameter gets a gradient: they are on {device}, a device without autodiff, so "
              f"training changes nothing; build the model on Device({device!r}).autodiff(), or call .train() on a "
              f"module valid() took off autodiff", AutodiffWarning, stacklevel + 1)


def differentiate(graph: Graph) -> Graph:
    """`graph` with `forward_backward` (loss first), checkpointed per its parameters' strategy."""
    return PassManager.parse(GRADIENT_PIPELINE).run(graph)


def backward(loss: Output, device: str) -> Gradients:
    """d loss / d parameter for every parameter leaf of the loss (on `device`) that requires a gradient, by ParamId.

    Leaves are told apart by their autodiff node: a parameter and its fork share a ParamId but not a leaf.
    """
    if loss.type.rank != 0 or not loss.type.dtype.is_float:
        raise ValueError(f"backward needs a scalar float loss, got {loss.type}")
    params: dict[tuple[int, int | None], ParamNode] = {}
    leaves = [n for n in topological([loss.node]) if n.kind == "data" and n.param_id is not None]
    for node in leaves:
        key = (node.param_id, node.autodiff_node)
        if key not in params:
            assert node.param_id is not None and node.data is not None and not isinstance(node.data, tuple)
            params[key] = ParamNode(f"param{len(params)}", node.types[0], node.param_id, data=node.data,
                                    grad=node.require_grad, configured_grad=node.require_grad, device=device,
                                    autodiff=node.autodiff)
    trainable = [(pid, autodiff_node) for (pid, autodiff_node), p in params.items() if p.grad]
    ids = [pid for pid, _ in trainable]
    shared = next((pid for pid in ids if ids.count(pid) > 1), None)
    if shared is not None:
        raise ValueError(f"parameter {shared} is read through two autodiff leaves (a module and its fork, or "
                         "values before and after an optimizer step) in one loss; back-propagate each module's loss "
                         "separately")
    by_name = {p.name: p for p in params.values()}
    fb = FunctionBuilder("forward", by_name.get)
    bound = {id(n): (fb.sym(params[(n.param_id, n.autodiff_node)].name),) for n in leaves}  # type: ignore[index]
    results, feeds = lower(fb, [loss], data_as_inputs=True, bound=bound)
    graph = Graph("backward", params=by_name, functions={"forward": fb.finish(results)})
    warn_if_untrainable(graph, stacklevel=3)  # the caller of Tensor.backward
    graph = differentiate(graph)
    outs = default_backend().run(graph, feeds, "forward_backward", seed=next(_runs))
    if loss.node.data is None and len(loss.node.types) == 1:
        loss.node.data = outs[0]
    return Gradients(dict(zip(ids, outs[1:])), dict(trainable))
