"""Layer and RMS norms over the last axis as one hand-scheduled CPU kernel: a row's mean, its variance about the mean
(or its mean square) and the affine store, each a pass over the row in vectors.

TVM legalizes a layer norm into a mean and a mean square in one pass (the variance as their difference, which loses
digits where the mean is large against the spread) and the row rule takes vector partial sums only of a row some
width divides: 1024 rows of 244 summed 4 lanes at a time. Here the row's last vector overlaps the one before it
(`row_vectors`), a select constant per lane keeps its repeated lanes out of the sums, and the variance is summed
about the mean, the row read again from L1. Each sum runs in `CHAINS` independent vector accumulators.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T
from tvm.target import Target

from .cpu import cpu_model
from .relax_rewrite import call_on_rows, call_rewrites
from .row_vectors import RowSplit, across, at, splat

KERNEL_NAME = "norm_rows"
CHAINS = 4  # independent accumulators a sum over a row's vectors alternates between (an add's latency is 3-4 cycles)
_NORMS = {tvm.ir.Op.get("relax.nn.layer_norm"): True, tvm.ir.Op.get("relax.nn.rms_norm"): False}


def norm_rows_kernel(width: int, lanes: int, epsilon: float, centered: bool) -> tirx.PrimFunc:
    """The scheduled kernel of a layer norm (`centered`: (x - mean) / sqrt(var + eps) * gamma + beta) or an RMS norm
    (x / sqrt(mean(x²) + eps) * gamma) over the rows of float32 [rows, `width`] (rows symbolic), in vectors of at
    most `lanes` (`RowSplit`)."""
    split = RowSplit.of(width, lanes)
    step, whole, tail = split.step, split.whole, split.tail
    chains = max(1, min(CHAINS, whole))
    groups, rest = divmod(whole, chains)

    def mean_of(sums: tirx.Buffer) -> tirx.PrimExpr:
        """The accumulators' lanes summed, over the row's width."""
        vectors = [sums[at(c * step, step)] for c in range(chains)]
        return across(functools.reduce(operator.add, vectors), step, operator.add) * tirx.const(1 / width, "float32")

    def affine(x: tirx.Buffer, gamma: tirx.Buffer, beta: tirx.Buffer, row: tirx.PrimExpr, start: tirx.PrimExpr,
               mean: tirx.PrimExpr, inverse: tirx.PrimExpr) -> tirx.PrimExpr:
        value = (x[row, at(start, step)] - splat(mean, step)) * splat(inverse, step) * gamma[at(start, step)]
        return value + beta[at(start, step)] if centered else value

    @T.macro
    def row_sum(sums: T.Buffer, term: Callable[[tirx.PrimExpr], tirx.PrimExpr]):
        """`term` (the vector from a start element) over the row, the last vector's repeated lanes left out,
        alternating between the `chains` accumulators of `sums`."""
        for c in T.unroll(chains):
            sums[at(c * step, step)] = splat(0.0, step)
        sums[at(0, step)] = split.fresh(term(tail))
        for g in range(groups):
            for c in T.unroll(chains):
                sums[at(c * step, step)] = sums[at(c * step, step)] + term((g * chains + c) * step)
        for c in T.unroll(rest):
            sums[at(c * step, step)] = sums[at(c * step, step)] + term((groups * chains + c) * step)

    @T.prim_func(private=True, check_well_formed=False)
    def norm(x_handle: T.handle, gamma: T.Buffer((width,), "float32"), beta: T.Buffer((width,), "float32"),
             out_handle: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        rows = T.int64()
        x = T.match_buffer(x_handle, (rows, width), "float32")
        out = T.match_buffer(out_handle, (rows, width), "float32")
        with T.sblock("root"):  # TVM's reshape detection (RewriteDataflowReshape) reads a kernel's root block
            for row in T.parallel(rows):
                sums = T.decl_buffer((chains * step,), "float32", scope="local")
                if centered:
                    row_sum(sums, lambda start, row=row: x[row, at(start, step)])
                mean = T.bind(mean_of(sums) if centered else T.float32(0))
                row_sum(sums, lambda start, row=row, mean=mean: _square(x[row, at(start, step)] - splat(mean, step)))
                inverse = T.bind(T.float32(1) / T.sqrt(mean_of(sums) + T.float32(epsilon)))
                for v in range(whole):
                    out[row, at(v * step, step)] = affine(x, gamma, beta, row, v * step, mean, inverse)
                out[row, at(tail, step)] = affine(x, gamma, beta, row, tail, mean, inverse)

    return norm


def _square(value: tirx.PrimExpr) -> tirx.PrimExpr:
    return value * value


def is_row_norm(call: relax.Call) -> bool:
    """Whether `call` is a float32 layer or RMS norm over its last axis alone, of static non-zero width, with
    float32 gamma (and beta) of that width."""
    if call.op not in _NORMS or call.ty.dtype != "float32" or call.ty.ndim < 1:
        return False
    width = call.ty.shape[-1]
    axes = [int(a) % call.ty.ndim for a in call.attrs.axes]
    return axes == [call.ty.ndim - 1] and isinstance(width, tirx.IntImm) and int(width) > 0 and all(
        a.ty.dtype == "float32" and a.ty.ndim == 1 for a in call.args[1:])


def row_norms(target: Target) -> tvm.transform.Pass:
    """The module pass computing every layer and RMS norm `is_row_norm` takes with `norm_rows_kernel`."""
    lanes = cpu_model(target).lanes()

    def rewrite(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        if not is_row_norm(call):
            return None
        centered, width = _NORMS[call.op], int(call.ty.shape[-1])
        kernel = norm_rows_kernel(width, lanes, float(call.attrs.epsilon), centered)
        x, gamma, *beta = call.args
        beta = beta or [relax.const(np.zeros(width, np.float32))]  # an RMS norm: nothing added
        return call_on_rows(builder, builder.add_func(kernel, KERNEL_NAME), x, gamma, *beta)

    return call_rewrites("KilnRowNorms", rewrite)
