"""Relax lowering of the collectives (all_reduce, broadcast): a call, from inside the Relax VM, of a packed function
kiln registers, which runs the collective through the communicator installed for the run
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


def _registered(name: str, prims: int, collective: Callable[..., Sequence[np.ndarray]]) -> str:
    """Register (once) packed function `name`: destination-passing, it takes the operands, `prims` prim values,
    then the results, and runs `collective(communicator, arrays, *prims)`, or the identity when none is installed."""
    def run(*args) -> None:
        n = (len(args) - prims) // 2
        arrays = [np.from_dlpack(t) for t in args[:n]]
        communicator = current_communicator()
        values = arrays if communicator is None else collective(communicator, arrays, *args[n:n + prims])
        for out, value in zip(args[n + prims:], values):
            np.from_dlpack(out)[...] = value
    if tvm_ffi.get_global_func(name, allow_missing=True) is None:
        tvm_ffi.register_global_func(name, run)
    return name


def packed_name(op: str, group: str) -> str:
    """The packed function running `all_reduce {op, group}`, registered on first use."""
    return _registered(f"kiln.all_reduce.{op}.{group}", 0, lambda c, xs: c.all_reduce(xs, op, group))


def broadcast_name(group: str) -> str:
    """The packed function running `broadcast {group}` from the source rank it is passed, registered on first use."""
    return _registered(f"kiln.broadcast.{group}", 1, lambda c, xs, src: c.broadcast(xs, src, group))


for _op in REDUCTIONS:  # the world group's functions exist as soon as the rules do (a loaded artifact calls them)
    packed_name(_op, "world")
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


@relax_rule("broadcast")
def _broadcast_rule(call: OpCall) -> RelaxResult:
    """The source rank travels as a prim value, so one packed function per group serves every owner's bucket."""
    return _packed_call(call, broadcast_name(call.attrs["group"]), relax.prim_value(call.attrs["src"]))
