"""The captured training step: forward, loss, backward and optimizer update traced once into ONE IR function.

`compile_step(model, loss_fn, optimizer, *input_specs)` traces `loss_fn(model, *inputs)` (first result: the
scalar loss), differentiates it with the gradient pipeline `Tensor.backward` runs, and emits the optimizer's
update rules after the backward. The `step` function takes every parameter, the optimizer state, the learning
rate and the inputs; it returns the loss (and loss_fn's other results), the new trainable parameters, the new
optimizer state and the new running-state buffers (batch-norm statistics). Between steps those arrays stay
resident in the TrainStep: no Module is rebuilt until `model()` asks for one.

The step re-traces only when an input's shape or dtype leaves the traced type, or when `load_model` brings a
module whose state differs (train/valid, freeze, require-grad, reparameterizations); each re-trace is counted in
`retraces` and logged on the `kiln.step` logger with its reason.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import DType, FunctionBuilder, Graph, Operand, Rewriter, SymRef, TensorType, verify
from kiln.ir.ops.collective import Communicator, communicating
from kiln.ir.ops.random import rank_seed
from kiln.ir.symbols import SymbolResolver
from kiln.passes.data_parallel import DataParallel, SyncBatchNorm, owners
from kiln.runtime.backend import default_backend

from .autograd import differentiate, warn_if_untrainable
from .module import Module
from .optim.accumulation import GradientAccumulation
from .optim.optimizer import Optimizer, lr_type, with_values
from .param import Param
from .tensor import Tensor
from .trace import InputSpec, as_type, trace_function

log = logging.getLogger("kiln.step")
LossFn = Callable[..., Tensor | tuple[Tensor, ...]]


def state_signature(model: Module) -> tuple:
    """What the traced step depends on in a module's state: each parameter's type, gradient and buffer state and
    checkpointing, each flag's value, each derivation (values and ParamIds excluded)."""
    graph = model.state_graph()
    return (tuple((p.name, p.type, p.grad, p.buffer, p.checkpointing) for p in graph.params.values()),
            tuple((f.name, f.value) for f in graph.flags.values()),
            tuple((r.name, r.kind, r.operands, tuple(sorted(r.attrs.items()))) for r in graph.reparams.values()))


def _changes(old: tuple, new: tuple) -> str:
    """The first few state entries that differ between two signatures, for the re-trace log line."""
    before = {entry[0]: entry for part in old for entry in part}
    after = {entry[0]: entry for part in new for entry in part}
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    return "module state changed at " + ", ".join(changed[:6]) + more


@dataclass(frozen=True)
class StepProgram:
    """The traced step: its graph and how its arguments and results line up with parameters and state."""

    graph: Graph
    param_ids: tuple[int, ...]  # every parameter, in argument order
    trained: tuple[int, ...]  # indices into param_ids of the parameters the optimizer updates, in result order
    state_names: tuple[tuple[str, ...], ...]  # per trained parameter
    buffers: tuple[int, ...]  # indices into param_ids of the buffers the step updates, in result order
    n_outputs: int  # loss_fn's results (the loss first)
    elsewhere: frozenset[int] = frozenset()  # trained indices whose optimizer state another rank keeps (ZeRO-1)

    @functools.cached_property
    def donated(self) -> frozenset[int]:
        """The arguments each step replaces with its results (trained parameters, optimizer state, updated
        buffers): the caller gives them up, so a backend may write the results into them. Computed once: every
        step passes it."""
        n_states = sum(len(names) for names in self.state_names)
        return frozenset((*self.trained, *self.buffers, *range(len(self.param_ids), len(self.param_ids) + n_states)))


