"""data-parallel: the gradients of `forward_backward` averaged across the ranks, bucket by bucket, as soon as each
bucket's last gradient is computed, so a runtime can overlap the bucket's communication with the rest of the
backward.

`forward_backward` returns @forward's results, then the gradients (autodiff's contract). Walking its ops in order,
each gradient joins the open bucket when its producer runs; a bucket closes when it holds `bucket_bytes` or more
(or the dtype changes, a bucket being one flat buffer), and one `all_reduce {op = "mean"}` of its gradients is
placed right after that producer. The step's update then reads the averaged gradients. On one process an
all_reduce is the identity, so the program computes what it did before.

With `overlap` (the default) each all_reduce is split in two: `all_reduce_start` where the bucket closes hands it
to the engine, which communicates in the background while the rest of the backward computes, and
`all_reduce_wait`, at the end of the backward where the update first reads the averages, blocks for the result.

ZeRO stage 1 (`zero=1`) shards the update: `owners` gives each trainable parameter the rank that keeps its
optimizer state and updates it; the step builder reads `zero` and emits the update on the owner only, then a
`broadcast {src = owner}` that hands every rank the owner's new values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.ir import Function, FunctionBuilder, Graph, Op, PassError, TensorType, Value
from kiln.ir.gradients import count
from kiln.ir.rewrite import Rewriter, rewrite

from .base import Pass


def nbytes(t: TensorType) -> int:
    """The bytes of a static tensor type (a parameter's gradient always is one)."""
    return t.numel() * t.dtype.numpy.itemsize


def owners(types: Sequence[TensorType], world: int) -> tuple[int, ...]:
    """ZeRO-1's owner rank of each parameter: largest first, each to the rank holding the fewest bytes so far (ties
    to the lower rank), so the optimizer state per rank is balanced; the same on every rank."""
    held = [0] * world
    owner = [0] * len(types)
    for i in sorted(range(len(types)), key=lambda i: (-nbytes(types[i]), i)):
        owner[i] = min(range(world), key=lambda r: (held[r], r))
        held[owner[i]] += nbytes(types[i])
    return tuple(owner)


@dataclass(frozen=True)
class DataParallel(Pass):
    """Average the gradients of `forward_backward` across the data-parallel group in buckets, each reduced where its
    last gradient is computed."""

    name = "data-parallel"
    bucket_bytes: int = 1 << 20
    """a bucket closes once its gradients hold this many bytes (0: one all_reduce per gradient)"""
    zero: int = 0
    """ZeRO stage: 0 every rank updates every parameter, 1 each rank updates and keeps optimizer state for its share"""
    group: str = "world"
    """the process group the gradients are averaged over"""
    overlap: bool = True
    """start each bucket's all_reduce where it closes and wait for it at the end of the backward"""
    sync_batch_norm: bool = False
    """batch norm's training statistics over the global batch (the step builder runs `SyncBatchNorm` first)"""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 0:
            raise PassError(f"data-parallel: bucket-bytes = {self.bucket_bytes} is negative")
        if self.zero not in (0, 1):
            raise PassError(f"data-parallel: zero = {self.zero}; only ZeRO stages 0 and 1 exist here")

    def apply(self, graph: Graph) -> Graph:
        for needed in ("forward", "forward_backward"):
            if needed not in graph.functions:
                raise PassError(f"data-parallel: module @{graph.name} has no function @{needed} (run autodiff first)")
        fn = graph.functions["forward_backward"]
        n_forward = len(graph.functions["forward"].results)
        grads = fn.results[n_forward:]
        made = {id(r): i for i, op in enumerate(fn.ops) for r in op.results}
        if not grads or any(fn.ops[made[id(r)]].kind in ("all_reduce", "all_reduce_wait") for r in grads
                            if id(r) in made):
            return graph  # nothing to average, or averaged already
        order = sorted(range(len(grads)), key=lambda g: made.get(id(grads[g]), -1))
        closing = self._buckets(grads, order, made)
        builder = FunctionBuilder(fn.name, graph.symbol)
        builder.args = list(fn.args)
        builder.taken = {a.name for a in fn.args} | {r.name for op in fn.ops for r in op.results}
        reduced: dict[int, Value] = {}
        started: list[tuple[list[int], tuple[Value, ...], object]] = []
        for at in [-1, *range(len(fn.ops))]:
            if at >= 0:
                builder.ops.append(fn.ops[at])
            for bucket in closing.get(at, ()):
                members = [grads[g] for g in bucket]
                loc = fn.ops[at].loc if at >= 0 else None
                if self.overlap:
                    sent = builder.emit("all_reduce_start", *members, op="mean", group=self.group,
                                        bucket=len(started), loc=loc, names=[f"{m.name}.sent" for m in members])
                    started.append((bucket, sent if isinstance(sent, tuple) else (sent,), loc))
                    continue
                outs = builder.emit("all_reduce", *members, op="mean", group=self.group, loc=loc,
                                    names=[f"{m.name}.mean" for m in members])
                reduced.update(zip(bucket, outs if isinstance(outs, tuple) else (outs,)))
        for k, (bucket, sent, loc) in enumerate(started):  # the update is the averages' first reader
            outs = builder.emit("all_reduce_wait", *sent, op="mean", group=self.group, bucket=k, loc=loc,
                                names=[f"{grads[g].name}.mean" for g in bucket])
            reduced.update(zip(bucket, outs if isinstance(outs, tuple) else (outs,)))
        results = (*fn.results[:n_forward], *(reduced[g] for g in range(len(grads))))
        return graph.replace(functions={**graph.functions, fn.name: Function(fn.name, fn.args, tuple(builder.ops),
                                                                                 results)})

    def _buckets(self, grads: Sequence, order: Sequence[int], made: dict[int, int]) -> dict[int, list[list[int]]]:
        """Op index -> the buckets closing after it (index -1: gradients that are arguments or symbols)."""
        closing: dict[int, list[list[int]]] = {}
        bucket: list[int] = []
        size = 0
        for k, g in enumerate(order):
            if bucket and grads[g].type.dtype is not grads[bucket[0]].type.dtype:
                closing.setdefault(made.get(id(grads[bucket[-1]]), -1), []).append(bucket)
                bucket, size = [], 0
            bucket.append(g)
            size += nbytes(grads[g].type)
            if size >= self.bucket_bytes or k == len(order) - 1:
                closing.setdefault(made.get(id(grads[g]), -1), []).append(bucket)
                bucket, size = [], 0
        return closing


@dataclass(frozen=True)
class SyncBatchNorm(Pass):
    """Batch norm's training statistics over every rank's batch (torch's SyncBatchNorm): each `batch_norm` becomes
    its arithmetic with the per-channel sums and counts all-reduced (sum), so every rank normalizes with the global
    batch's mean and biased variance and updates its running statistics with them (unbiased by the global count).
    Run before autodiff: the all_reduces' gradients carry the statistics' gradients across the ranks. The identity
    in meaning on one process; a training flag unknown until run time selects between this and the running stats."""

    name = "sync-batch-norm"
    group: str = "world"
    """the process group the statistics are taken over"""

    def apply(self, graph: Graph) -> Graph:
        return rewrite(graph, lambda: (self._rule,))

    def _rule(self, rw: Rewriter, op: Op) -> tuple[Value, ...] | None:
        if op.kind != "batch_norm":
            return None
        fb, (x, gamma, beta, rm, rv, training) = rw.builder, op.operands
        eps, momentum, rank = op.attrs["eps"], op.attrs["momentum"], x.type.rank
        axes, dtype = (0, *range(2, rank)), x.type.dtype

        def c(v: float) -> Value:
            return fb.constant(v, dtype)

        def chan(v):  # [C] -> [C, 1, ...] against x [N, C, ...]
            return v if rank == 2 else fb.emit("reshape", v, shape=(-1, *(1,) * (rank - 2)))

        n = fb.emit("reshape", count(fb, x, axes, dtype), shape=(1,))
        total, n = fb.emit("all_reduce", fb.emit("sum", x, axes=axes), n, op="sum", group=self.group)
        mean = fb.emit("div", total, n)
        xc = fb.emit("sub", x, chan(mean))
        squares = fb.emit("all_reduce", fb.emit("sum", fb.emit("mul", xc, xc), axes=axes), op="sum", group=self.group)
        var = fb.emit("div", squares, n)
        scale = fb.emit("mul", gamma, fb.emit("rsqrt", fb.emit("add", var, c(eps))))
        y = fb.emit("add", fb.emit("mul", xc, chan(scale)), chan(beta))
        unbiased = fb.emit("div", fb.emit("mul", var, n), fb.emit("sub", n, c(1.0)))
        new_mean = fb.emit("add", fb.emit("mul", rm, c(1 - momentum)), fb.emit("mul", mean, c(momentum)))
        new_var = fb.emit("add", fb.emit("mul", rv, c(1 - momentum)), fb.emit("mul", unbiased, c(momentum)))
        frozen = fb.emit("mul", gamma, fb.emit("rsqrt", fb.emit("add", rv, c(eps))))
        y_eval = fb.emit("add", fb.emit("mul", fb.emit("sub", x, chan(rm)), chan(frozen)), chan(beta))
        return (fb.emit("where", training, y, y_eval), fb.emit("where", training, new_mean, rm),
                fb.emit("where", training, new_var, rv))
