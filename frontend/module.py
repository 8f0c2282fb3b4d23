"""kiln.Module: Burn's `Module` trait. Fields are found by assignment order; every state method runs the
module-state pass of the same name over the module's parameter and flag nodes and returns a new module,
leaving the receiver unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Literal

from kiln.ir import FlagNode, Graph, ParamNode, ReparamNode, registry
from kiln.ir.naming import derived, lora_base, stored_name, suffix_of
from kiln.passes import Pass, get_pass
from kiln.passes.group import ParamGroup

from .device import Device, as_device
from .param import Flag, Param, Reparam, new_autodiff_node
from .records import RecordMethods
from .reparam import Adapter, Dora, Lora, QLora, Quantizer, Reparameterizer
from .summary import SummaryMethods, counted
from .tracing import current_trace

Leaf = Param | Flag
Transfer = Literal["fork", "to_device"]


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


def submodule_paths(value: Any, path: str = "") -> dict[int, str]:
    """id(module) -> its path for `value` and every module below it (fields, lists, tuples, dicts), first path
    kept for a module reached twice: what a trace names its ops' module paths by."""
    found: dict[int, str] = {}
    pending = [(path, value)]
    while pending:
        at, v = pending.pop()
        if isinstance(v, Module):
            if id(v) in found:
                continue
            found[id(v)] = at
            items: Any = vars(v).items()
        elif isinstance(v, list | tuple):
            items = enumerate(v)
        elif isinstance(v, dict):
            items = v.items()
        else:
            continue
        pending.extend((_join(at, str(k)), x) for k, x in reversed(list(items)))
    return found


def _node(name: str, p: Param) -> ParamNode:
    """A parameter's state as a graph node (its data if initialized, else its initializer)."""
    return ParamNode(name, p.type, p.id, p.state.init, p.state.value, p.grad, p.configured_grad, p.device.name,
                     p.device.autodiff_enabled, p.device.checkpointing, p.buffer, p.layout)


def _rebuild_reparam(param: Param, path: str, fn: Callable[[str, Leaf], Leaf], hooks: Any) -> Param:
    """The base at `path`, then each derivation's factors at `path.<suffix>` in a "Reparameterization" container."""
    new = fn(path, param)
    if not isinstance(new, Param) or new.reparam is None:
        return new  # the mapper folded or dropped the reparameterization
    rebuilt = _rebuild_chain(new.reparam, path, fn, hooks)
    return new if rebuilt is new.reparam else new.replace(reparam=rebuilt)


def _rebuild_chain(r: Reparam, path: str, fn: Callable[[str, Leaf], Leaf], hooks: Any) -> Reparam:
    inner = _rebuild_chain(r.inner, path, fn, hooks) if r.inner is not None else None
    hooks.enter_module(r.kind, "Reparameterization")
    factors = tuple((s, fn(derived(path, s), f)) for s, f in r.factors)
    hooks.exit_module(r.kind, "Reparameterization")
    if inner is r.inner and all(a is b for (_, a), (_, b) in zip(factors, r.factors)):
        return r
    return replace(r, factors=factors, inner=inner)


def _same_chain(a: Reparam | None, b: Reparam | None) -> bool:
    """Same kinds, attributes and factor objects at every level."""
    if a is None or b is None:
        return a is b
    return (a.kind == b.kind and a.attrs == b.attrs and _same_chain(a.inner, b.inner)
            and len(a.factors) == len(b.factors) and all(x is y for (_, x), (_, y) in zip(a.factors, b.factors)))


def _stored_name(path: str, chain: list[Reparam]) -> str:
    """Where a derived parameter's stored value lives in the graph: quantized codes or a LoRA base."""
    return stored_name(path, quantized=chain[0].kind == "dequantize")


class _Depth(ModuleVisitor):
    """Tracks how deep a traversal is inside derivations ("Reparameterization" containers)."""

    level = 0

    def enter_module(self, name: str, container: str) -> None:
        self.level += container == "Reparameterization"

    def exit_module(self, name: str, container: str) -> None:
        self.level -= container == "Reparameterization"


