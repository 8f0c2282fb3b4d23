"""checkpoint: trade memory for compute in `forward_backward` by recomputing forward values in the backward.

`checkpoint{strategy=none|balanced|all}` rewrites `forward_backward` (the autodiff pass's output). Its forward ops
are those the forward results (loss and the other results of `@forward`, the first results) depend on; the rest
is the backward. Each forward value a backward op uses is either kept (the backward reads the forward's value,
which so stays alive through the forward) or recomputed: its op, and recursively every operand it needs that is
not kept, is copied (replayed by `kiln.ir.Rewriter`, named `%<value>.recompute`) right before the first backward
op that uses it.

    none      keep every forward value (the identity).
    balanced  recompute the ops with `Trait.MEMORY_BOUND` (elementwise math and activations, dropout, data
              movement including take and gather, constants); keep compute-bound and reducing ones (matmul,
              linear, convolutions, pooling, normalizations, softmax, reductions).
    all       recompute everything inside regions and keep only the regions' inputs: the forward ops are cut
              into regions of about sqrt(n) consecutive ops, and a value is kept only when a later region
              (or the function's results) uses it.
    auto      (the default) the strategy of the trainable parameters' `checkpointing` attribute, as a module built
              on `Device("cpu").autodiff(checkpointing="balanced")` sets it; none when unset.

dropout recomputes to the same mask (its mask depends on its seed, the run seed and the shape only), so results
are unchanged. Run this after `cse`, which would merge the copies back into the values they recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from kiln.ir import Function, Graph, Op, Operand, PassError, Rewriter, Trait, Value, lookup, prune

from .base import Pass


def strategy_of(graph: Graph) -> str:
    """The checkpointing strategy the trainable parameters carry ("none" when they carry none)."""
    found = {p.checkpointing for p in graph.params.values() if p.grad and p.checkpointing is not None}
    if len(found) > 1:
        raise PassError(f"checkpoint: trainable parameters disagree on checkpointing ({', '.join(sorted(found))})")
    return found.pop() if found else "none"


def forward_ops(fn: Function, n_forward: int) -> list[Op]:
    """The ops the first `n_forward` results depend on, in order."""
    needed = {r for r in fn.results[:n_forward] if isinstance(r, Value)}  # Values hash by identity in C: no id()
    ops = []
    for op in reversed(fn.ops):
        if not needed.isdisjoint(op.results):
            ops.append(op)
            needed.update(o for o in op.operands if isinstance(o, Value))
    return ops[::-1]


def _kept(fn: Function, forward: list[Op], strategy: str) -> set[int]:
    """ids of the forward values the backward reads as they are."""
    returned = {id(r) for r in fn.results if isinstance(r, Value)}
    if strategy == "none":
        return {id(r) for op in forward for r in op.results}
    if strategy == "balanced":
        return {id(r) for op in forward for r in op.results if not lookup(op.kind).has(Trait.MEMORY_BOUND)} | returned
    # A forward op reads arguments, symbols and forward values; a value it reads that its own region did not make
    # comes from an earlier region. Walking region by region keeps every lookup in one region's small set.
    size = max(1, math.isqrt(len(forward) - 1) + 1) if forward else 1
    args = {id(a) for a in fn.args}
    kept = set(returned)
    for start in range(0, len(forward), size):
        region = forward[start:start + size]
        made = {id(r) for op in region for r in op.results}
        kept.update(id(o) for op in region for o in op.operands
                    if o.__class__ is Value and id(o) not in made and id(o) not in args)
    return kept


def checkpoint(graph: Graph, fn: Function, n_forward: int, strategy: str) -> Function:
    """fn with the forward values its backward uses recomputed there unless the strategy keeps them."""
    forward = forward_ops(fn, n_forward)
    kept = _kept(fn, forward, strategy)
    made = {id(r) for op in forward for r in op.results}
    rw = Rewriter.in_place(graph, fn)
    backward: dict[int, Operand] = {}  # backward results and recomputed forward values, by original id

    def fresh(name: str) -> str:
        new, k = f"{name}.recompute", 1
        while new in rw.builder.taken:
            new, k = f"{name}.recompute{k}", k + 1
        return new

    def missing(o: Operand) -> bool:
        return isinstance(o, Value) and id(o) in made and id(o) not in kept and id(o) not in backward

    def recompute(root: Operand) -> None:
        """Copy the op of a forward value the backward may not read as it is (and what it needs), once: a
        post-order walk with its own stack, so a chain of any length recomputes without Python recursion."""
        stack: list[tuple[Operand, bool]] = [(root, False)]
        while stack:
            o, operands_done = stack.pop()
            if not missing(o):
                continue
            assert isinstance(o, Value) and o.owner is not None
            if operands_done:
                rw.replay([o.owner], backward, rename=fresh)
            else:
                stack.append((o, True))
                stack.extend((x, False) for x in reversed(o.owner.operands))

    upcoming = iter(forward)  # forward is a subsequence of fn.ops: no set of them to look each op up in
    next_forward = next(upcoming, None)
    for op in fn.ops:
        if op is next_forward:
            rw.replay([op], {})
            next_forward = next(upcoming, None)
            continue
        for o in op.operands:
            recompute(o)
        rw.replay([op], backward)
    if len(rw.builder.ops) == len(fn.ops):
        return fn
    results = tuple(rw.mapped(r, {} if id(r) in made else backward) for r in fn.results)
    return prune(Function(fn.name, fn.args, tuple(rw.builder.ops), results))


@dataclass(frozen=True)
class Checkpoint(Pass):
    """Recompute forward values in `output`'s backward instead of keeping them, per the strategy."""

    name = "checkpoint"
    strategy: Literal["auto", "none", "balanced", "all"] = "auto"
    """which forward values the backward recomputes instead of keeping (auto: the parameters' setting)"""
    function: str = "forward"
    """the differentiated function"""
    output: str = "forward_backward"
    """the function holding its backward"""

    def apply(self, graph: Graph) -> Graph:
        fn, forward = graph.functions.get(self.output), graph.functions.get(self.function)
        if fn is None or forward is None:
            missing = self.output if fn is None else self.function
            raise PassError(f"checkpoint: module @{graph.name} has no function @{missing} (run autodiff first)")
        strategy = strategy_of(graph) if self.strategy == "auto" else self.strategy
        new = checkpoint(graph, fn, len(forward.results), strategy)
        return graph if new is fn else graph.with_function(new)
