"""Compute an elementwise group in each of its consumers where each consumer reads only its own part of it:
attention's q, k and v, sliced from one projection's heads.

FuseOps fuses a producer only into a post-dominator, so a group with several consumers writes its whole result and
each consumer reads its part back: a dynamic-batch BERT layer wrote its projection's bias add and head transpose,
[3, batch, 12, 128, 64] f32, to memory for three slices to read. Where every use of the result is a kernel that
copies a part of it (one load for each element of a smaller output) and no consumer selects more than its share
(the whole over the number of consumers), this pass (between FuseOps and FuseTIR) merges a copy of the producer
into each consumer: the same work in all, and the intermediate is never written.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.ir.expr import TensorLoad

from .output_fusion import block_users, injective_group, merged_groups
from .relax_rewrite import element_count
from .symbolic_patterns import leaf_blocks

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _elements(var: relax.Expr) -> tirx.PrimExpr | None:
    """The element count of a tensor of known shape, else None."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return element_count(ty.shape.values)


def _copies_part(kernel: tvm.ir.BaseFunc) -> bool:
    """Whether the kernel is one block storing a load of its first parameter and nothing else (a slice)."""
    blocks = leaf_blocks(kernel.body) if isinstance(kernel, tirx.PrimFunc) else None
    if not blocks or len(blocks) != 1:
        return False
    value = blocks[0].body.value
    return isinstance(value, TensorLoad) and value.source.same_as(kernel.params[0])  # a parameter is its buffer


def _selected(mod: tvm.IRModule, group: relax.Function, param: relax.Var) -> tirx.PrimExpr | None:
    """How many elements of `param` the group reads: the sum of its uses' outputs where each is a kernel copying
    part of it (`_copies_part`), else None."""
    total: tirx.PrimExpr = tirx.IntImm("int64", 0)
    for block in group.body.blocks:
        for binding in block.bindings:
            value = binding.value
            if not any(v.same_as(param) for v in relax.analysis.free_vars(value)):
                continue
            if not value.op.same_as(_CALL_TIR):
                return None
            tensors = [f for f in value.args[1].fields if isinstance(f.ty, relax.TensorType)]
            size = _elements(binding.var)
            if not (len(tensors) == 1 and tensors[0].same_as(param) and _copies_part(mod[value.args[0]])
                    and size is not None):
                return None
            total = total + size
    return total


def _takes_shares(mod: tvm.IRModule, producer: relax.Var, users: list[relax.VarBinding]) -> bool:
    """Whether each user is an elementwise group taking `producer` once and selecting at most its share of it."""
    for user in users:
        group = injective_group(mod, user.value)
        at = [i for i, a in enumerate(user.value.args) if a.same_as(producer)] if group is not None else []
        if len(at) != 1:
            return False
        param = group.params[at[0]]
        selected, whole = _selected(mod, group, param), _elements(param)
        if selected is None or whole is None or not tvm.sym.Analyzer().can_prove(selected * len(users) <= whole):
            return False
    return True


def _fuse_block(mod: tvm.IRModule, builder: relax.BlockBuilder, block: relax.DataflowBlock
                ) -> relax.DataflowBlock:
    bindings = list(block.bindings)
    users = block_users(block)
    merged: dict[int, relax.VarBinding] = {}
    dropped: set[int] = set()
    for i, b in enumerate(bindings):
        uses = sorted(set(users.get(b.var, [])))
        if len(uses) < 2 or not isinstance(b.var, relax.DataflowVar) or injective_group(mod, b.value) is None \
                or any(j in merged or j in dropped for j in uses):
            continue
        consumers = [bindings[j] for j in uses]
        if not all(isinstance(c, relax.VarBinding) for c in consumers) or not _takes_shares(mod, b.var, consumers):
            continue
        for j, consumer in zip(uses, consumers, strict=True):
            func, args = merged_groups(mod, [b], consumer, returned=False)
            gv = builder.add_func(func, consumer.value.op.name_hint)
            merged[j] = relax.VarBinding(consumer.var, relax.Call(gv, args))
        dropped.add(i)
    if not dropped:
        return block
    return relax.DataflowBlock([merged.get(i, b) for i, b in enumerate(bindings) if i not in dropped], block.span)


@tvm.transform.module_pass(opt_level=0, name="KilnFuseIntoSelections")
def fuse_into_selections(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Between FuseOps and FuseTIR: merge each elementwise group whose consumers each select their share of it
    into every consumer."""
    builder = relax.BlockBuilder(mod)
    for gvar, func in mod.functions_items():
        if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive")) \
                or not isinstance(func.body, relax.SeqExpr):
            continue
        body = func.body
        blocks = [_fuse_block(mod, builder, block) if isinstance(block, relax.DataflowBlock) else block
                  for block in body.blocks]
        if any(new is not old for new, old in zip(blocks, body.blocks, strict=True)):
            builder.update_func(gvar, relax.Function(func.params, relax.SeqExpr(blocks, body.body), func.ret_ty,
                                                     func.is_pure, func.attrs, func.span))
    return builder.get()