class Module(RecordMethods, SummaryMethods):
    """Base class of every model. Subclasses assign layers, Params, Flags (and containers of them) in
    `__init__` and write `forward`; no registration is needed."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = current_trace()
        if trace is None:
            return self.forward(*args, **kwargs)
        with trace.entered(self):  # ops it records are at its module path
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

    def leaves(self, factors: bool = True) -> Iterator[tuple[str, Leaf]]:
        """(path, Param or Flag) in visit order; `factors=False` skips the factors of derived parameters."""
        found: list[tuple[str, Leaf]] = []
        depth = _Depth()
        self._map_leaves(lambda path, leaf: (factors or not depth.level) and found.append((path, leaf)) or leaf, depth)
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
        """Elements of every floating parameter (a quantized one counts as the float it stands for) and of
        adapter factors; quantization scales are storage, not parameters. Initializes nothing."""
        return sum(n for _, p in self.leaves(factors=False) if isinstance(p, Param) for _, _, n in counted(p))

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
        adapted = {}
        for path, leaf in self.leaves():
            if isinstance(leaf, Flag):
                flags[path] = FlagNode(path, leaf.id, leaf.value, leaf.configured)
                continue
            name = path
            if leaf.reparam is not None:
                name = _stored_name(path, leaf.reparam.chain())
                adapted[path] = leaf
            params[name] = _node(name, leaf)
        for path, leaf in adapted.items():
            chain = leaf.reparam.chain()
            below, types = _stored_name(path, chain), {**{n: p.type for n, p in params.items()}}
            for i, r in enumerate(chain):
                name = path if i == len(chain) - 1 else lora_base(path)
                operands = (below, *(derived(path, s) for s, _ in r.factors))
                attrs, (types[name],) = registry.infer(r.kind, [types[o] for o in operands], r.attrs)
                reparams[name] = ReparamNode(name, types[name], r.kind, operands, attrs)
                below = name
        return Graph(type(self).__name__, params, flags, reparams)

    def load_graph(self, graph: Graph, transfer: Transfer | None = None) -> Module:
        """A module whose parameters and flags take the state of the same-path nodes of `graph`.

        `transfer` says what the graph does not: the state came from `to_device` (moved tracked values become
        intermediaries, non-leaves) or from `fork` (every parameter becomes a fresh leaf of its own graph).

        A derived node at a parameter's path gives it that reparameterization (factors made from their nodes
        where the parameter had none); a plain node where it had one means it was materialized.
        """
        def rebind(path: str, leaf: Leaf) -> Leaf:
            if isinstance(leaf, Flag):
                node = graph.flags.get(path)
                if node is None or (node.value, node.configured) == (leaf.value, leaf.configured):
                    return leaf
                return leaf.replace(value=node.value, configured=node.configured)
            if path in graph.reparams:
                return rebind_derived(path, leaf)
            p = graph.params.get(path)
            if p is None:
                return leaf
            if leaf.reparam is not None:  # materialized: a plain parameter with the computed value
                return Param.from_node(p).replace(mapper=leaf.mapper)  # Burn keeps the param_mapper
            return rebind_param(p, leaf)

        def rebind_derived(path: str, leaf: Param) -> Param:
            """The stored base rebound, under the graph's chain of derivations (old factors kept by suffix)."""
            nodes, name = [], path
            while name in graph.reparams:
                nodes.append(graph.reparams[name])
                name = graph.reparams[name].operands[0]
            old = {s: f for r in (leaf.reparam.chain() if leaf.reparam else []) for s, f in r.factors}
            chain = None
            for r in reversed(nodes):
                suffixes = [(suffix_of(path, o), o) for o in r.operands[1:]]
                factors = tuple((s, old.get(s) or Param.from_node(graph.params[o])) for s, o in suffixes)
                chain = Reparam(r.kind, factors, dict(r.attrs), chain)
            stripped = leaf.replace(reparam=None)
            base = rebind_param(graph.params[name], stripped)
            if leaf.reparam is not None and base is stripped and _same_chain(leaf.reparam, chain):
                return leaf
            return base.replace(reparam=chain)

        def rebind_param(p: ParamNode, leaf: Param) -> Param:
            device = Device(p.device, p.autodiff, p.checkpointing)
            state = leaf.state
            if p.id != leaf.id or p.type != leaf.type or p.data is not state.value:
                state = Param.from_node(p).state  # new data or identity: loaded, quantized or materialized
            elif p.device != leaf.device.name:
                if state.shared and state.value is None:
                    state.get()  # a lazy value a clone shares initializes where it is, then moves
                state = state.moved(device)
            if transfer == "fork":  # Burn's to_device(d).detach(), require_grad again: a fresh leaf, same ParamId
                return leaf.replace(id=p.id, state=state, device=device, grad=p.grad,
                                    configured_grad=p.configured_grad, leaf=True, autodiff_node=new_autodiff_node(),
                                    layout=p.layout)
            moved_tracked = (transfer == "to_device" and p.device != leaf.device.name and leaf.is_initialized()
                             and leaf.grad)
            new = leaf.replace(id=p.id, state=state, device=device, grad=p.grad, configured_grad=p.configured_grad,
                               leaf=leaf.leaf and not moved_tracked, layout=p.layout)
            same = (new.device.name, new.device.autodiff_enabled, new.device.checkpointing, new.grad,
                    new.configured_grad, new.leaf, new.layout) == (leaf.device.name, leaf.device.autodiff_enabled,
                                                                   leaf.device.checkpointing, leaf.grad,
                                                                   leaf.configured_grad, leaf.leaf, leaf.layout)
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
        return self.load_graph(graph, "to_device")

    def fork(self, device: Device | str) -> Module:
        """Move every parameter so the result owns its own autodiff graph: fresh leaves with the same ParamIds, so
        gradients through the fork are the fork's only (no data is copied on the same device)."""
        graph = get_pass("fork")(device=as_device(device).name).apply(self.state_graph())
        return self.load_graph(graph, "fork")

    # quantization -------------------------------------------------------------------------------------
    def quantize_weights(self, quantizer: Quantizer) -> Module:
        """Quantize the float parameters of the quantizer's group (all, biases included, by default)."""
        scheme = quantizer.scheme
        return self.run_pass(get_pass("quantize-weights")(value=scheme.value, block=scheme.block,
                                                           calibration=quantizer.calibration,
                                                           scale_dtype=scheme.scale_dtype.value,
                                                           double_quant=scheme.double_quant,
                                                           group=quantizer.param_group))

    def quantize_weights_group(self, quantizer: Quantizer, group: ParamGroup) -> Module:
        """Quantize the given group; like Burn, this sets the quantizer's group."""
        quantizer.set_param_group(group)
        return self.quantize_weights(quantizer)

    def apply_qlora(self, qlora: QLora) -> Module:
        """Quantize the (frozen) bases, then attach trainable LoRA adapters to 2-D weights; flags are kept."""
        return self.quantize_weights(qlora.quantizer).apply_lora(qlora.lora)

    # reparameterization ---------------------------------------------------------------------------------
    def apply_lora(self, lora: Lora) -> Module:
        """Attach LoRA adapters to matched 2-D weights and freeze every base parameter; flags are kept."""
        return self._adapt(lora)

    def apply_dora(self, dora: Dora) -> Module:
        """Attach DoRA adapters (factors and a magnitude read from each base's value) to matched 2-D weights and
        freeze every base parameter; a lazy base stays lazy; flags are kept."""
        return self._adapt(dora)

    def _adapt(self, adapter: Adapter) -> Module:
        return self.run_pass(get_pass("reparameterize")(kind=adapter.kind, rank=adapter.rank, alpha=adapter.alpha,
                                                         init_std=adapter.init_std, group=adapter.param_group))

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

    def materialize(self, requantize: bool = False) -> Module:
        """Fold reparameterizations into plain parameters (base ids and trainability kept); with `requantize`, a
        QLoRA weight folds back into its base's quantization scheme, each one's error logged on `kiln`."""
        return self.run_pass(get_pass("materialize")(requantize=requantize))

