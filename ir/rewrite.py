"""The one rewrite mechanism: replay ops into a function builder, offering each op to a list of rules.

Replaying maps each op's operands (values through a value mapping, `@symbols` through a symbol mapping) and
offers the op to the rules. A rule looks at an op whose operands are already rewritten and returns replacement
operands for its results, or None to keep it. Ops a rule emits are offered to the rules too. Unchanged ops are
reused, so a pass that changes nothing costs one walk and no allocation. The same driver rewrites a function in
place (canonicalize, cse, fold-constants), copies one into another (autodiff's forward, the captured step) and
recomputes ops (checkpoint). `prune` removes ops nothing uses.

Locations are kept here, so passes need not think of them: a replayed op keeps its location, ops a rule emits
take the location of the op it rewrites, and when a rule replaces an op by all results of an earlier op of the
same kind (cse merging equal ops) the survivor's location becomes the fusion of both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .builder import FunctionBuilder, Operandish
from .errors import PassError
from .gcpause import gc_paused
from .graph import Function, Graph, Op, Operand, SymRef, Value
from .location import Location, fuse, located
from .tracking import RewriteHook, active_hook
from .types import TensorType

_MAX_DEPTH = 32


class Rewriter:
    """Builds a function in `builder`; rules receive the rewriter to inspect the graph and emit new ops.

    `symbols` maps each `@name` operand of a replayed op (by default symbols stay as they are). `hook`, when
    given, sees each replacement a rule offers and may veto it (bisection), keeping the op as it was."""

    def __init__(self, graph: Graph, builder: FunctionBuilder, rules: Sequence[Rule] = (),
                 symbols: Callable[[SymRef], Operand] | None = None, hook: RewriteHook | None = None):
        self.graph, self.builder, self.rules, self.symbols = graph, builder, rules, symbols
        self.hook = hook
        self.changed = False
        self._depth = 0
        self._fused: dict[int, tuple[Op, list[Location]]] = {}  # id(survivor) -> it, the locations merged into it

    @classmethod
    def in_place(cls, graph: Graph, fn: Function, rules: Sequence[Rule] = (), hook: RewriteHook | None = None
                 ) -> Rewriter:
        """A rewriter rebuilding `fn` itself: same arguments, its value names taken."""
        builder = FunctionBuilder(fn.name, graph.symbol)
        builder.args = list(fn.args)
        builder.taken = {a.name for a in fn.args} | {r.name for op in fn.ops for r in op.results}
        return cls(graph, builder, rules, hook=hook)

    def emit(self, kind: str, *operands: Operandish, **attrs: Any) -> Value:
        """Create a single-result op through the builder and offer it to the rules."""
        op = self.builder.make(kind, self.builder.operands(kind, operands), attrs)
        (result,) = self.process(op)
        return result  # type: ignore[return-value]

    def emit_as(self, type: TensorType, kind: str, *operands: Operandish, **attrs: Any) -> Value:
        """`emit` of an op whose result type the rule knows by construction (the type of the op it rewrites):
        inference is skipped, so a rule emitting many ops stays cheap; the verifier re-infers the type."""
        op = self.builder.make(kind, self.builder.operands(kind, operands), attrs, types=(type,))
        (result,) = self.process(op)
        return result  # type: ignore[return-value]

    def process(self, op: Op) -> tuple[Operand, ...]:
        """Offer `op` to the rules; append it unless one replaces it. Returns the values for its results."""
        self._depth += 1
        try:
            if self._depth > _MAX_DEPTH:
                raise located(op.loc, PassError(f"rewrite rules recursed more than {_MAX_DEPTH} levels on {op.kind}"))
            if not self.rules:
                self.builder.ops.append(op)
                return op.results
            outer, self.builder.loc = self.builder.loc, op.loc  # what the rules emit for op is at op's location
            try:
                for rule in self.rules:
                    mark = len(self.builder.ops)
                    replacement = rule(self, op)
                    if replacement is not None:
                        if self.hook is not None and not self.hook.allow_rewrite(op):
                            del self.builder.ops[mark:]  # what the rule emitted for the vetoed replacement
                            continue
                        replacement = tuple(replacement)
                        self._check(rule, op, replacement)
                        self._merge(op, replacement)
                        self.changed = True
                        return replacement
            finally:
                self.builder.loc = outer
            self.builder.ops.append(op)
            return op.results
        finally:
            self._depth -= 1

    def _check(self, rule: Rule, op: Op, replacement: tuple[Operand, ...]) -> None:
        got = [r.type for r in replacement]
        want = [r.type for r in op.results]
        if got != want:
            raise located(op.loc, PassError(f"rule {getattr(rule, '__name__', rule)} replaced {op.kind} results of "
                                            f"types {list(map(str, want))} with {list(map(str, got))}"))

    def _merge(self, op: Op, replacement: tuple[Operand, ...]) -> None:
        """Note `op`'s location on the op it merges into: an earlier op of its kind giving all the replacement."""
        first = replacement[0] if replacement else None
        survivor = first.owner if isinstance(first, Value) else None
        if (op.loc is None or survivor is None or survivor.kind != op.kind or survivor.loc == op.loc
                or survivor.results != replacement):
            return
        self._fused.setdefault(id(survivor), (survivor, []))[1].append(op.loc)

    def _with_fused_locations(self, ops: list[Op], results: tuple[Operand, ...]
                              ) -> tuple[tuple[Op, ...], tuple[Operand, ...]]:
        """`ops` with merged locations fused into their survivors. A survivor is copied rather than changed, as it
        may be an op of the input function; its users are copied to use the copy's results."""
        if not self._fused:
            return tuple(ops), results
        values: dict[int, Operand] = {}
        out = []
        for op in ops:
            merged = self._fused.get(id(op))
            operands = tuple([values.get(id(o), o) for o in op.operands])
            if merged is None and operands == op.operands:
                out.append(op)
                continue
            loc = fuse([op.loc, *merged[1]]) if merged is not None else op.loc
            new = Op(op.kind, operands, op.attrs, tuple(Value(r.type, r.name) for r in op.results), loc)
            values.update((id(a), b) for a, b in zip(op.results, new.results))
            out.append(new)
        return tuple(out), tuple(values.get(id(r), r) for r in results)

    def mapped(self, o: Operand, values: Mapping[int, Operand]) -> Operand:
        """What operand `o` of a replayed op becomes: a symbol through `symbols`, a value through `values`."""
        if isinstance(o, SymRef):
            return self.symbols(o) if self.symbols is not None else o
        return values.get(id(o), o)

    def replay(self, ops: Iterable[Op], values: dict[int, Operand], rename: Callable[[str], str] | None = None
               ) -> None:
        """Offer each op, operands mapped, to the rules; `values` learns what its results became. An op whose
        operands are unchanged is reused, unless `rename` is given: then every op is copied, results renamed."""
        mapped, get = self.mapped, values.get
        for op in ops:
            if self.symbols is None:  # `mapped` inline: no symbol's id is a key of `values` (its keys are live Values)
                operands = tuple([get(id(o), o) for o in op.operands])
            else:
                operands = tuple([mapped(o, values) for o in op.operands])
            if rename is None and operands == op.operands:  # values compare by identity, symbols by name and type
                candidate = op
            else:
                names = [rename(r.name) if rename is not None else r.name for r in op.results]
                self.builder.taken.update(names)
                results = tuple([Value(r.type, n) for r, n in zip(op.results, names)])
                candidate = Op(op.kind, operands, op.attrs, results, op.loc)
            for old, new in zip(op.results, self.process(candidate)):
                if new is not old:
                    values[id(old)] = new

    def inline(self, fn: Function, args: Sequence[Operand], rename: Callable[[str], str] | None = None
               ) -> tuple[Operand, ...]:
        """Replay `fn`'s ops with its arguments bound to `args`; returns what its results became."""
        values: dict[int, Operand] = {id(a): b for a, b in zip(fn.args, args)}
        self.replay(fn.ops, values, rename)
        return tuple(self.mapped(r, values) for r in fn.results)

    def run(self, fn: Function) -> Function:
        """`fn` rewritten in place (the rewriter from `in_place`); `fn` itself when no rule changed anything."""
        results = self.inline(fn, fn.args)
        if not self.changed and all(a is b for a, b in zip(results, fn.results)):
            return fn
        ops, results = self._with_fused_locations(self.builder.ops, results)
        return Function(fn.name, fn.args, ops, results)


Rule = Callable[[Rewriter, Op], Sequence[Operand] | None]


def rewrite(graph: Graph, make_rules: Callable[[], Sequence[Rule]]) -> Graph:
    """Apply fresh rules (from `make_rules`, so rule state is per function) to every function. The rewrites are
    optional, so an active rewrite hook (`kiln.ir.tracking`) counts them and may skip them."""
    functions = {}
    hook = active_hook()
    with gc_paused():
        for name, fn in graph.functions.items():
            functions[name] = Rewriter.in_place(graph, fn, make_rules(), hook).run(fn)
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
