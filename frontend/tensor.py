"""kiln.Tensor: a lazy value. Operations record a DAG; `numpy()` lowers it to an IR function and runs it.

The same DAG serves tracing: under `trace`, parameters and flags are symbol leaves and inputs are
function arguments, so a module's `forward` written once both runs eagerly and traces into IR.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kiln.ir import DType, FunctionBuilder, Graph, TensorType, Trait, registry
from kiln.runtime.backend import default_backend

from .autograd import backward
from .dag import Node, lower
from .device import Device, as_device
from .gradients import Gradients

_seeds = itertools.count(1)


class Tensor:
    """A lazy tensor on a device; every registered op is available as a method (`x.relu()`, `x.sum(axes=[1])`)."""

    __slots__ = ("node", "index", "device")

    def __init__(self, node: Node, index: int = 0, device: Device | None = None):
        self.node, self.index, self.device = node, index, device or Device("cpu")

    @property
    def type(self) -> TensorType:
        return self.node.types[self.index]

    @property
    def shape(self) -> tuple[int | None, ...]:
        return self.type.shape

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def is_autodiff(self) -> bool:
        return self.node.autodiff

    def is_require_grad(self) -> bool:
        return self.node.require_grad

    def numpy(self) -> np.ndarray:
        """Realize the value (compiling the pending DAG through the default backend) and return it."""
        if self.node.data is None:
            _realize(self.node)
        data = self.node.data
        assert data is not None
        return data[self.index] if isinstance(data, tuple) else data

    def item(self) -> Any:
        return self.numpy().item()

    def backward(self) -> Gradients:
        """The gradients of this scalar loss for every parameter that requires them, keyed by ParamId."""
        return backward(self)

    def __repr__(self) -> str:
        return f"Tensor({self.type}, device={self.device})"

    # operators ------------------------------------------------------------------------------------
    def __add__(self, o: Any) -> Tensor: return apply("add", self, o)
    def __radd__(self, o: Any) -> Tensor: return apply("add", o, self)
    def __sub__(self, o: Any) -> Tensor: return apply("sub", self, o)
    def __rsub__(self, o: Any) -> Tensor: return apply("sub", o, self)
    def __mul__(self, o: Any) -> Tensor: return apply("mul", self, o)
    def __rmul__(self, o: Any) -> Tensor: return apply("mul", o, self)
    def __truediv__(self, o: Any) -> Tensor: return apply("div", self, o)
    def __rtruediv__(self, o: Any) -> Tensor: return apply("div", o, self)
    def __pow__(self, o: Any) -> Tensor: return apply("pow", self, o)
    def __matmul__(self, o: Any) -> Tensor: return apply("matmul", self, o)
    def __neg__(self) -> Tensor: return apply("neg", self)

    def __getattr__(self, kind: str):
        if kind.startswith("_") or kind not in registry.registered():
            raise AttributeError(kind)
        return lambda *operands, **attrs: apply(kind, self, *operands, **attrs)


def tensor(data: Any, dtype: DType | str | None = None, device: Device | str | None = None) -> Tensor:
    """A realized tensor holding a copy of `data`."""
    arr = np.array(data, dtype=(DType(dtype) if isinstance(dtype, str) else dtype).numpy if dtype else None)
    if arr.dtype == np.float64 and dtype is None and not isinstance(data, np.ndarray):
        arr = arr.astype(np.float32)  # Python floats default to f32, as in every DL framework
    return leaf(arr, as_device(device))


def leaf(arr: np.ndarray, device: Device, autodiff: bool = False, require_grad: bool = False,
         param_id: int | None = None, autodiff_node: int | None = None) -> Tensor:
    t = TensorType(tuple(arr.shape), DType.from_numpy(arr.dtype))
    node = Node("data", (), {}, (t,), arr, autodiff=autodiff, require_grad=require_grad, param_id=param_id,
                autodiff_node=autodiff_node)
    return Tensor(node, 0, device)


def symbol(name: str, type: TensorType, device: Device, autodiff: bool = False, require_grad: bool = False
           ) -> Tensor:
    """A leaf standing for a parameter or flag of the module being traced."""
    return Tensor(Node("symbol", (), {}, (type,), name=name, autodiff=autodiff, require_grad=require_grad), 0,
                  device)


def placeholder(name: str, type: TensorType, device: Device) -> Tensor:
    return Tensor(Node("input", (), {}, (type,), name=name), 0, device)


def apply(kind: str, *operands: Any, **attrs: Any) -> Tensor | tuple[Tensor, ...]:
    """Record one op; type inference runs now so shape errors point at the user's line."""
    first = next(o for o in operands if isinstance(o, Tensor))
    inputs = []
    for o in operands:
        if not isinstance(o, Tensor):
            arr = np.asarray(o, dtype=first.dtype.numpy if not isinstance(o, np.ndarray) else None)
            o = leaf(arr, first.device)
        inputs.append(o)
    if registry.lookup(kind).has(Trait.STOCHASTIC) and "seed" not in attrs:
        attrs["seed"] = next(_seeds)
    full, types = registry.infer(kind, [t.type for t in inputs], attrs)
    node = Node(kind, tuple((t.node, t.index) for t in inputs), full, types,
                autodiff=any(t.node.autodiff for t in inputs), require_grad=any(t.node.require_grad for t in inputs))
    outs = tuple(Tensor(node, i, first.device) for i in range(len(types)))
    return outs[0] if len(outs) == 1 else outs


def _realize(node: Node) -> None:
    fb = FunctionBuilder("forward", lambda name: None)
    outputs = [Tensor(node, i) for i in range(len(node.types))]
    results, feeds = lower(fb, outputs, data_as_inputs=True)
    graph = Graph("eager", functions={"forward": fb.finish(results)})
    outs = default_backend().run(graph, feeds, seed=next(_seeds))
    if not node.require_grad:  # a value gradients flow through keeps its recipe for backward
        node.kind, node.inputs, node.attrs = "data", (), {}
    node.data = outs[0] if len(outs) == 1 else tuple(outs)
