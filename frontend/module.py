"""kiln.Module: Burn's `Module` trait. Fields are found by assignment order; every state method runs the
module-state pass of the same name over the module's parameter and flag nodes and returns a new module,
leaving the receiver unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kiln.ir import FlagNode, Graph, ParamNode, ReparamNode, registry
from kiln.passes import Pass, get_pass
from kiln.passes.group import ParamGroup

from .device import Device, as_device
from .param import Flag, Param, Reparam
from .records import RecordMethods

Leaf = Param | Flag


class ModuleVisitor:
    """Sees every parameter and flag with its path; override what you need."""

    def enter_module(self, name: str, container: str) -> None: ...
    def exit_module(self, name: str, container: str) -> None: ...
    def visit_param(self, path: str, param: Param) -> None: ...
    def visit_flag(self, path: str, flag: Flag) -> None: ...


class ModuleMapper:
    """Maps every parameter and flag with its path; the defaults keep them."""

    def enter_module(self, name: str, container: str) -> None: ...
    def exit_module(self, name: str, container: str) -> None: ...
    def map_param(self, path: str, param: Param) -> Param:
        return param

    def map_flag(self, path: str, flag: Flag) -> Flag:
        return flag


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_state(value: Any) -> bool:
    if isinstance(value, Module | Param | Flag):
        return True
    if isinstance(value, list | tuple):
        return any(_is_state(v) for v in value)
    if isinstance(value, dict):
        return any(_is_state(v) for v in value.values())
    return False


def _rebuild(value: Any, prefix: str, name: str, fn: Callable[[str, Leaf], Leaf], hooks: Any) -> Any:
    """`value` with each Param/Flag below it replaced by fn(path, leaf); unchanged subtrees are reused."""
    path = _join(prefix, name)
    if isinstance(value, Param) and value.reparam is not None:
        return _rebuild_reparam(value, path, fn, hooks)
    if isinstance(value, Param | Flag):
        return fn(path, value)
    if isinstance(value, Module):
        return value._map_leaves(fn, hooks, path, name)
    if isinstance(value, list | tuple) and _is_state(value):
        kind = "Vec" if isinstance(value, list) else "Tuple"
        hooks.enter_module(name, kind)
        items = [_rebuild(v, path, str(i), fn, hooks) for i, v in enumerate(value)]
        hooks.exit_module(name, kind)
        same = all(a is b for a, b in zip(items, value))
        return value if same else type(value)(items)
    if isinstance(value, dict) and _is_state(value):
        hooks.enter_module(name, "Map")
        items = {k: _rebuild(v, path, str(k), fn, hooks) for k, v in value.items()}
        hooks.exit_module(name, "Map")
        return value if all(items[k] is value[k] for k in value) else items
    return value


def _node(name: str, p: Param) -> ParamNode:
    """A parameter's state as a graph node (its data if initialized, else its initializer)."""
    return ParamNode(name, p.type, p.id, p.state.init, p.state.value, p.grad, p.configured_grad, p.device.name,
                     p.device.autodiff_enabled, p.device.checkpointing, p.buffer)


def _rebuild_reparam(param: Param, path: str, fn: Callable[[str, Leaf], Leaf], hooks: Any) -> Param:
    """The base at `path`, then each factor at `path.<suffix>` inside a "Reparameterization" container."""
    new = fn(path, param)
    if not isinstance(new, Param) or new.reparam is None:
        return new  # the mapper folded or dropped the reparameterization
    hooks.enter_module(new.reparam.kind, "Reparameterization")
    factors = tuple((s, fn(f"{path}.{s}", f)) for s, f in new.reparam.factors)
    hooks.exit_module(new.reparam.kind, "Reparameterization")
    if all(a is b for (_, a), (_, b) in zip(factors, new.reparam.factors)):
        return new
    return new.replace(reparam=new.reparam.with_factors(factors))


