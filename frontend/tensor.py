"""kiln.Tensor: a lazy value. Operations record a DAG; `numpy()` lowers it to an IR function and runs it.

The same DAG serves tracing: under `trace`, parameters and flags are symbol leaves and inputs are
function arguments, so a module's `forward` written once both runs eagerly and traces into IR.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.ir import DType, FunctionBuilder, Graph, KilnError, ShapeError, TensorType, Trait, registry
from kiln.ir.location import FileLoc, located
from kiln.runtime.backend import default_backend

from . import indexing
from .autograd import backward
from .dag import Node, lower, topological
from .device import Device, as_device
from .gradients import Gradients
from .tracing import current_trace, user_frame

_seeds = itertools.count(1)


class Tensor:
    """A lazy tensor on a device; every registered op is available as a method (`x.relu()`, `x.sum(axes=[1])`)."""

    __slots__ = ("node", "index", "device")
    __array_ufunc__ = None  # `array < t` and `array + t` defer to the Tensor's operators instead of realizing it

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
        """Realize the value (compiling the pending DAG through the default backend) and return it; computing on a
        device this machine lacks is an error."""
        if self.node.data is None:
            self.device.require_present()
            _realize(self.node)
        data = self.node.data
        assert data is not None
        return data[self.index] if isinstance(data, tuple) else data

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """`np.asarray(t)` realizes the tensor (rather than wrapping it in an object array)."""
        arr = self.numpy()
        return arr.astype(dtype) if dtype is not None else arr.copy() if copy else arr

    def item(self) -> Any:
        """The value of a one-element tensor as a Python scalar."""
        arr = self.numpy()
        if arr.size != 1:
            raise ValueError(f"only a one-element tensor converts to a Python scalar, not {self.type} "
                             f"({arr.size} elements)")
        return arr.item()

    def __float__(self) -> float: return float(self.item())
    def __int__(self) -> int: return int(self.item())
    def __bool__(self) -> bool: return bool(self.item())

    def __len__(self) -> int:
        """The first dim, as for a numpy array."""
        if self.type.rank == 0:
            raise TypeError(f"len() of a 0-d tensor ({self.type})")
        if self.shape[0] is None:
            raise TypeError(f"len() of {self.type}: its first dim is dynamic")
        return self.shape[0]

    def __iter__(self) -> Iterator[Tensor]:
        return (self[i] for i in range(len(self)))

    def __getitem__(self, key: Any) -> Tensor:
        """numpy indexing: integers, slices (negative and stepped), '...', None, or a boolean mask known now."""
        mask = _known_mask(key)
        p = indexing.plan_mask(self.shape, mask) if mask is not None else indexing.plan(self.shape, key)
        out = self if p.slice is None else apply("slice", self, **p.slice)
        for axis, i in p.takes:
            out = apply("take", out, np.asarray(i, np.int64), axis=axis)
        if p.reshape is not None:
            out = apply("reshape", out, shape=p.reshape)
        return out if p.mask is None else apply("take", out, p.mask, axis=0)

    @property
    def T(self) -> Tensor:
        """The dims reversed, as numpy's `.T`."""
        return apply("transpose", self)

    def reshape(self, *shape: Any, **attrs: Any) -> Tensor:
        """`x.reshape(3, 2)`, `x.reshape((3, 2))` or `x.reshape(shape=(3, 2))`; one -1 is inferred.
        `x.reshape(-1, -1, 12, 64, like=h, copy=(0, 1, -1, -1))` takes dims 0 and 1 from `h` (a traced `?` dim too)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        if shape:
            if "shape" in attrs:
                raise TypeError("reshape: give the shape positionally or as shape=, not both")
            attrs["shape"] = shape
        like = attrs.pop("like", None)
        return apply("reshape", self, *([] if like is None else [like]), **attrs)

    def backward(self) -> Gradients:
        """The gradients of this scalar loss for every parameter that requires them, keyed by ParamId."""
        self.device.require_present()
        return backward(self, self.device.name)

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

    # comparisons give bool tensors, so hashing stays by identity (kiln never compares Tensors with ==)
    __hash__ = object.__hash__
    def __eq__(self, o: Any) -> Tensor: return apply("equal", self, o)  # type: ignore[override]
    def __ne__(self, o: Any) -> Tensor: return ~apply("equal", self, o)  # type: ignore[override]
    def __lt__(self, o: Any) -> Tensor: return apply("less", self, o)
    def __gt__(self, o: Any) -> Tensor: return apply("greater", self, o)
    def __le__(self, o: Any) -> Tensor: return apply("less", self, o) | apply("equal", self, o)
    def __ge__(self, o: Any) -> Tensor: return apply("greater", self, o) | apply("equal", self, o)

    # logic on bool tensors, from `where` and `equal`
    def __invert__(self) -> Tensor: return apply("equal", _bool("~", self), False)
    def __and__(self, o: Any) -> Tensor: return apply("where", _bool("&", self), _bool("&", o), False)
    def __or__(self, o: Any) -> Tensor: return apply("where", _bool("|", self), True, _bool("|", o))
    def __xor__(self, o: Any) -> Tensor: return ~apply("equal", _bool("^", self), _bool("^", o))
    __rand__, __ror__, __rxor__ = __and__, __or__, __xor__

    def __getattr__(self, kind: str):
        if kind.startswith("_") or kind not in registry.registered():
            raise AttributeError(kind)
        return lambda *operands, **attrs: apply(kind, self, *operands, **attrs)


def _bool(op: str, x: Any) -> Any:
    """`x` if it is boolean (a bool tensor, array or Python bool); logical operators take nothing else."""
    dtype = x.dtype if isinstance(x, Tensor) else DType.from_numpy(np.asarray(x).dtype)
    if dtype is not DType.bool:
        raise TypeError(f"operator {op} needs bool operands, got {dtype.value} (compare first, e.g. x > 0)")
    return x


def _known_mask(key: Any) -> np.ndarray | None:
    """A boolean index array whose value is known now (a list, a numpy array or a realized tensor), else None.

    A lazy boolean tensor is refused: the result's shape would be its count of True values, known only at run
    time."""
    if isinstance(key, Tensor):
        if key.dtype is not DType.bool:
            raise IndexError(f"indexing with a {key.type} tensor: only a boolean mask tensor indexes (use .take "
                             f"for integer indices)")
        if key.node.data is None:
            raise IndexError("indexing with a lazy boolean mask: the result's shape is its count of True values, "
                             "known only at run time; realize the mask first (mask.numpy())")
        return key.numpy()
    if isinstance(key, (list, np.ndarray)):
        arr = np.asarray(key)
        if arr.dtype != np.bool_:
            raise IndexError(f"indexing with a {arr.dtype} array is not supported: index with integers, slices or "
                             f"a boolean mask (use .take for integer indices)")
        return arr
    return None


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


def _operand(kind: str, o: Any, like: Tensor) -> np.ndarray:
    """A non-Tensor operand as an array: an array keeps its dtype (bf16 and other extension dtypes included), a
    Python number or list takes `like`'s dtype, which must hold its value exactly when it is not a float."""
    if isinstance(o, np.ndarray):
        return o
    raw = np.asarray(o)
    if raw.dtype.kind not in "biuf":
        raise TypeError(f"{kind}: operand {o!r} is neither a Tensor nor a number or array")
    arr = raw.astype(like.dtype.numpy)
    if not like.dtype.is_float and not np.array_equal(arr, raw):
        raise TypeError(f"{kind}: operand {o!r} is not a {like.dtype.value} value, the dtype of {like.type}; "
                        f"convert one side explicitly (.cast(dtype=...))")
    return arr