def build_step(model: Module, loss_fn: LossFn, optimizer: Optimizer, input_types: Sequence[TensorType],
               data_parallel: DataParallel | None = None, rank: int = 0, world: int = 1) -> StepProgram:
    """Trace, differentiate and append the optimizer update: the one `step` function. With `data_parallel`, the
    gradients are averaged across `world` ranks first, and under ZeRO-1 this `rank` updates only its share."""
    traced, updated = trace_function(model, lambda *xs: loss_fn(model, *xs), *input_types)
    warn_if_untrainable(traced, stacklevel=4)  # the caller of the TrainStep
    if data_parallel is not None and data_parallel.sync_batch_norm:
        traced = SyncBatchNorm(data_parallel.group).apply(traced)
    graph = differentiate(traced)
    if data_parallel is not None:
        graph = data_parallel.apply(graph)
    fwd, fn = graph.functions["forward"], graph.functions["forward_backward"]
    n_forward = len(fwd.results)
    n_outputs = n_forward - len(updated)
    fb = FunctionBuilder("step", graph.symbol)
    params = list(graph.params.values())
    args = {p.name: fb.input(f"param.{p.name}", p.type) for p in params}
    trainable = [p for p in params if p.grad]
    sharded = data_parallel is not None and data_parallel.zero == 1 and world > 1
    owner = owners([p.type for p in trainable], world) if sharded else (rank,) * len(trainable)
    mine = [i for i, r in enumerate(owner) if r == rank]
    states = []
    for p in (trainable[i] for i in mine):
        init = optimizer.init_state(p.type)
        states.append({n: fb.input(f"state.{p.name}.{n}", TensorType(a.shape, DType.from_numpy(a.dtype)))
                       for n, a in init.items()})
    lr = fb.input("lr", lr_type())
    # parameters become the step's arguments, derivations are emitted from them once, flags stay symbols
    symbol: SymbolResolver[Operand] = SymbolResolver(
        graph, lambda p: args[p.name], lambda f: SymRef(f.name, f.type),
        lambda node, operands, _: fb.append(node.kind, tuple(operands), node.attrs)[0])
    copier = Rewriter(graph, fb, symbols=lambda ref: symbol(ref.name))
    out = list(copier.inline(fn, [fb.input(a.name, a.type) for a in fn.args], rename=fb.unique))
    grads = out[n_forward:]
    clipping = optimizer.grad_clipping if sharded else None
    if sharded and isinstance(optimizer, GradientAccumulation) and optimizer.inner.grad_clipping is not None:
        raise ValueError("ZeRO-1 (data-parallel zero=1) cannot clip accumulated gradients: the norm of the mean is "
                         "over every parameter's gradient sum, and each rank keeps only its share of the sums")
    if clipping is not None:  # the global norm: after the all-reduce every rank holds every averaged gradient
        grads = clipping.emit(fb, grads)  # type: ignore[arg-type]
    updates = optimizer.emit_step(fb, [args[trainable[i].name] for i in mine], [grads[i] for i in mine],  # type: ignore[arg-type]
                                  states, lr, clipped=clipping is not None)
    new_params = [new for new, _ in updates]
    if sharded:
        new_params = _gathered(fb, trainable, owner, rank, [args[p.name] for p in trainable], new_params)
    new_states = [v for _, state in updates for v in state.values()]
    state_names = iter(tuple(s) for s in states)
    step = fb.finish([*out[:n_outputs], *new_params, *new_states, *out[n_outputs:n_forward]])
    index = {p.name: i for i, p in enumerate(params)}
    return StepProgram(
        verify(Graph(graph.name, flags=graph.flags, functions={"step": step})),
        tuple(p.id for p in params), tuple(index[p.name] for p in trainable),
        tuple(next(state_names) if i in mine else () for i in range(len(trainable))),
        tuple(index[path] for path in updated), n_outputs,
        frozenset(index[trainable[i].name] for i in range(len(trainable)) if i not in mine))


def _gathered(fb: FunctionBuilder, trainable: Sequence, owner: Sequence[int], rank: int,
              current: Sequence[Operand], new: Sequence[Operand]) -> list[Operand]:
    """ZeRO-1's gather: every rank's new parameters, each updated by its owner alone, as one broadcast from each owner
    per dtype of its parameters; a rank passes its `current` values where it is not the owner (their shapes only)."""
    mine_new = dict(zip((i for i, r in enumerate(owner) if r == rank), new))
    gathered: list[Operand] = [mine_new.get(i, current[i]) for i in range(len(trainable))]
    for src, dtype in dict.fromkeys((r, p.type.dtype) for r, p in zip(owner, trainable)):
        group = [i for i, p in enumerate(trainable) if owner[i] == src and p.type.dtype is dtype]
        outs = fb.emit("broadcast", *(gathered[i] for i in group), src=src,
                       names=[f"{trainable[i].name}.new" for i in group])
        for i, out in zip(group, outs if isinstance(outs, tuple) else (outs,)):
            gathered[i] = out
    return gathered