class Module(RecordMethods):
    """Base class of every model. Subclasses assign layers, Params, Flags (and containers of them) in
    `__init__` and write `forward`; no registration is needed."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # traversal ------------------------------------------------------------------------------------
    def _map_leaves(self, fn: Callable[[str, Leaf], Leaf], hooks: Any = None, prefix: str = "",
                    name: str = "") -> Module:
        hooks = hooks or ModuleVisitor()
        container = f"Struct:{type(self).__name__}"
        hooks.enter_module(name, container)
        changes = {}
        for attr, value in vars(self).items():
            new = _rebuild(value, prefix, attr, fn, hooks)
            if new is not value:
                changes[attr] = new
        hooks.exit_module(name, container)
        if not changes:
            return self
        clone = copy.copy(self)
        clone.__dict__.update(changes)
        return clone

    def leaves(self) -> Iterator[tuple[str, Leaf]]:
        """(path, Param or Flag) in visit order."""
        found: list[tuple[str, Leaf]] = []
        self._map_leaves(lambda path, leaf: found.append((path, leaf)) or leaf)
        return iter(found)

    def visit(self, visitor: ModuleVisitor) -> None:
        """Visit each parameter and module-owned control value with its path."""
        def see(path: str, leaf: Leaf) -> Leaf:
            if isinstance(leaf, Param):
                visitor.visit_param(path, leaf)
            else:
                visitor.visit_flag(path, leaf)
            return leaf
        self._map_leaves(see, visitor)

    def map(self, mapper: ModuleMapper) -> Module:
        """Map each parameter and module-owned control value; returns the new module."""
        return self._map_leaves(
            lambda path, leaf: mapper.map_param(path, leaf) if isinstance(leaf, Param) else mapper.map_flag(path, leaf),
            mapper)

    def clone(self) -> Module:
        """A copy that shares every parameter: a shared lazy parameter initializes once, for both."""
        for _, leaf in self.leaves():
            if isinstance(leaf, Param) and not leaf.is_initialized():
                leaf.state.shared = True
        return copy.copy(self)

    # analyses -------------------------------------------------------------------------------------
    def num_params(self) -> int:
        """Elements of every floating parameter, reparameterization factors included; initializes nothing."""
        return sum(p.numel() for _, p in self.leaves() if isinstance(p, Param) and p.type.dtype.is_float)

    def collect_devices(self, devices: list[Device]) -> list[Device]:
        """`devices` plus every parameter's (lazy) device not already in it; initializes nothing."""
        out = list(devices)
        for _, p in self.leaves():
            if isinstance(p, Param) and p.lazy_device() not in out:
                out.append(p.lazy_device())
        return out

    def devices(self) -> list[Device]:
        return self.collect_devices([])

    # state as IR ------------------------------------------------------------------------------------
    def state_graph(self) -> Graph:
        """The module's parameter and flag nodes (no functions): what module-state passes transform."""
        params, flags, reparams = {}, {}, {}
        derived = {}
        for path, leaf in self.leaves():
            if isinstance(leaf, Flag):
                flags[path] = FlagNode(path, leaf.id, leaf.value, leaf.configured)
                continue
            name = path
            if leaf.reparam is not None:
                name = f"{path}.base"
                derived[path] = leaf
            params[name] = _node(name, leaf)
        for path, leaf in derived.items():
            r = leaf.reparam
            operands = (f"{path}.base", *(f"{path}.{s}" for s, _ in r.factors))
            attrs, (type_,) = registry.infer(r.kind, [params[o].type for o in operands], r.attrs)
            reparams[path] = ReparamNode(path, type_, r.kind, operands, attrs)
        return Graph(type(self).__name__, params, flags, reparams)

    def load_graph(self, graph: Graph, fork: bool = True) -> Module:
        """A module whose parameters and flags take the state of the same-path nodes of `graph`.

        A derived node at a parameter's path gives it that reparameterization (factors made from their nodes
        where the parameter had none); a plain node where it had one means it was materialized.
        """
        def rebind(path: str, leaf: Leaf) -> Leaf:
            if isinstance(leaf, Flag):
                node = graph.flags.get(path)
                if node is None or (node.value, node.configured) == (leaf.value, leaf.configured):
                    return leaf
                return leaf.replace(value=node.value, configured=node.configured)
            derived = graph.reparams.get(path)
            if derived is not None:
                stripped = leaf.replace(reparam=None)
                base = rebind_param(graph.params[derived.operands[0]], stripped)
                if leaf.reparam is not None:
                    return leaf if base is stripped else base.replace(reparam=leaf.reparam)
                factors = tuple((o[len(path) + 1:], Param.from_node(graph.params[o])) for o in derived.operands[1:])
                return base.replace(reparam=Reparam(derived.kind, factors, dict(derived.attrs)))
            p = graph.params.get(path)
            if p is None:
                return leaf
            if leaf.reparam is not None:
                return Param.from_node(p)  # materialized: a plain parameter with the computed value
            return rebind_param(p, leaf)

        def rebind_param(p: ParamNode, leaf: Param) -> Param:
            device = Device(p.device, p.autodiff, p.checkpointing)
            state = leaf.state
            if p.device != leaf.device.name:
                if state.shared and state.value is None:
                    state.get()  # a lazy value a clone shares initializes where it is, then moves
                state = state.moved(device)
            moved_tracked = p.device != leaf.device.name and leaf.is_initialized() and leaf.grad and not fork
            new = leaf.replace(state=state, device=device, grad=p.grad, configured_grad=p.configured_grad,
                               leaf=leaf.leaf and not moved_tracked)
            same = (new.device.name, new.device.autodiff_enabled, new.device.checkpointing, new.grad,
                    new.configured_grad, new.leaf) == (leaf.device.name, leaf.device.autodiff_enabled,
                                                       leaf.device.checkpointing, leaf.grad, leaf.configured_grad,
                                                       leaf.leaf)
            return leaf if same and state is leaf.state else new
        return self._map_leaves(rebind)

    def run_pass(self, p: Pass | str) -> Module:
        """Run a module-state pass (an instance or pipeline name) over this module's state."""
        p = get_pass(p)() if isinstance(p, str) else p
        return self.load_graph(p.apply(self.state_graph()))

    # the Module trait's state methods ---------------------------------------------------------------
    def train(self) -> Module:
        return self.run_pass("train")

    def valid(self) -> Module:
        return self.run_pass("valid")

    def set_require_grad(self, require_grad: bool) -> Module:
        return self.run_pass(get_pass("set-require-grad")(value=require_grad))

    def set_require_grad_group(self, group: ParamGroup, require_grad: bool) -> Module:
        return self.run_pass(get_pass("set-require-grad-group")(group=group, value=require_grad))

    def no_grad(self) -> Module:
        return self.run_pass("no-grad")

    def freeze(self) -> Module:
        return self.run_pass("freeze")

    def unfreeze(self) -> Module:
        return self.run_pass("unfreeze")

    def freeze_group(self, group: ParamGroup) -> Module:
        return self.run_pass(get_pass("freeze-group")(group=group))

    def unfreeze_group(self, group: ParamGroup) -> Module:
        return self.run_pass(get_pass("unfreeze-group")(group=group))

    def to_device(self, device: Device | str) -> Module:
        """Move every parameter; moved tracked values are intermediaries (use fork to keep training)."""
        graph = get_pass("to-device")(device=as_device(device).name).apply(self.state_graph())
        return self.load_graph(graph, fork=False)

    def fork(self, device: Device | str) -> Module:
        """Move every parameter so the result owns its own autodiff graph (trainable leaves)."""
        return self.run_pass(get_pass("fork")(device=as_device(device).name))

    # reparameterization ---------------------------------------------------------------------------------
    def apply_lora(self, lora: Lora) -> Module:
        """Attach LoRA adapters to matched 2-D weights and freeze every base parameter; flags are kept."""
        return self.run_pass(get_pass("reparameterize")(kind="lora", rank=lora.rank, alpha=lora.alpha,
                                                         init_std=lora.init_std, group=lora.param_group))

    def apply_reparameterization(self, reparameterizer: Reparameterizer) -> Module:
        """Pass every floating parameter with its path to `reparameterizer`; nested ones are not supported."""
        def attach(path: str, leaf: Leaf) -> Leaf:
            if not isinstance(leaf, Param) or not leaf.type.dtype.is_float:
                return leaf
            if leaf.reparam is not None:
                raise ValueError(f"{path} is already reparameterized; nested reparameterizations are not supported")
            base, reparam = reparameterizer.reparameterize(path, leaf)
            return base if reparam is None else base.replace(reparam=reparam)
        return self._map_leaves(attach)

    def materialize(self) -> Module:
        """Fold reparameterizations into plain parameters (base ids and trainability kept)."""
        return self.run_pass("materialize")


@dataclass(frozen=True)
class Lora:
    """LoRA settings: rank, alpha (scale = alpha / rank), factor init std (default 1/rank), which params."""

    rank: int
    alpha: float
    init_std: float | None = None
    param_group: ParamGroup = field(default_factory=ParamGroup.all)

    def set_param_group(self, group: ParamGroup) -> Lora:
        return replace(self, param_group=group)


class Reparameterizer(Protocol):
    """Custom reparameterizations: return the structural base and an optional Reparam for `Param.val`."""

    def reparameterize(self, path: str, param: Param) -> tuple[Param, Reparam | None]: ...
