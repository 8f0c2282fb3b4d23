"""Which kiln ops stand behind the names a TVM run-time error mentions, so that error can name the user's line.

A compiled function's map takes names to the indices of the kiln ops (in the lowered function) behind them: each
symbolic dim (`x_0`) to the ops whose broadcast made two inputs share it, each input to the ops reading it, and
each PrimFunc (`add1`, as LegalizeOps names them) to the op whose Relax rule emitted it. A fused kernel's name
(`fused_add1_relu`) is split back into those parts. The map holds indices only, so a cached build serves every
graph of its structure; the ops' descriptions (kind and location) come from the graph compiled, or from an
exported library's sidecar.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import tvm
from tvm import relax

from kiln.ir import Function, KilnError

OpMap = dict[str, dict[str, list[int]]]  # function -> name -> op indices
_FUSED = "fused_"


class OpSources:
    """What lowering one function learned: the ops behind dims and inputs, and which op emitted each binding."""

    def __init__(self) -> None:
        self.names: dict[str, list[int]] = {}
        self.bindings: dict[str, int] = {}  # an op's result var (by name) -> its op

    def add(self, name: str, ops: Sequence[int]) -> None:
        if not ops:
            return
        known = self.names.setdefault(name, [])
        known.extend(op for op in ops if op not in known)

    def made(self, op: int, results: Sequence[str], inputs: Sequence[str]) -> None:
        """Op `op` emitted the bindings `results` and reads the function inputs `inputs`."""
        self.bindings.update(dict.fromkeys(results, op))
        for name in inputs:
            self.add(name, (op,))


def build_map(module: tvm.IRModule, sources: Mapping[str, OpSources]) -> OpMap:
    """The op map of a lowered module: its sources plus each PrimFunc LegalizeOps makes, named after the op
    that emitted the binding calling it (a rule's inner bindings belong to the op whose result follows them)."""
    legal = relax.transform.LegalizeOps()(module)
    out: OpMap = {}
    for function, src in sources.items():
        names = OpSources()
        for name, ops in src.names.items():
            names.add(name, ops)
        pending: list[str] = []
        for block in legal[function].body.blocks:
            for binding in block.bindings:
                value = binding.value
                if isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir")):
                    pending.append(value.args[0].name_hint)
                op = src.bindings.get(binding.var.name)
                if op is not None:
                    for kernel in pending:
                        names.add(kernel, (op,))
                    pending = []
        out[function] = names.names
    return out


def read_map(data: Any) -> OpMap:
    """An op map read back from JSON, checked: a ValueError says what is malformed."""
    if not (isinstance(data, dict) and all(isinstance(m, dict) for m in data.values())
            and all(isinstance(ops, list) and all(isinstance(i, int) for i in ops)
                    for m in data.values() for ops in m.values())):
        raise ValueError("not an object of objects of op-index lists")
    return data


def read_ops(data: Any) -> dict[str, list[str]] | None:
    """Op descriptions read back from JSON, checked; None when absent."""
    if data is None:
        return None
    if not (isinstance(data, dict) and all(isinstance(v, list) and all(isinstance(d, str) for d in v)
                                           for v in data.values())):
        raise ValueError("not an object of description lists")
    return data


def describe(fn: Function) -> list[str]:
    """Each op of `fn` as an error names it: its kind, and where it came from when known."""
    return [f"{op.kind} at {op.loc}" if op.loc is not None else op.kind for op in fn.ops]


def _kernels(token: str, names: Mapping[str, list[int]]) -> list[str]:
    """The known PrimFunc names a fused kernel's name concatenates (`fused_add1_relu` -> add1, relu), longest
    first at each step; what cannot be split is skipped."""
    rest, found = token[len(_FUSED):], []
    while rest:
        part = next((n for n in sorted(names, key=len, reverse=True)
                     if rest == n or rest.startswith(n + "_")), None)
        if part is None:
            rest = rest.partition("_")[2]
            continue
        found.append(part)
        rest = rest[len(part) + 1:]
    return found


def ops_named(message: str, names: Mapping[str, list[int]]) -> list[int]:
    """The ops behind the names `message` mentions, in op order."""
    hits: set[int] = set()
    for token in re.findall(r"[A-Za-z_]\w*", message):
        parts = _kernels(token, names) if token.startswith(_FUSED) else [token]
        for part in parts:
            hits.update(names.get(part, ()))
    return sorted(hits)


def explain(function: str, error: Exception, op_map: OpMap, ops: Sequence[str] | None) -> KilnError:
    """`error`, raised calling `function`, as a one-line kiln error naming the ops behind it: a TVM run-time
    failure becomes a KilnError, a kiln error (a ShapeError on an input) keeps its type."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    message = lines[-1] if lines else type(error).__name__
    hits = ops_named(message, op_map.get(function, {})) if ops is not None else []
    where = "; ".join(ops[i] for i in hits if i < len(ops))
    if isinstance(error, KilnError):
        return error if not where else type(error)(f"{where}: {error}")
    text = f"@{function} failed at run time: {message}"
    return KilnError(f"{where}: {text}" if where else text)