class TrainStep:
    """A compiled training step holding parameters and optimizer state as arrays between calls.

    The step donates them (`StepProgram.donated`): each call may write its results into the arrays the last call
    returned, so `optimizer.state` holds the latest values only until the next call (copy what must outlive it);
    `model()` returns copies."""

    def __init__(self, model: Module, loss_fn: LossFn, optimizer: Optimizer, input_specs: Sequence[InputSpec],
                 seed: int = 0, data_parallel: DataParallel | None = None, communicator: Communicator | None = None):
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.data_parallel, self.communicator = data_parallel, communicator
        self.retraces = 0
        self._types = tuple(as_type(s) for s in input_specs)
        self._seeds = itertools.count(seed)
        self._program: StepProgram | None = None
        self._reason = ""
        self._params: list[np.ndarray] = []  # resident, in the program's argument order
        self._states: list[np.ndarray] = []
        self.load_model(model)

    def load_model(self, model: Module) -> None:
        """Continue from `model`'s parameters and state; re-traces on the next call if its state differs."""
        self.optimizer.require_leaves((path, p) for path, p in model.leaves() if isinstance(p, Param) and p.grad)
        signature = state_signature(model)
        if self._program is not None and signature != self._signature:
            self._reason, self._program = _changes(self._signature, signature), None
        self._model, self._signature = model, signature
        self._values = {p.id: p.state.get() for _, p in model.leaves() if isinstance(p, Param)}
        if self._program is not None:
            self._gather(self._program)

    def __call__(self, lr: float, *inputs: np.ndarray | Tensor) -> float | tuple[Any, ...]:
        """One step at learning rate `lr`: returns the loss (and loss_fn's other results, as arrays)."""
        arrays = [x.numpy() if isinstance(x, Tensor) else np.asarray(x) for x in inputs]
        if len(arrays) != len(self._types):
            raise ValueError(f"the step takes {len(self._types)} inputs, got {len(arrays)}")
        changed = [i for i, (t, a) in enumerate(zip(self._types, arrays))
                   if not t.matches(a.shape) or a.dtype != t.dtype.numpy]
        if changed:
            self._reason = "; ".join(f"input {i} of shape {list(arrays[i].shape)} and dtype {arrays[i].dtype} is not "
                                     f"a {self._types[i]}" for i in changed)
            self._types = tuple(TensorType(a.shape, DType.from_numpy(a.dtype)) if i in changed else t
                                for i, (t, a) in enumerate(zip(self._types, arrays)))
            self._program = None
        program = self._program or self._trace()
        # copy=False: parameters and state come back as read-only views and go in again zero-copy next step
        seed = rank_seed(next(self._seeds), self.communicator.rank if self.communicator is not None else 0)
        with communicating(self.communicator):
            outs = default_backend().run(program.graph, [*self._params, *self._states, np.float64(lr), *arrays],
                                         "step", seed=seed, copy=False, donate=program.donated)
        n, k, b = program.n_outputs, len(program.trained), len(program.buffers)
        for i, value in [*zip(program.trained, outs[n:n + k]), *zip(program.buffers, outs[len(outs) - b:])]:
            self._params[i] = self._values[program.param_ids[i]] = value
        self._states = list(outs[n + k:len(outs) - b])
        states = iter(self._states)
        for i, names in zip(program.trained, program.state_names):
            if i not in program.elsewhere:
                self.optimizer.state[program.param_ids[i]] = {name: next(states) for name in names}
        loss = float(outs[0])
        return loss if n == 1 else (loss, *outs[1:n])

    def _trace(self) -> StepProgram:
        if self._reason:
            self.retraces += 1
            log.info("re-tracing the train step (%d): %s", self.retraces, self._reason)
        c = self.communicator
        program = build_step(self._model, self.loss_fn, self.optimizer, self._types, self.data_parallel,
                             c.rank if c is not None else 0, c.world_size if c is not None else 1)
        self._gather(program)
        self._program, self._reason = program, ""
        return program

    def _gather(self, program: StepProgram) -> None:
        """Lay the current values and optimizer state out as the program's arguments."""
        params = {p.id: (path, p) for path, p in self._model.leaves() if isinstance(p, Param)}
        self._params = [self._values[pid] for pid in program.param_ids]
        self._states = []
        for i, names in zip(program.trained, program.state_names):
            if i in program.elsewhere:  # ZeRO-1: another rank's share (a resumed whole state is sharded here)
                self.optimizer.state.pop(program.param_ids[i], None)
            else:
                state = self.optimizer.state_for(*params[program.param_ids[i]])
                self._states += [state[name] for name in names]

    @property
    def program(self) -> StepProgram | None:
        """The traced step the next call runs (None before the first call and after a change that re-traces)."""
        return self._program

    def model(self) -> Module:
        """The trained module: parameters and buffers as the last step left them (copies: the next step writes its
        results into the arrays this one returned)."""
        return with_values(self._model, {pid: value.copy() for pid, value in self._values.items()})


def compile_step(model: Module, loss_fn: LossFn, optimizer: Optimizer, *input_specs: InputSpec, seed: int = 0,
                 data_parallel: DataParallel | None = None, communicator: Communicator | None = None) -> TrainStep:
    """Capture `loss_fn(model, *inputs)`'s forward, backward and `optimizer`'s update as one step function;
    `data_parallel` averages its gradients across `communicator`'s ranks (see `kiln.passes.data_parallel`)."""
    return TrainStep(model, loss_fn, optimizer, input_specs, seed, data_parallel, communicator)
