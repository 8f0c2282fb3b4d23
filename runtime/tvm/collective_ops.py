"""Relax lowering of the collectives (all_reduce, its start/wait halves, broadcast): a call, from inside the Relax
VM, of a packed function kiln registers, which runs the collective through the communicator installed for the run
(`kiln.ir.ops.collective.communicating`), the identity on one process.
The VM's own buffers reach it by DLPack, without copies.

Why a packed call and not a step split into TVM segments at each collective: the executable stays one function (one
build, one cache entry, one VM call per step, the VM's memory planning across the whole step), and the callback is
the same code the interpreter backend runs, so the two backends cannot disagree on what a collective means.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import tvm_ffi
from tvm import relax

from kiln.ir.ops.collective import REDUCTIONS, current_communicator

from .rule import OpCall, RelaxResult, relax_rule


def _registered(name: str, prims: int, collective: Callable[..., Sequence[np.ndarray] | None]) -> str:
    """Register (once) packed function `name`: destination-passing, it takes the operands, `prims` prim values,
    then the results, and runs `collective(communicator, arrays, *prims)`, or the identity when none is installed
    (or when the collective returns None: a start, whose results are its operands)."""
    def run(*args) -> None:
        n = (len(args) - prims) // 2
        arrays = [np.from_dlpack(t) for t in args[:n]]
        communicator = current_communicator()
        values = None if communicator is None else collective(communicator, arrays, *args[n:n + prims])
        for out, value in zip(args[n + prims:], arrays if values is None else values):
            np.from_dlpack(out)[...] = value
    if tvm_ffi.get_global_func(name, allow_missing=True) is None:
        tvm_ffi.register_global_func(name, run)
    return name


def packed_name(op: str, group: str) -> str:
    """The packed function running `all_reduce {op, group}`, registered on first use."""
    return _registered(f"kiln.all_reduce.{op}.{group}", 0, lambda c, xs: c.all_reduce(xs, op, group))


def start_name(op: str, group: str) -> str:
    """The packed function running `all_reduce_start {op, group}` for the bucket number it is passed."""
    return _registered(f"kiln.all_reduce_start.{op}.{group}", 1,
                       lambda c, xs, bucket: c.all_reduce_start(xs, op, group, bucket))


def wait_name(op: str, group: str) -> str:
    """The packed function running `all_reduce_wait {op, group}` for the bucket number it is passed."""
    return _registered(f"kiln.all_reduce_wait.{op}.{group}", 1,
                       lambda c, xs, bucket: c.all_reduce_wait(xs, op, group, bucket))


def broadcast_name(group: str) -> str:
    """The packed function running `broadcast {group}` from the source rank it is passed, registered on first use."""
    return _registered(f"kiln.broadcast.{group}", 1, lambda c, xs, src: c.broadcast(xs, src, group))


for _op in REDUCTIONS:  # the world group's functions exist as soon as the rules do (a loaded artifact calls them)
    packed_name(_op, "world")
    start_name(_op, "world")
    wait_name(_op, "world")
broadcast_name("world")


def _packed_call(call: OpCall, name: str, *extra: relax.Expr) -> RelaxResult:
    """Destination-passing call of packed function `name` on the op's operands (then `extra`): one result each."""
    outs = [relax.TensorType(call.shape(i), call.dtype(i)) for i in range(len(call.args))]
    result = call.emit(relax.call_dps_packed(name, [*call.args, *extra], out_ty=outs[0] if len(outs) == 1 else outs))
    if len(outs) == 1:
        return result
    return tuple(relax.TupleGetItem(result, i) for i in range(len(outs)))


@relax_rule("all_reduce")
def _all_reduce_rule(call: OpCall) -> RelaxResult:
    return _packed_call(call, packed_name(call.attrs["op"], call.attrs["group"]))


@relax_rule("all_reduce_start")
def _all_reduce_start_rule(call: OpCall) -> RelaxResult:
    """The bucket number travels as a prim value (one function per op and group); the VM goes on computing while
    the engine communicates, until the wait's call."""
    return _packed_call(call, start_name(call.attrs["op"], call.attrs["group"]), relax.prim_value(call.attrs["bucket"]))


@relax_rule("all_reduce_wait")
def _all_reduce_wait_rule(call: OpCall) -> RelaxResult:
    return _packed_call(call, wait_name(call.attrs["op"], call.attrs["group"]), relax.prim_value(call.attrs["bucket"]))


@relax_rule("broadcast")
def _broadcast_rule(call: OpCall) -> RelaxResult:
    """The source rank travels as a prim value, so one packed function per group serves every owner's bucket."""
    return _packed_call(call, broadcast_name(call.attrs["group"]), relax.prim_value(call.attrs["src"]))
