"""How a Module shows itself: `print(model)` as a tree of its fields, `summary()` as a table with totals and
bytes per dtype, and `named_parameters()`, mixed into Module. Both views read the module through `visit`, so
they show exactly the fields and paths every pass and record sees.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.ir.liveness import value_bytes
from kiln.ir.naming import derived

from .param import Flag, Param

DEQUANTIZE = "dequantize"  # the derivation whose factor (scales) is storage, not a parameter


def counted(param: Param) -> Iterator[tuple[str | None, Param, int]]:
    """The parameter (suffix None) and each factor of its derivations, with the elements `num_params` counts
    for it: a float parameter in full (a quantized one as the float it stands for), adapter factors in full,
    quantization scales not at all (storage)."""
    yield None, param, param.numel() if param.value_type.dtype.is_float else 0
    for r in param.reparam.chain() if param.reparam is not None else []:
        for suffix, factor in r.factors:
            yield suffix, factor, 0 if r.kind == DEQUANTIZE else factor.numel()


def _grad_state(p: Param) -> str:
    """trainable (requires gradients now), frozen (configured off), or grad off (configured on, off for now:
    valid/no_grad, or a device without autodiff)."""
    if p.buffer:
        return "buffer"
    return "trainable" if p.grad else "grad off" if p.configured_grad else "frozen"


def _describe(p: Param, count: int, home: str) -> str:
    """One parameter's line: effective type, counted elements, lazy/initialized, gradient state, derivation, file
    form (a layout or Python mappers), and its device where it is not the model's first (`home`)."""
    parts = [str(p.value_type), f"{count:,} params", "initialized" if p.is_initialized() else "lazy", _grad_state(p)]
    if p.type != p.value_type:
        parts.append(f"stored {p.type}")
    if p.reparam is not None:
        parts.append("derived by " + "/".join(r.kind for r in p.reparam.chain()))
    if p.layout is not None:
        parts.append(f"recorded as {p.layout}")
    elif p.mapper is not None and (p.mapper.load or p.mapper.save):
        parts.append("recorded through Python mappers")
    if str(p.device) != home:
        parts.append(f"on {p.device}")
    return "  ".join(parts)


_SETTING_TYPES = (bool, int, float, str)


def _is_setting(value: Any) -> bool:
    """A layer's configuration value: a plain scalar or string, or a tuple/list of them (stride, padding)."""
    if isinstance(value, list | tuple):
        return bool(value) and all(isinstance(v, _SETTING_TYPES) for v in value)
    return isinstance(value, _SETTING_TYPES)


def settings(module: object) -> str:
    """`(name=value, ...)` of the module's own configuration fields (Dropout's prob, Conv2d's stride...): the
    public plain-valued attributes, in assignment order; empty when it has none."""
    shown = [f"{k}={v!r}" for k, v in vars(module).items() if not k.startswith("_") and _is_setting(v)]
    return f"({', '.join(shown)})" if shown else ""


def _child(parent: object, name: str) -> object:
    """The object a visit's `enter_module(name, ...)` entered below `parent` (a field, list item or dict value)."""
    if isinstance(parent, list | tuple):
        return parent[int(name)]
    if isinstance(parent, dict):
        return next(v for k, v in parent.items() if str(k) == name)
    return getattr(parent, name)


@dataclass
class _Node:
    """A field of the tree: a module or container (with children) or a leaf line."""

    label: str
    count: int = 0
    children: list[_Node] = field(default_factory=list)

    def lines(self, depth: int = 0) -> Iterator[str]:
        yield "  " * depth + self.label
        for child in self.children:
            yield from child.lines(depth + 1)


