"""Param and Flag: the module-owned values, with Burn's lazy-initialization and gradient semantics.

A Param's value lives in a `LazyState` that clones share, so a shared lazy parameter initializes once and
every clone sees the same value. Params are immutable: state changes make new Params.

A Param's file form (records, state dicts) may differ from its live form (Burn's param_mapper): a declarative
`Layout` travels into the graph (`.kir`, traces, every pass), while Python load/save callables (a
`ParamMapper`) stay on the Param, frontend only: a trace's graph never sees them. A Param takes one or the
other, so the order of the two is never a question. An init mapper composes onto the lazy initializer (it
becomes a Python one, `init = python` in a trace) without running it.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Init, ParamId, ParamNode, ShapeError, TensorType, new_param_id, registry
from kiln.ir import init as initializers
from kiln.ir.layout import Layout

from .device import Device, as_device
from .tensor import Tensor, apply, leaf, symbol
from .tracing import current_trace

_autodiff_nodes = itertools.count(1)


def new_autodiff_node() -> int:
    """A fresh autodiff leaf identity (Burn's tensor node id): what tells a parameter from its fork, which keeps
    the ParamId."""
    return next(_autodiff_nodes)


class LazyState:
    """A parameter's value or the recipe for it; initializes at most once, on `device`."""

    def __init__(self, type: TensorType, init: Init | None, device: Device, seed: int,
                 value: np.ndarray | None = None):
        self.type, self.init, self.device, self.seed, self.value = type, init, device, seed, value
        self.shared = False  # set when a clone of the owning module shares this state
        self._lock = threading.Lock()

    def get(self) -> np.ndarray:
        with self._lock:
            if self.value is None:
                if self.init is None:
                    raise ValueError("parameter has neither a value nor an initializer")
                self.value = initializers.evaluate(self.init, self.type, self.seed)
            return self.value

    def moved(self, device: Device) -> LazyState:
        """An independent state on `device`: lazy stays lazy, a value is copied."""
        return LazyState(self.type, self.init, device, self.seed, None if self.value is None else self.value.copy())


ArrayMap = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ParamMapper:
    """Python callables between a parameter's live value and its file form: `load` maps a record's array to the
    live value (checked against the live shape afterwards), `save` maps the live value to what records hold."""

    load: ArrayMap | None = None
    save: ArrayMap | None = None


def _initial(init: Init | initializers.PythonInit) -> Init:
    """A built-in initializer checked, or a Python callable `fn(shape, dtype, rng)` wrapped as one."""
    return initializers.check(init) if isinstance(init, Init) else initializers.python(init)


def _exclusive(layout: Layout | None, mapper: ParamMapper | None) -> None:
    if layout is not None and mapper is not None and (mapper.load or mapper.save):
        raise ShapeError(f"a Param takes a Layout ({layout}) or Python load/save mappers, not both")


@dataclass(frozen=True, eq=False)
class Reparam:
    """A derivation of a parameter's effective value from its base: an op kind, factor Params, attributes."""

    kind: str
    factors: tuple[tuple[str, Param], ...]  # (path suffix like "lora.a", factor)
    attrs: dict = field(default_factory=dict)
    inner: Reparam | None = None  # the base's own derivation: a quantized base's dequantize under QLoRA

    def with_factors(self, factors: tuple[tuple[str, Param], ...]) -> Reparam:
        return dataclasses.replace(self, factors=factors)

    def chain(self) -> list[Reparam]:
        """The derivations from the stored base outwards."""
        return (self.inner.chain() if self.inner is not None else []) + [self]


@dataclass(frozen=True, eq=False)
class Param:
    """A tensor parameter: ParamId, shared lazy state, device and gradient state (effective and configured)."""

    id: ParamId
    state: LazyState
    device: Device
    grad: bool = False
    configured_grad: bool = False
    leaf: bool = True  # False after to_device moved a tracked value: an intermediary the optimizer can't train
    # the autodiff leaf the value is read from: kept by every transition (to_device's gradients flow back to it)
    # except fork, which starts the output's own graph
    autodiff_node: int = field(default_factory=new_autodiff_node)
    reparam: Reparam | None = None
    buffer: bool = False  # running state: recorded and moved like a parameter, never trained
    layout: Layout | None = None  # the file form in records, declared as data (in the graph too)
    mapper: ParamMapper | None = None  # Python load/save mappers: frontend only, never in a graph

    def __post_init__(self) -> None:
        if self.layout is not None:
            self.layout.check(self.state.type.shape)
        _exclusive(self.layout, self.mapper)

    @staticmethod
    def lazy(shape: tuple[int, ...], init: Init | initializers.PythonInit, dtype: DType | str = DType.f32,
             device: Device | str | None = None, require_grad: bool = True, id: int | None = None,
             layout: Layout | None = None) -> Param:
        """An uninitialized parameter: nothing is allocated until its value is needed. `init` is a built-in
        `Init` or a callable `fn(shape, dtype, rng) -> array`, `rng` a numpy Generator seeded from the ParamId."""
        device = as_device(device)
        dtype = DType(dtype) if isinstance(dtype, str) else dtype
        pid = new_param_id() if id is None else ParamId(id)
        state = LazyState(TensorType(tuple(shape), dtype), _initial(init), device, pid)
        return Param(pid, state, device, require_grad and device.autodiff_enabled and dtype.is_float,
                     require_grad and dtype.is_float, layout=layout)

    @staticmethod
    def from_data(data: np.ndarray, device: Device | str | None = None, require_grad: bool = True,
                  id: int | None = None, layout: Layout | None = None) -> Param:
        device = as_device(device)
        arr = np.asarray(data)
        dtype = DType.from_numpy(arr.dtype)
        pid = new_param_id() if id is None else ParamId(id)
        state = LazyState(TensorType(tuple(arr.shape), dtype), None, device, pid, arr)
        return Param(pid, state, device, require_grad and device.autodiff_enabled and dtype.is_float,
                     require_grad and dtype.is_float, layout=layout)

    # Burn's param_mapper ----------------------------------------------------------------------------
    def with_layout(self, layout: Layout | None) -> Param:
        """This parameter recorded in `layout`'s file form (None: the live form)."""
        return self.replace(layout=layout)

    def load_mapper(self, fn: ArrayMap) -> Param:
        """Map a record's array through `fn` when loading (Burn's `load_mapper`)."""
        return self.replace(mapper=dataclasses.replace(self.mapper or ParamMapper(), load=fn))

    def save_mapper(self, fn: ArrayMap) -> Param:
        """Map the live value through `fn` when recording (Burn's `save_mapper`)."""
        return self.replace(mapper=dataclasses.replace(self.mapper or ParamMapper(), save=fn))

    def init_mapper(self, fn: ArrayMap) -> Param:
        """Map the initial value through `fn` (same shape, same kind of dtype): composed onto a lazy initializer
        without running it, applied now to an initialized value (Burn's `init_mapper`). The result is a new
        untracked leaf with its own state."""
        s = self.state
        if s.value is not None:
            value = initializers.checked(fn(s.value), s.type, self.id, fn, "init mapper")
            state = LazyState(s.type, None, s.device, s.seed, value)
        else:
            inner, pid = s.init, self.id

            def mapped(shape: tuple[int, ...], dtype: DType, rng: np.random.Generator) -> np.ndarray:
                t = TensorType(shape, dtype)
                return initializers.checked(fn(initializers.sample(inner, t, rng, pid)), t, pid, fn, "init mapper")
            state = LazyState(s.type, initializers.python(mapped), s.device, s.seed)
        return self.replace(state=state, leaf=True, autodiff_node=new_autodiff_node())

    @staticmethod
    def running(shape: tuple[int, ...], init: Init, device: Device | str | None = None) -> Param:
        """A running-state buffer (e.g. batch-norm statistics): lazy, never requires gradients."""
        return Param.lazy(shape, init, device=device, require_grad=False).replace(buffer=True)

    def update(self, value: np.ndarray | Tensor) -> None:
        """Overwrite a buffer's value in place, as Burn's RunningState does; clones sharing it see the update.
        While tracing, the new value is recorded as the trace's update of this buffer instead."""
        if not self.buffer:
            raise ValueError("only running-state buffers are updated in place; parameters are values")
        trace = current_trace()
        if trace is None:
            self.state.value = np.asarray(value.numpy() if isinstance(value, Tensor) else value,
                                          self.type.dtype.numpy)
        elif id(self) in trace.paths:
            trace.updates[trace.paths[id(self)]] = value

    @staticmethod
    def from_node(node: ParamNode) -> Param:
        """A Param holding a graph node's state (its data, or its initializer, stays lazy)."""
        device = Device(node.device, node.autodiff, node.checkpointing)
        return Param(node.id, LazyState(node.type, node.init, device, node.id, node.data), device, node.grad,
                     node.configured_grad, buffer=node.buffer, layout=node.layout)

    @property
    def type(self) -> TensorType:
        return self.state.type

    def lazy_shape(self) -> tuple[int, ...]:
        return self.state.type.shape  # type: ignore[return-value]

    def lazy_device(self) -> Device:
        """The device the value lives or will initialize on, without initializing it."""
        return self.device

    def is_initialized(self) -> bool:
        return self.state.value is not None

    def numel(self) -> int:
        return self.state.type.numel()

    def base(self) -> Tensor:
        """The stored value, without any reparameterization."""
        return leaf(self.state.get(), self.device, self.device.autodiff_enabled, self.grad, self.id,
                    self.autodiff_node)

    @property
    def value_type(self) -> TensorType:
        """The type of the effective value: the stored type carried through every derivation."""
        t = self.type
        for r in self.reparam.chain() if self.reparam is not None else []:
            _, (t,) = registry.infer(r.kind, [t, *(f.type for _, f in r.factors)], r.attrs)
        return t

    def trainable(self) -> bool:
        """Whether this parameter or any factor of its derivations requires gradients."""
        chain = self.reparam.chain() if self.reparam is not None else []
        return self.grad or any(f.grad for r in chain for _, f in r.factors)

    def val(self) -> Tensor:
        """The effective value (base through its derivations); a graph symbol while tracing."""
        trace = current_trace()
        if trace is not None and id(self) in trace.paths:
            return symbol(trace.paths[id(self)], self.value_type, self.device, self.device.autodiff_enabled,
                          self.trainable())
        value = self.base()
        for r in self.reparam.chain() if self.reparam is not None else []:
            value = apply(r.kind, value, *(f.val() for _, f in r.factors), **r.attrs)
        return value

    def replace(self, **changes) -> Param:
        return dataclasses.replace(self, **changes)

    def __repr__(self) -> str:
        state = "initialized" if self.is_initialized() else "lazy"
        derived = f", derived by {'/'.join(r.kind for r in self.reparam.chain())}" if self.reparam else ""
        return f"Param({ParamId(self.id)}, {self.type}, {self.device}, grad={self.grad}, {state}{derived})"


@dataclass(frozen=True, eq=False)
class Flag:
    """A module-owned control value (dropout, batch-norm statistics): effective and configured state."""

    value: bool = True
    configured: bool = True
    id: ParamId = field(default_factory=new_param_id)

    def is_enabled(self) -> bool:
        return self.value

    def tensor(self) -> Tensor:
        """The flag as a bool scalar tensor; a symbol of the graph while tracing."""
        trace = current_trace()
        if trace is not None and id(self) in trace.paths:
            return symbol(trace.paths[id(self)], TensorType((), DType.bool), Device("cpu"))
        return leaf(np.asarray(self.value), Device("cpu"))

    def replace(self, **changes) -> Flag:
        return dataclasses.replace(self, **changes)
