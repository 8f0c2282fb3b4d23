"""Collective ops: a value combined across the ranks of a data-parallel group.

Which ranks there are is the run's business, not the graph's: the distributed runtime installs a `Communicator`
with `communicating(c)` around a run, and the reference semantics call it. With none installed the program runs
on one process, where a collective over a group of one is the identity.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..attrs import INT, STR, Attr, one_of
from ..scoped import scoped
from ..traits import Trait
from .common import define, floating, same_dtype

REDUCTIONS = ("mean", "sum")


class Communicator(Protocol):
    """Runs a collective over the process group named `group`; every rank calls it in the same order."""

    rank: int
    world_size: int

    def all_reduce(self, arrays: Sequence[np.ndarray], op: str, group: str) -> tuple[np.ndarray, ...]: ...

    def broadcast(self, arrays: Sequence[np.ndarray], src: int, group: str) -> tuple[np.ndarray, ...]: ...

    def all_reduce_start(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int) -> None: ...

    def all_reduce_wait(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int
                        ) -> tuple[np.ndarray, ...]: ...


_communicator: contextvars.ContextVar[Communicator | None] = contextvars.ContextVar("kiln_communicator", default=None)


def communicating(communicator: Communicator | None) -> contextlib.AbstractContextManager[None]:
    """Run collectives through `communicator` inside the with-block (None: a single process)."""
    return scoped(_communicator, communicator)


def current_communicator() -> Communicator | None:
    """The communicator collectives run through here, or None on a single process."""
    return _communicator.get()


def _all_reduce_infer(ts, attrs):
    for i, t in enumerate(ts):
        floating("all_reduce", i, t)
    same_dtype("all_reduce", ts)  # one bucket is one flat buffer of one dtype
    return tuple(ts)


def _through_communicator(method: str, *attr_names: str):
    """The reference of a collective: the identity on a single process, else the communicator's `method` on the
    operands and the named attributes."""
    def run(xs, attrs):
        communicator = _communicator.get()
        return tuple(xs) if communicator is None else getattr(communicator, method)(xs, *(attrs[a] for a in attr_names))
    return run


define("all_reduce", ("xs*",), _all_reduce_infer, _through_communicator("all_reduce", "op", "group"),
       {"op": Attr(one_of(*REDUCTIONS), "mean", "how the ranks' values combine"),
        "group": Attr(STR, "world", "the process group")},
       doc="every rank's operands combined elementwise across the group (one bucket: one communication); "
           "the identity on a single process",
       traits={Trait.COLLECTIVE})


def _started(xs, attrs):
    """all_reduce_start hands the bucket to the communicator, which reduces it in the background; its results are
    its operands, which only order the wait after it."""
    communicator = _communicator.get()
    if communicator is not None:
        communicator.all_reduce_start(xs, attrs["op"], attrs["group"], attrs["bucket"])
    return tuple(xs)


def _bucket(v: object) -> int:
    bucket = INT(v)
    if bucket < 0:
        raise TypeError("expected a bucket number >= 0")
    return bucket


_ASYNC_ATTRS = {"op": Attr(one_of(*REDUCTIONS), "mean", "how the ranks' values combine"),
                "group": Attr(STR, "world", "the process group"),
                "bucket": Attr(_bucket, 0, "pairs a wait with its start (unique in the function)")}
define("all_reduce_start", ("xs*",), _all_reduce_infer, _started, _ASYNC_ATTRS,
       doc="all_reduce's first half: the communication of the bucket begins and runs while later ops compute; "
           "its results are its operands (the identity on a single process)",
       traits={Trait.COLLECTIVE})
define("all_reduce_wait", ("xs*",), _all_reduce_infer,
       _through_communicator("all_reduce_wait", "op", "group", "bucket"), _ASYNC_ATTRS,
       doc="all_reduce's second half: blocks until bucket's communication ends; its results are all_reduce's "
           "(operands: the start's results; the identity on a single process)",
       traits={Trait.COLLECTIVE})


def _rank(v: object) -> int:
    rank = INT(v)
    if rank < 0:
        raise TypeError("expected a rank >= 0")
    return rank


def _broadcast_infer(ts, attrs):
    same_dtype("broadcast", ts)  # one bucket is one flat buffer of one dtype
    return tuple(ts)


define("broadcast", ("xs*",), _broadcast_infer, _through_communicator("broadcast", "src", "group"),
       {"src": Attr(_rank, 0, "the rank whose operands every rank receives"),
        "group": Attr(STR, "world", "the process group")},
       doc="rank src's operands on every rank (the other ranks' operands only give the shapes: one bucket, one "
           "communication); the identity on a single process",
       traits={Trait.COLLECTIVE})
