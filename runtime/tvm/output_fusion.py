"""Fuse an elementwise group whose result the function returns into the elementwise group that consumes it.

Relax's FuseOps fuses a node only into its post-dominator, and the function's output tuple is opaque: a value both
returned and used by a later elementwise group (Adam's new moments, returned as state and used by the weight
update) keeps its own kernel, and the consumer reads it back from memory. This pass, between FuseOps and FuseTIR,
merges such producers into their consumer as one grouped function with several results, so FuseTIR makes one
kernel (whose loops `CPUInjective` then nests into one).
"""

from __future__ import annotations

from collections.abc import Sequence

import tvm
import tvm_ffi
from tvm import relax

from .symbolic_patterns import INJECTIVE


def injective_group(mod: tvm.IRModule, call: relax.Expr) -> relax.Function | None:
    """The elementwise grouped function `call` calls (every kernel in it injective at most), else None."""
    if not (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.GlobalVar)):
        return None
    func = mod[call.op]
    if not isinstance(func, relax.Function) or not func.attrs or not func.attrs.get("Primitive"):
        return None
    body = func.body
    if not isinstance(body, relax.SeqExpr) or not isinstance(body.body, relax.Var):
        return None
    for block in body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_tir"))):
                return None
            kernel = mod[value.args[0]]
            pattern = kernel.attrs.get("op_pattern") if kernel.attrs else None
            if pattern is None or int(pattern) > INJECTIVE:
                return None
    return func


def _same_shape(a: relax.Expr, b: relax.Expr) -> bool:
    sa, sb = a.ty, b.ty
    return (isinstance(sa, relax.TensorType) and isinstance(sb, relax.TensorType)
            and sa.shape is not None and sb.shape is not None and tvm_ffi.structural_equal(sa.shape, sb.shape))


def block_users(block: relax.DataflowBlock) -> dict[relax.Var, list[int]]:
    """Each var's users among the block's bindings, by position."""
    users: dict[relax.Var, list[int]] = {}
    for i, binding in enumerate(block.bindings):
        for var in relax.analysis.free_vars(binding.value):
            users.setdefault(var, []).append(i)
    return users


def inline_group(bb: relax.BlockBuilder, func: relax.Function, args: Sequence[relax.Expr]) -> relax.Expr:
    """Emit `func`'s bindings with its parameters bound to `args`; returns its result."""
    bound = func.bind_params(dict(zip(func.params, args)))
    for block in bound.body.blocks:
        for binding in block.bindings:
            bb.emit_normalized(binding)
    return bound.body.body


def merged_groups(mod: tvm.IRModule, producers: Sequence[relax.VarBinding], consumer: relax.VarBinding,
                  returned: bool = True) -> tuple[relax.Function, list[relax.Expr]]:
    """One grouped function computing the producers' results and the consumer's, and its call arguments; it
    returns the consumer's result and then (where `returned`) each producer's, as a tuple."""
    made = {b.var for b in producers}
    outside: list[relax.Expr] = []
    for b in (*producers, consumer):
        outside += [a for a in b.value.args if a not in made and not any(a.same_as(o) for o in outside)]
    params = [relax.Var(f"p{i}", a.ty) for i, a in enumerate(outside)]
    env = {id(a): p for a, p in zip(outside, params)}

    def arg(a: relax.Expr) -> relax.Expr:
        return env.get(id(next((o for o in outside if o.same_as(a)), a)), a)

    bb = relax.BlockBuilder()
    with bb.function("merged", params, {"Primitive": True}, pure=True):
        with bb.dataflow():
            results = {}
            for b in producers:
                results[b.var] = inline_group(bb, mod[b.value.op], [arg(a) for a in b.value.args])
            out = inline_group(bb, mod[consumer.value.op], [results.get(a, arg(a)) for a in consumer.value.args])
            gv = bb.emit_output(relax.Tuple([out, *(results[b.var] for b in producers)]) if returned else out)
        bb.emit_func_output(gv)
    return bb.finalize()["merged"], outside


@tvm.transform.module_pass(opt_level=0, name="KilnFuseOutputProducers")
def fuse_output_producers(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Between FuseOps and FuseTIR: merge each returned elementwise group into the one elementwise group of the
    same shape that uses it."""
    builder = relax.BlockBuilder(mod)  # adds the merged functions
    mains = {}
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive")):
            continue
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            continue
        blocks = []
        for block in body.blocks:
            blocks.append(_fuse_block(mod, builder, block) if isinstance(block, relax.DataflowBlock) else block)
        mains[gvar] = relax.Function(func.params, relax.SeqExpr(blocks, body.body), func.ret_ty,
                                   func.is_pure, func.attrs, func.span)
    for gvar, func in mains.items():
        builder.update_func(gvar, func)
    return builder.get()


def _fuse_block(mod: tvm.IRModule, builder: relax.BlockBuilder, block: relax.DataflowBlock) -> relax.DataflowBlock:
    users = block_users(block)
    # a producer: an elementwise group whose only other user is a tuple (the outputs); its consumer: the one call
    plan: dict[relax.Var, list[relax.VarBinding]] = {}
    taken: set[relax.Var] = set()
    for b in block.bindings:
        if not isinstance(b, relax.VarBinding) or injective_group(mod, b.value) is None:
            continue
        uses = users.get(b.var, [])
        calls = [i for i in uses if not isinstance(block.bindings[i].value, relax.Tuple)]
        if len(calls) != 1 or any(i < calls[0] for i in uses):  # returned only after its one consumer
            continue
        consumer = block.bindings[calls[0]]
        if (isinstance(consumer, relax.VarBinding) and injective_group(mod, consumer.value) is not None
                and _same_shape(b.var, consumer.var) and consumer.var not in taken and b.var not in plan):
            plan.setdefault(consumer.var, []).append(b)
            taken.add(b.var)
    if not plan:
        return block
    bindings: list[relax.Binding] = []
    for b in block.bindings:
        if b.var in taken:
            continue
        producers = plan.get(b.var)
        if producers is None:
            bindings.append(b)
            continue
        func, args = merged_groups(mod, producers, b)
        gv = builder.add_func(func, "fused_outputs_" + b.value.op.name_hint.removeprefix("fused_"))
        tup = relax.DataflowVar(f"{b.var.name}_outs", relax.TupleType(
            [b.var.ty, *(p.var.ty for p in producers)]))
        bindings.append(relax.VarBinding(tup, relax.Call(gv, args)))
        for i, v in enumerate([b.var, *(p.var for p in producers)]):
            bindings.append(relax.VarBinding(v, relax.TupleGetItem(tup, i)))
    return relax.DataflowBlock(bindings, block.span)
