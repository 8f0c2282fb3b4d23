"""The reference interpreter: runs a function on numpy arrays with each op's registered semantics.

It is the oracle every compiled backend is checked against. f16 and bf16 ops compute in f32 and round
their results to the declared dtype, as torch does on CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from . import init as initializers
from . import registry
from .dtypes import DType
from .errors import ShapeError
from .graph import Graph, ParamNode, Value
from .ops.random import run_seed
from .symbols import SymbolResolver
from .types import TensorType, check_named_dims

# numpy dtypes whose arithmetic runs wider (DType.compute), looked up per operand of every op
_WIDER = {d.numpy: d.compute.numpy for d in DType if d.compute is not d}


def evaluate_op(kind: str, arrays: Sequence[np.ndarray], attrs: Mapping[str, Any],
                result_types: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    """One op's numpy semantics, with results cast to and checked against their declared types."""
    with np.errstate(all="ignore"):
        return _evaluate(kind, arrays, attrs, result_types)


def _evaluate(kind: str, arrays: Sequence[np.ndarray], attrs: Mapping[str, Any],
              result_types: Sequence[TensorType]) -> tuple[np.ndarray, ...]:
    """`evaluate_op` under the caller's `np.errstate(all="ignore")`, which a run enters once, not per op."""
    widened = [a.astype(_WIDER[a.dtype]) if a.dtype in _WIDER else a for a in arrays]
    try:
        outs = registry.lookup(kind).reference(widened, attrs)
    except (IndexError, ValueError) as e:
        raise ShapeError(f"{kind}: {e}") from None
    results = []
    for out, t in zip(outs, result_types):
        if out.__class__ is not np.ndarray:
            out = np.asarray(out)
        want = t.dtype.numpy
        if out.dtype is not want and out.dtype != want:  # numpy's builtin dtypes are singletons: mostly `is`
            out = out.astype(want)
        if out.shape != t.shape and not t.matches(out.shape):  # equal tuples: a static type, checked in C
            raise ShapeError(f"{kind}: produced shape {list(out.shape)} but its type is {t}")
        results.append(out)
    return tuple(results)


def param_value(p: ParamNode) -> np.ndarray:
    """A parameter's data, running its lazy initializer (seeded by its ParamId) when it has none."""
    if p.data is not None:
        return p.data
    if p.init is None:
        raise ShapeError(f"param @{p.name} has neither data nor an initializer")
    return initializers.evaluate(p.init, p.type, p.id)


class Interpreter:
    """Evaluates functions of one graph; symbol values are computed once per interpreter."""

    def __init__(self, graph: Graph, overrides: Mapping[str, np.ndarray] | None = None):
        self.graph = graph
        self.symbol: SymbolResolver[np.ndarray] = SymbolResolver(
            graph, param_value, lambda flag: np.asarray(flag.value),
            lambda node, operands, _: evaluate_op(node.kind, operands, node.attrs, [node.type])[0], overrides)

    def run(self, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0
            ) -> tuple[np.ndarray, ...]:
        """Run `function` on `inputs`; `seed` drives stochastic ops (dropout) reproducibly."""
        fn = self.graph.functions.get(function)
        if fn is None:
            raise ShapeError(f"module @{self.graph.name} has no function @{function}")
        if len(inputs) != len(fn.args):
            raise ShapeError(f"@{function} takes {len(fn.args)} inputs, got {len(inputs)}")
        env: dict[Value, np.ndarray] = {}  # keyed by the Value itself: identity hashing in C, no id() call
        for arg, x in zip(fn.args, inputs):
            x = np.asarray(x)
            if x.dtype != arg.type.dtype.numpy or not arg.type.matches(x.shape):
                raise ShapeError(f"@{function} input %{arg.name} expects {arg.type}, got shape "
                                 f"{list(x.shape)} dtype {x.dtype}")
            env[arg] = x
        check_named_dims([a.type for a in fn.args], [env[a].shape for a in fn.args],
                         [f"@{function} input %{a.name}" for a in fn.args])
        symbol = self.symbol
        with run_seed(seed), np.errstate(all="ignore"):
            for op in fn.ops:
                arrays = [env[o] if o.__class__ is Value else symbol(o.name) for o in op.operands]  # type: ignore[index]
                outs = _evaluate(op.kind, arrays, op.attrs, [r.type for r in op.results])
                for r, out in zip(op.results, outs):
                    env[r] = out
        return tuple(env[r] if r.__class__ is Value else symbol(r.name) for r in fn.results)  # type: ignore[index]


def interpret(graph: Graph, inputs: Sequence[np.ndarray], function: str = "forward", seed: int = 0
              ) -> tuple[np.ndarray, ...]:
    """Run one function of `graph` on numpy inputs with the reference semantics."""
    return Interpreter(graph).run(inputs, function, seed)
