"""Stochastic ops. Randomness comes from the op's own seed mixed with the run's seed, so two runs with the
same run seed draw the same masks even after passes reorder or remove other ops."""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np

from ..attrs import FLOAT, INT, Attr
from ..dtypes import DType
from ..errors import ShapeError
from ..scoped import scoped
from ..traits import Trait
from .common import define, floating

_run_seed: contextvars.ContextVar[int] = contextvars.ContextVar("kiln_run_seed", default=0)


def run_seed(seed: int) -> contextlib.AbstractContextManager[None]:
    """Evaluate stochastic ops under this run seed."""
    return scoped(_run_seed, seed)


def rank_seed(seed: int, rank: int) -> int:
    """Rank `rank`'s run seed in a data-parallel group, so each rank draws its own masks: rank 0 (a single process)
    keeps `seed`, the rank goes in bits 40 up (distinct for 2^40 steps)."""
    return seed + (rank << 40)


def _dropout_infer(ts, attrs):
    floating("dropout", 0, ts[0])
    if ts[1].dtype is not DType.bool or ts[1].rank != 0:
        raise ShapeError(f"dropout: operand 1 (training flag) must be a bool scalar, got {ts[1]}")
    if not 0.0 <= attrs["p"] < 1.0:
        raise ShapeError(f"dropout: p = {attrs['p']} is outside [0, 1)")
    return (ts[0],)


def _dropout(xs, attrs):
    x, training = xs
    if not bool(training) or attrs["p"] == 0.0:
        return (x,)
    rng = np.random.default_rng([attrs["seed"], _run_seed.get()])
    keep = rng.random(x.shape) >= attrs["p"]
    return ((x * keep / (1.0 - attrs["p"])).astype(x.dtype),)


define("dropout", ("x", "training"), _dropout_infer, _dropout,
       {"p": Attr(FLOAT, 0.5), "seed": Attr(INT, 0, "per-op stream, mixed with the run seed")},
       doc="zero each element with probability p and scale the rest by 1/(1-p) while training is true",
       traits={Trait.ELEMENTWISE, Trait.STOCHASTIC})
