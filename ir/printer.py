"""The `.kir` text printer. Output is canonical: parsing it and printing again gives the same text."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from . import init as initializers
from . import registry
from .dtypes import DType
from .graph import FlagNode, Function, Graph, Init, Op, Operand, ParamNode, ReparamNode, SymRef
from .location import loc_text
from .types import TensorType

_BARE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.$\-]*\Z")


def name_text(name: str) -> str:
    """A symbol or value name, quoted when it holds characters the bare form does not allow."""
    return name if _BARE_NAME.match(name) else json.dumps(name)


def float_text(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return repr(float(x))


def _element_text(x: Any, dtype: DType) -> str:
    if dtype is DType.bool:
        return "true" if x else "false"
    if dtype.is_float:
        if dtype in (DType.f32, DType.f16) and np.isfinite(x):
            s = str(x)  # numpy's shortest text that round-trips at this width
            return s if any(c in s for c in ".e") else s + ".0"
        return float_text(float(x))
    return str(int(x))


def dense_text(value: np.ndarray) -> str:
    dtype = DType.from_numpy(value.dtype)
    t = TensorType(tuple(value.shape), dtype)
    flat = value.reshape(-1)
    # a splat must be bitwise equal: 0.0 == -0.0, but printing [0.0, -0.0] as `0.0` would lose the sign
    if flat.size and flat.tobytes() == flat[:1].tobytes() * flat.size and not (dtype.is_float and np.isnan(flat[0])):
        return f"dense<{t}, {_element_text(flat[0], dtype)}>"
    return f"dense<{t}, [{', '.join(_element_text(x, dtype) for x in flat)}]>"


def attr_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return float_text(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, DType):
        return value.value
    if isinstance(value, TensorType):
        return str(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(attr_text(v) for v in value) + "]"
    if isinstance(value, np.ndarray):
        return dense_text(value)
    raise TypeError(f"attribute value {value!r} has no text form")


def attr_dict_text(items: list[tuple[str, str]]) -> str:
    return " {" + ", ".join(f"{k} = {v}" for k, v in items) + "}" if items else ""


def op_attrs_text(kind: str, attrs: dict[str, Any]) -> str:
    schema = registry.lookup(kind).attrs
    items = [(k, attr_text(v)) for k, v in attrs.items()
             if not (k in schema and _is_default(v, schema[k].default))]
    return attr_dict_text(items)


def _is_default(value: Any, default: Any) -> bool:
    return not isinstance(value, np.ndarray) and type(value) is type(default) and value == default


def init_text(init: Init) -> str:
    if init.kind == initializers.PYTHON:
        return initializers.PYTHON  # a callable has no text: the parser refuses it by name
    args = ", ".join(f"{k} = {attr_text(v)}" for k, v in init.args)
    return f"{init.kind}({args})" if args else init.kind


def operand_text(o: Operand) -> str:
    return f"@{name_text(o.name)}" if isinstance(o, SymRef) else f"%{name_text(o.name)}"


def param_text(p: ParamNode, elide_data: bool = False) -> str:
    items = [("id", f'"0x{p.id:016x}"')]
    if p.init is not None:
        items.append(("init", init_text(p.init)))
    if p.data is not None:
        items.append(("data", "elided" if elide_data else dense_text(p.data)))
    if p.layout is not None:
        items.append(("layout", str(p.layout)))
    items.append(("grad", attr_text(p.grad)))
    if p.configured_grad != p.grad:
        items.append(("configured_grad", attr_text(p.configured_grad)))
    if p.device != "cpu":
        items.append(("device", json.dumps(p.device)))
    if p.autodiff:
        items.append(("autodiff", "true"))
    if p.checkpointing is not None:
        items.append(("checkpointing", json.dumps(p.checkpointing)))
    if p.buffer:
        items.append(("buffer", "true"))
    return f"param @{name_text(p.name)} : {p.type}{attr_dict_text(items)}"


def flag_text(f: FlagNode) -> str:
    items = [("id", f'"0x{f.id:016x}"')]
    if f.configured != f.value:
        items.append(("configured", attr_text(f.configured)))
    return f"flag @{name_text(f.name)} = {attr_text(f.value)}{attr_dict_text(items)}"


def reparam_text(r: ReparamNode) -> str:
    args = ", ".join(f"@{name_text(o)}" for o in r.operands)
    return f"reparam @{name_text(r.name)} : {r.type} = {r.kind}({args}){op_attrs_text(r.kind, dict(r.attrs))}"


def op_text(op: Op, locations: bool = False) -> str:
    """One op's line; `locations` appends its `loc(...)` where it has one."""
    results = ", ".join(f"%{name_text(r.name)}" for r in op.results)
    operands = ", ".join(operand_text(o) for o in op.operands)
    types = ", ".join(str(r.type) for r in op.results)
    at = f" {loc_text(op.loc)}" if locations and op.loc is not None else ""
    return f"{results} = {op.kind}{' ' + operands if operands else ''}{op_attrs_text(op.kind, op.attrs)} : {types}{at}"


def function_lines(fn: Function, indent: str = "  ", locations: bool = False) -> list[str]:
    args = ", ".join(f"%{name_text(a.name)}: {a.type}" for a in fn.args)
    rets = ", ".join(str(t) for t in fn.result_types)
    lines = [f"{indent}func @{name_text(fn.name)}({args}) -> ({rets}) {{"]
    lines.extend(f"{indent}  {op_text(op, locations)}" for op in fn.ops)
    lines.append(f"{indent}  return {', '.join(operand_text(r) for r in fn.results)}")
    lines.append(f"{indent}}}")
    return lines


def print_graph(graph: Graph, elide_data: bool = False, locations: bool = False) -> str:
    """The whole graph as `.kir` text; `elide_data` replaces parameter data by `elided`, `locations` writes each
    op's location (MLIR's `loc(...)`, which the parser reads back)."""
    lines = [f"module @{name_text(graph.name)} {{"]
    lines.extend("  " + param_text(p, elide_data) for p in graph.params.values())
    lines.extend("  " + flag_text(f) for f in graph.flags.values())
    lines.extend("  " + reparam_text(r) for r in graph.reparams.values())
    for fn in graph.functions.values():
        lines.extend(function_lines(fn, locations=locations))
    lines.append("}")
    return "\n".join(lines) + "\n"


Graph.printer = print_graph