def apply(kind: str, *operands: Any, **attrs: Any) -> Tensor | tuple[Tensor, ...]:
    """Record one op; type inference runs now so shape errors point at the user's line. While tracing, the op
    carries that line and the module path as its location."""
    first = next(o for o in operands if isinstance(o, Tensor))
    inputs = [o if isinstance(o, Tensor) else leaf(_operand(kind, o, first), first.device) for o in operands]
    trace = current_trace()
    loc = trace.location() if trace is not None else None
    if registry.lookup(kind).has(Trait.STOCHASTIC) and "seed" not in attrs:
        attrs["seed"] = next(_seeds if trace is None else trace.op_seeds)
    try:
        full, types = registry.infer(kind, [t.type for t in inputs], attrs)
    except ShapeError as e:
        frame = user_frame() if loc is None else None
        raise located(loc if frame is None else FileLoc(*frame), e) from None
    node = Node(kind, tuple((t.node, t.index) for t in inputs), full, types,
                autodiff=any(t.node.autodiff for t in inputs), require_grad=any(t.node.require_grad for t in inputs),
                loc=loc)
    outs = tuple(Tensor(node, i, first.device) for i in range(len(types)))
    return outs[0] if len(outs) == 1 else outs


def _realize(node: Node) -> None:
    if any(n.kind in ("input", "symbol") for n in topological([node])):
        raise KilnError(f"{Tensor(node)!r} depends on a traced input or parameter, so it has no value while tracing "
                        f"(Python control flow on tensor values, such as `if t:` or float(t), cannot be traced)")
    fb = FunctionBuilder("forward", lambda name: None)
    outputs = [Tensor(node, i) for i in range(len(node.types))]
    results, feeds = lower(fb, outputs, data_as_inputs=True)
    graph = Graph("eager", functions={"forward": fb.finish(results)})
    outs = default_backend().run(graph, feeds, seed=next(_seeds))
    if not node.require_grad:  # a value gradients flow through keeps its recipe for backward
        node.kind, node.inputs, node.attrs = "data", (), {}
    node.data = outs[0] if len(outs) == 1 else tuple(outs)
