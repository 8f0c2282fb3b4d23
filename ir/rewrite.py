"""The one rewrite mechanism: rebuild a function op by op, offering each op to a list of rules.

A rule looks at an op whose operands are already rewritten and returns replacement operands for its
results, or None to keep it. Ops a rule emits are offered to the rules too. Unchanged ops are reused, so a
pass that changes nothing costs one walk and no allocation. `prune` removes ops nothing uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .builder import FunctionBuilder, Operandish
from .errors import PassError
from .gcpause import gc_paused
from .graph import Function, Graph, Op, Operand, SymRef, Value

_MAX_DEPTH = 32


class Rewriter:
    """Builds the rewritten function; rules receive it to inspect the graph and emit new ops."""

    def __init__(self, graph: Graph, fn: Function, rules: Sequence[Rule]):
        self.graph, self.rules = graph, rules
        self.builder = FunctionBuilder(fn.name, graph.symbol)
        self.builder.args = list(fn.args)
        self.builder.taken = {a.name for a in fn.args} | {r.name for op in fn.ops for r in op.results}
        self.changed = False
        self._depth = 0

    def emit(self, kind: str, *operands: Operandish, **attrs: Any) -> Value:
        """Create a single-result op through the builder and offer it to the rules."""
        op = self.builder.make(kind, self.builder.operands(kind, operands), attrs)
        (result,) = self.process(op)
        return result  # type: ignore[return-value]

    def process(self, op: Op) -> tuple[Operand, ...]:
        """Offer `op` to the rules; append it unless one replaces it. Returns the values for its results."""
        self._depth += 1
        try:
            if self._depth > _MAX_DEPTH:
                raise PassError(f"rewrite rules recursed more than {_MAX_DEPTH} levels on {op.kind}")
            for rule in self.rules:
                replacement = rule(self, op)
                if replacement is not None:
                    self._check(rule, op, tuple(replacement))
                    self.changed = True
                    return tuple(replacement)
            self.builder.ops.append(op)
            return op.results
        finally:
            self._depth -= 1

    def _check(self, rule: Rule, op: Op, replacement: tuple[Operand, ...]) -> None:
        got = [r.type for r in replacement]
        want = [r.type for r in op.results]
        if got != want:
            raise PassError(f"rule {getattr(rule, '__name__', rule)} replaced {op.kind} results of types "
                            f"{list(map(str, want))} with {list(map(str, got))}")

    def run(self, fn: Function) -> Function:
        mapping: dict[int, Operand] = {}

        def mapped(o: Operand) -> Operand:
            return o if isinstance(o, SymRef) else mapping.get(id(o), o)

        for op in fn.ops:
            operands = tuple(mapped(o) for o in op.operands)
            changed = any(a is not b for a, b in zip(operands, op.operands))
            candidate = _with_operands(op, operands) if changed else op
            for old, new in zip(op.results, self.process(candidate)):
                if new is not old:
                    mapping[id(old)] = new
        results = tuple(mapped(r) for r in fn.results)
        if not self.changed and all(a is b for a, b in zip(results, fn.results)):
            return fn
        return Function(fn.name, fn.args, tuple(self.builder.ops), results)


def _with_operands(op: Op, operands: tuple[Operand, ...]) -> Op:
    return Op(op.kind, operands, op.attrs, tuple(Value(r.type, r.name) for r in op.results))


Rule = Callable[[Rewriter, Op], Sequence[Operand] | None]


def rewrite(graph: Graph, make_rules: Callable[[], Sequence[Rule]]) -> Graph:
    """Apply fresh rules (from `make_rules`, so rule state is per function) to every function."""
    functions = {}
    with gc_paused():
        for name, fn in graph.functions.items():
            functions[name] = Rewriter(graph, fn, make_rules()).run(fn)
    if all(functions[n] is graph.functions[n] for n in functions):
        return graph
    return graph.replace(functions=functions)


def prune(fn: Function) -> Function:
    """Drop ops none of whose results reach the function's results."""
    live = {id(r) for r in fn.results if isinstance(r, Value)}
    kept: list[Op] = []
    for op in reversed(fn.ops):
        if any(id(r) in live for r in op.results):
            kept.append(op)
            live.update(id(o) for o in op.operands if isinstance(o, Value))
    if len(kept) == len(fn.ops):
        return fn
    kept.reverse()
    return Function(fn.name, fn.args, tuple(kept), fn.results)
