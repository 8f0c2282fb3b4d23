"""The optimizer base: an update rule written once as IR emission, per-parameter state by ParamId, the eager step
(a small graph run through the backend) and the state as a ModuleRecord.

A subclass defines `state_names` and `update(fb, param, grad, state, lr)`, which emits the ops computing the new
parameter and new state from values of `fb`. The eager `step` and the captured step (`kiln.compile_step`) both
emit through `emit_step`, so there is one implementation of every formula.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kiln.ir import DType, FunctionBuilder, Graph, TensorType, Value
from kiln.ir.gradients import emit
from kiln.runtime.backend import default_backend
from kiln.runtime.records.record import ModuleRecord, RecordEntry

from ..module import Module, ModuleMapper
from ..param import LazyState, Param, new_autodiff_node
from .clipping import GradientClipping

State = dict[str, np.ndarray]
_runs = itertools.count(1)


def lr_type() -> TensorType:
    """The learning rate: a run-time f64 scalar (a schedule never changes the compiled step), so scalar
    arithmetic on it runs in double precision as torch's Python-float hyper-parameters do."""
    return TensorType((), DType.f64)


def scalar(fb: FunctionBuilder, value: float, like: Value) -> Value:
    """A constant scalar of `like`'s dtype."""
    return fb.constant(value, like.type.dtype)


def cast_like(fb: FunctionBuilder, v: Value, like: Value) -> Value:
    """v in `like`'s dtype."""
    return v if v.type.dtype is like.type.dtype else emit(fb, "cast", v, dtype=like.type.dtype)


class _Assign(ModuleMapper):
    def __init__(self, values: Mapping[int, np.ndarray]):
        self.values = values

    def map_param(self, path: str, param: Param) -> Param:
        value = self.values.get(param.id)
        if value is None:
            return param
        return param.replace(state=LazyState(param.type, None, param.device, param.id, value),
                             autodiff_node=new_autodiff_node())


def with_values(module: Module, values: Mapping[int, np.ndarray]) -> Module:
    """`module` whose parameters with an id in `values` hold those values as fresh autodiff leaves, as Burn's
    optimizer returns them (everything else about them kept)."""
    return module.map(_Assign(values))


class Optimizer:
    """Per-parameter state by ParamId; `step(lr, module, grads)` returns the updated module."""

    state_names: tuple[str, ...] = ()

    def __init__(self, grad_clipping: GradientClipping | None = None):
        self.grad_clipping = grad_clipping
        self.state: dict[int, State] = {}
        self.paths: dict[int, str] = {}

    def init_state(self, t: TensorType) -> State:
        """A parameter's state before its first step: zeros of its type."""
        return {name: np.zeros(t.shape, t.dtype.numpy) for name in self.state_names}  # type: ignore[arg-type]

    def update(self, fb: FunctionBuilder, param: Value, grad: Value, state: dict[str, Value], lr: Value
               ) -> tuple[Value, dict[str, Value]]:
        """Emit one parameter's update; returns the new parameter and new state."""
        raise NotImplementedError

    def emit_step(self, fb: FunctionBuilder, params: Sequence[Value], grads: Sequence[Value],
                  states: Sequence[dict[str, Value]], lr: Value, clipped: bool = False
                  ) -> list[tuple[Value, dict[str, Value]]]:
        """Clip the gradients (if configured, unless the caller has: `clipped`) and emit every parameter's update."""
        if self.grad_clipping is not None and not clipped:
            grads = self.grad_clipping.emit(fb, grads)
        return [self.update(fb, p, g, s, lr) for p, g, s in zip(params, grads, states)]

    def state_for(self, path: str, param: Param) -> State:
        """The parameter's state, made on its first step."""
        self.paths[param.id] = path
        if param.id not in self.state:
            self.state[param.id] = self.init_state(param.type)
        return self.state[param.id]

    @staticmethod
    def require_leaves(params: Iterable[tuple[str, Param]]) -> None:
        """Refuse to train an intermediary: a tracked parameter `to_device` moved is no leaf (Burn's "you can't
        optimize it with gradient descent"); the fix is `fork`."""
        for path, p in params:
            if not p.leaf:
                raise ValueError(f"parameter {path!r} is not a leaf: its module came from to_device, an intermediary "
                                 "model gradient descent can't optimize; use fork to train on another device")

    def step(self, lr: float, module: Module, grads: Mapping[int, np.ndarray]) -> Module:
        """Update every parameter of `module` that has a gradient in `grads`; returns the new module."""
        trained = [(path, p) for path, p in module.leaves() if isinstance(p, Param) and p.id in grads]
        self.require_leaves(trained)
        if not trained:
            return module
        fb = FunctionBuilder("step", lambda name: None)
        params, gvals, states, feeds = [], [], [], []
        for i, (path, p) in enumerate(trained):
            state = self.state_for(path, p)
            params.append(fb.input(f"param{i}", p.type))
            gvals.append(fb.input(f"grad{i}", p.type))
            states.append({n: fb.input(f"state{i}.{n}", TensorType(a.shape, DType.from_numpy(a.dtype)))
                           for n, a in state.items()})
            feeds += [p.state.get(), np.asarray(grads[p.id], p.type.dtype.numpy), *state.values()]
        lr_value = fb.input("lr", lr_type())
        updates = self.emit_step(fb, params, gvals, states, lr_value)
        results = [v for new, new_state in updates for v in (new, *new_state.values())]
        graph = Graph("optimizer", functions={"step": fb.finish(results)})
        outs = iter(default_backend().run(graph, [*feeds, np.float64(lr)], "step", seed=next(_runs)))
        values = {}
        for (_, p), (_, new_state) in zip(trained, updates):
            values[p.id] = next(outs)
            self.state[p.id] = {n: next(outs) for n in new_state}
        return with_values(module, values)

    # records ----------------------------------------------------------------------------------------
    def to_record(self) -> ModuleRecord:
        """The state as a record: `<param path>.<state name>` entries whose ids are the parameters' ids."""
        return ModuleRecord({f"{self.paths[pid]}.{name}": RecordEntry(pid, DType.from_numpy(a.dtype), a.shape, a)
                             for pid, state in self.state.items() for name, a in state.items()})

    def load_record(self, record: ModuleRecord) -> Optimizer:
        """An optimizer of the same configuration holding the record's state; the receiver is unchanged."""
        new = copy.copy(self)
        new.state, new.paths = {}, {}
        for path, entry in record.items():
            param_path, _, name = path.rpartition(".")
            if name not in self.state_names:
                raise ValueError(f"record entry {path!r}: {type(self).__name__} has no state {name!r}")
            new.paths[entry.param_id] = param_path
            new.state.setdefault(entry.param_id, {})[name] = np.array(entry.array())
        return new