class _TreeBuilder:
    """A ModuleVisitor building the field tree of `model`; factors appear under their parameter (from
    `counted`), so the visit's own "Reparameterization" containers are skipped. It follows the visit's names
    down the objects to show each layer's settings."""

    def __init__(self, model: object, home: str) -> None:
        self.stack: list[tuple[_Node, str, object]] = []  # (node, path prefix, the module or container)
        self.root: _Node | None = None
        self.in_reparam = 0
        self.model, self.home = model, home

    def enter_module(self, name: str, container: str) -> None:
        if container == "Reparameterization" or self.in_reparam:
            self.in_reparam += 1
            return
        kind = container.removeprefix("Struct:")
        obj = _child(self.stack[-1][2], name) if self.stack else self.model
        label = kind + (settings(obj) if container.startswith("Struct:") else "")
        node = _Node(f"{name}: {label}" if name else label)
        if self.stack:
            parent, prefix, _ = self.stack[-1]
            parent.children.append(node)
            self.stack.append((node, f"{prefix}{name}.", obj))
        else:
            self.root = node
            self.stack.append((node, "", obj))

    def exit_module(self, name: str, container: str) -> None:
        if self.in_reparam:
            self.in_reparam -= 1
            return
        node, _, _ = self.stack.pop()
        if self.stack:
            self.stack[-1][0].count += node.count
        elif self.home:
            node.label += f"  ({node.count:,} params on {self.home})"
            return
        node.label += f"  ({node.count:,} params)" if container.startswith("Struct:") else ""

    def _name(self, path: str) -> str:
        return path.removeprefix(self.stack[-1][1])

    def visit_param(self, path: str, param: Param) -> None:
        if self.in_reparam:
            return
        (_, base, total), *factors = counted(param)
        node = _Node(f"{self._name(path)}: {_describe(base, total, self.home)}", total)
        node.children = [_Node(f"{suffix}: {_describe(f, n, self.home)}") for suffix, f, n in factors]
        node.count += sum(n for _, _, n in factors)
        self.stack[-1][0].children.append(node)
        self.stack[-1][0].count += node.count

    def visit_flag(self, path: str, flag: Flag) -> None:
        state = "on" if flag.value else "off"
        configured = "" if flag.value == flag.configured else f" (configured {'on' if flag.configured else 'off'})"
        self.stack[-1][0].children.append(_Node(f"{self._name(path)}: Flag {state}{configured}"))


def _home(module: Visitable) -> str:
    """The device of the model's first parameter ("" for a model without parameters)."""
    devices = module.devices()
    return str(devices[0]) if devices else ""


class Visitable(Protocol):
    """What these methods use of the Module they are mixed into (named structurally: module.py imports this
    file, so importing Module here would be a cycle)."""

    def visit(self, visitor: _TreeBuilder) -> None: ...
    def devices(self) -> list: ...
    def leaves(self, factors: bool = True) -> Iterator[tuple[str, Param | Flag]]: ...


class SummaryMethods:
    """Module's printed form and parameter listings; nothing is initialized to produce them."""

    def named_parameters(self: Visitable) -> Iterator[tuple[str, Param]]:
        """(path, Param) for every parameter, buffer and derivation factor, in visit order with visit's paths."""
        return ((path, leaf) for path, leaf in self.leaves() if isinstance(leaf, Param))

    def __repr__(self: Visitable) -> str:
        """A tree of the fields: layer types with their settings and parameter counts, the model's device, and
        for each parameter its type, count, lazy/initialized, trainable/frozen and derivation (factors below it)
        and its device where it differs."""
        builder = _TreeBuilder(self, _home(self))
        self.visit(builder)
        assert builder.root is not None
        return "\n".join(builder.root.lines())

    def summary(self: Visitable) -> str:
        """A table of every stored tensor (path, type, counted params, bytes held, state), then the totals:
        parameters (trainable among them) and bytes per stored dtype."""
        rows = [("path", "type", "params", "bytes", "state")]
        params = trainable = 0
        by_dtype: Counter[str] = Counter()
        for path, leaf in self.leaves(factors=False):
            if not isinstance(leaf, Param):
                continue
            for suffix, p, n in counted(leaf):
                size = value_bytes(p.type)
                state = ("initialized" if p.is_initialized() else "lazy") + " " + _grad_state(p)
                rows.append((path if suffix is None else derived(path, suffix), str(p.type), f"{n:,}", f"{size:,}",
                             state))
                params += n
                trainable += n if p.grad else 0
                by_dtype[p.type.dtype.value] += size
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        dtypes = ", ".join(f"{d} {b:,}" for d, b in sorted(by_dtype.items()))
        lines.append(f"total: {params:,} params ({trainable:,} trainable), {sum(by_dtype.values()):,} bytes"
                     + (f" ({dtypes})" if dtypes else ""))
        return "\n".join(lines)
