"""autodiff: reverse-mode differentiation as a pass. `autodiff{function=forward}` adds a function
`forward_backward` and leaves every existing function unchanged.

The differentiated function's FIRST result must be a scalar loss (a rank-0 float). `forward_backward` takes the
same arguments and returns, in order:

    loss, the function's other results (unchanged), d loss / d p for every parameter p whose effective `grad`
    is true, in the graph's parameter order.

Each gradient result is a value named `%grad.<param path>` (e.g. `%grad.fc1.weight`), so printed IR says which is
which; the order above is the contract, the names a convenience that later passes may lose (cse can merge two
gradient values, canonicalize can forward one). A parameter with grad = true that the loss does not depend on gets
zeros.

How it works: the function's ops are copied (replayed by `kiln.ir.Rewriter`), then walked backwards from the
loss, calling each op kind's gradient rule (`kiln.ir.grad_rules`, written in IR ops) and summing the gradients of
values used more than once. Only ops on a path from a trainable parameter to the loss are differentiated (activity
analysis), and each rule is told which operands need a gradient (its `GradContext`); whatever backward op still
ends up unused (the gradient of a frozen parameter, of an input) is removed by dead-code elimination at the end,
so frozen parameters cost nothing.
Derived parameters (`reparam @w = lora(@base, @a, @b)`) pass their gradient to their operands through the
derivation's own rule: a frozen base gets none, trainable factors do.

Flags (dropout, batch_norm training) are read at run time by the backward as by the forward, so a later `train`
or `valid` keeps `forward_backward` consistent; the set of gradients returned is fixed when the pass runs.
Every forward value the backward needs is kept; the `checkpoint` pass, run afterwards, recomputes some instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Function, FunctionBuilder, Graph, Op, Operand, PassError, Rewriter, SymRef, Value, prune
from kiln.ir.grad_rules import rule_for
from kiln.ir.gradients import GradContext, conform, emit
from kiln.ir.location import fuse

from .base import Pass

GRAD_PREFIX = "grad."


def gradient_name(param: str) -> str:
    """The name of the `forward_backward` value holding d loss / d param."""
    return GRAD_PREFIX + param


def _key(o: Operand) -> tuple[str, object]:
    return ("sym", o.name) if isinstance(o, SymRef) else ("val", id(o))


def _compatible(a, b) -> bool:
    """Same dtype and rank, and no two static dims that differ."""
    return (a.dtype is b.dtype and a.rank == b.rank
            and all(x is None or y is None or x == y for x, y in zip(a.shape, b.shape)))


def differentiate(graph: Graph, fn: Function, name: str = "forward_backward") -> Function:
    """The function `name` computing fn's results and the gradients of its first result (see the module doc)."""
    if not fn.results:
        raise PassError(f"autodiff: @{fn.name} returns nothing; its first result must be a scalar loss")
    loss = fn.results[0]
    if loss.type.rank != 0 or not loss.type.dtype.is_float:
        raise PassError(f"autodiff: the first result of @{fn.name} must be a scalar float loss, got {loss.type}")

    fb = FunctionBuilder(name, graph.symbol)
    results = Rewriter(graph, fb).inline(fn, [fb.input(a.name, a.type) for a in fn.args], rename=fb.unique)
    forward_ops = list(fb.ops)
    forward_values = {id(v) for v in fb.args} | {id(r) for op in forward_ops for r in op.results}
    loss = results[0]

    # activity: which symbols and values depend on a trainable parameter
    trainable = [p for p in graph.params.values() if p.grad and p.type.dtype.is_float]
    active_syms = {p.name for p in trainable}
    active_syms |= {r.name for r in graph.reparams.values() if any(o in active_syms for o in r.operands)}
    active: set[tuple[str, object]] = {("sym", s) for s in active_syms}

    def is_active(o: Operand) -> bool:
        return _key(o) in active and o.type.dtype.is_float

    for op in forward_ops:
        if any(is_active(o) for o in op.operands):
            active.update(_key(r) for r in op.results if r.type.dtype.is_float)

    grads: dict[tuple[str, object], Value] = {}

    def add_grad(o: Operand, g: Value) -> None:
        k = _key(o)
        if k not in grads:
            grads[k] = g
            return
        fb.loc = fuse(v.owner.loc if v.owner is not None else None for v in (grads[k], g))  # of its contributions
        grads[k] = emit(fb, "add", grads[k], g)
        fb.loc = None

    def backward(op: Op, out: tuple[Value | None, ...] | None = None) -> None:
        if out is None:
            out = tuple(grads.get(_key(r)) if is_active(r) else None for r in op.results)
        wants = tuple(is_active(o) for o in op.operands)
        if all(g is None for g in out) or not any(wants):
            return
        rule = rule_for(op.kind)
        if rule is None:
            raise PassError(f"autodiff: op {op.kind!r} has no gradient rule")
        fb.loc = op.loc  # an op's backward ops are at its location
        try:
            got = tuple(rule(GradContext(fb, wants), op, out))
        finally:
            fb.loc = None
        if len(got) != len(op.operands):
            raise PassError(f"autodiff: the {op.kind} gradient rule returned {len(got)} gradients for "
                            f"{len(op.operands)} operands")
        for i, (o, g) in enumerate(zip(op.operands, got)):
            if g is None or not wants[i]:
                continue
            if not _compatible(o.type, g.type):
                raise PassError(f"autodiff: the {op.kind} gradient rule gave operand {i} a gradient of type {g.type} "
                                f"for an operand of type {o.type}")
            add_grad(o, g)

    if is_active(loss):
        grads[_key(loss)] = fb.constant(1.0, loss.type.dtype)
    for op in reversed(forward_ops):
        backward(op)
    for r in graph.reparams.values():  # derived parameters hand their gradient to the stored ones
        if ("sym", r.name) in grads:
            # recomputed only if the rule uses it; dead otherwise and pruned
            (derived,) = fb.append(r.kind, tuple(fb.sym(o) for o in r.operands), r.attrs)
            assert derived.owner is not None
            backward(derived.owner, (grads[("sym", r.name)],))

    named: set[int] = set()
    out_grads: list[Operand] = []
    for p in trainable:
        g = grads.get(("sym", p.name))
        label = gradient_name(p.name)
        if label in fb.taken:
            raise PassError(f"autodiff: @{fn.name} already has a value named %{label}")
        fb.taken.add(label)
        if g is None:
            g = emit(fb, "zeros", shape=p.type.shape, dtype=p.type.dtype)
        g = conform(fb, g, p.type)
        if id(g) in forward_values or id(g) in named:  # not ours to rename: a fresh value with the name
            g = emit(fb, "reshape", g, shape=p.type.shape)
        g.name = label
        named.add(id(g))
        out_grads.append(g)
    return prune(fb.finish([*results, *out_grads]))


@dataclass(frozen=True)
class Autodiff(Pass):
    """Add `forward_backward`: `function`'s results then d loss / d param for each trainable parameter."""

    name = "autodiff"
    function: str = "forward"
    """the function to differentiate"""
    output: str = "forward_backward"
    """the name of the function computing outputs and gradients"""

    def apply(self, graph: Graph) -> Graph:
        fn = graph.functions.get(self.function)
        if fn is None:
            raise PassError(f"autodiff: module @{graph.name} has no function @{self.function}")
        if self.output == self.function:
            raise PassError(f"autodiff: the output function must differ from @{self.function}")
        return graph.with_function(differentiate(graph, fn, self.output))
