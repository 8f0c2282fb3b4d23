"""Epilogues folded into bf16 conv kernels: a Relax rewrite after `conv_regions.py` that computes the elementwise ops
reading a `conv_bf16.py` kernel's result, and the casts of their values into the next convs' bf16 pairs, in that
kernel's store (`conv_epilogue.ConvEpilogue`).

From each plain conv kernel call it takes, in binding order, every op of `conv_epilogue.SCALAR_OPS` with an
operand computed from the conv (directly or through ops it took) whose other operands are independent of the conv
(a per-channel vector, one per image, a full map such as a residual's skip branch, a scalar constant), and every
marked cast (`conv_bf16.INPUT_PARAMS`) of such a value. The kernel stores, as f32 maps, the values code outside
reads, and the casts' pairs; the bindings that read those values but were bound before the last op taken move after
the kernel's call (nothing they read depends on it). Anything else, a pool, a transpose, an op whose other operand
depends on the conv too (the next block's residual add), ends the epilogue there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax, tirx
from tvm.target import Target

from .bf16_layout import N_TILE
from .conv_bf16 import (
    CONV_KERNEL_NAME,
    CONV_PARAMS,
    DEPTHWISE_KERNEL_NAME,
    DEPTHWISE_PARAMS,
    INPUT_PARAMS,
    SKIP_PARAMS,
    marked_cast,
    marked_skip,
    rebuilt_kernel,
)
from .conv_epilogue import CHANNEL, IMAGE, MAP, PAIRS, SCALAR_OPS, ConvEpilogue, PairsOutput, Term
from .cpu import CPUModel, cpu_model
from .relax_rewrite import batched_f32_shape, same_dims

_RELAX_NAMES = {"relu": "nn.relu"}  # the Relax op of each `SCALAR_OPS` name that differs from it
_OPS = {tvm.ir.Op.get("relax." + _RELAX_NAMES.get(name, name)): name for name in SCALAR_OPS}
_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_ADD = tvm.ir.Op.get("relax.add")


def _callee_attr(mod: tvm.IRModule, value: relax.Expr, key: str) -> list[int] | None:
    """The int list attribute `key` of the PrimFunc a `call_tir` binding calls, else None."""
    if not (isinstance(value, relax.Call) and value.op.same_as(_CALL_TIR) and len(value.args) == 2):
        return None
    func = mod[value.args[0]]
    attrs = func.attrs if isinstance(func, tirx.PrimFunc) and func.attrs is not None else {}
    return [int(v) for v in attrs[key]] if key in attrs else None


@dataclass
class _Fold:
    """What one conv's epilogue takes while it grows: the bindings it took, node numbers of the f32 values it
    computes (the conv's own result is node 0), its operands and the casts it stores."""

    out: list  # the conv's result shape (`batched_f32_shape`)
    taken: list[int]
    nodes: dict[relax.Var, int]
    dependent: set[relax.Var]  # the vars computed from the conv so far, taken or not
    constants: dict[relax.Var, tvm.ir.Constant]  # the block's vars bound to a constant
    skips: dict[relax.Var, relax.Var]  # the block's vars bound to a `bf16_skip` call: the pairs it reads
    terms: list[tuple] = field(default_factory=list)
    operands: dict[relax.Expr, tuple[int, str]] = field(default_factory=dict)
    pairs: dict[relax.Var, PairsOutput] = field(default_factory=dict)

    def term(self, arg: relax.Expr) -> Term | tuple[relax.Expr, str] | None:
        """`arg` of an op as a term (a node, a scalar constant, a clip bound), or as (arg, its kind) for an operand
        of a kind the kernel indexes; None for anything else."""
        if isinstance(arg, relax.Var) and arg in self.nodes:
            return ("node", self.nodes[arg])
        if isinstance(arg, relax.Var) and arg in self.dependent:
            return None  # computed from the conv by an op not taken: the kernel cannot read it
        if isinstance(arg, relax.Var) and arg in self.skips:  # a skip read back from pairs: read those in place
            shape = batched_f32_shape(arg.ty)
            return (self.skips[arg], PAIRS) if shape is not None and same_dims(shape, self.out) else None
        arg = self.constants.get(arg, arg) if isinstance(arg, relax.Var) else arg
        if isinstance(arg, (tirx.FloatImm, tirx.IntImm)):  # a clip bound
            return ("const", float(arg.value))
        if isinstance(arg, tvm.ir.Constant) and arg.value.numpy().size == 1 and arg.value.dtype == "float32":
            return ("const", float(arg.value.numpy().reshape(())))
        shape = batched_f32_shape(arg.ty)
        if shape is None or len(shape) != 5:
            return None
        out = self.out
        kind = (MAP if same_dims(shape, out) else CHANNEL if shape[0] == 1 and shape[1:] == [out[1], 1, 1, out[4]]
                else IMAGE if same_dims(shape, [out[0], out[1], 1, 1, out[4]]) else None)
        return None if kind is None else (arg, kind)

    def operand(self, term: Term | tuple[relax.Expr, str]) -> Term:
        """The term for what `term` returned: itself, or for an operand, its place among the kernel's inputs
        (given on its first use)."""
        if isinstance(term[0], str):
            return term
        arg, kind = term
        at, _ = self.operands.setdefault(arg, (len(self.operands), kind))
        return ("operand", at)

    def operand_args(self) -> list[relax.Expr]:
        """The operands in the kernel's parameter order."""
        return sorted(self.operands, key=lambda e: self.operands[e][0])

    def epilogue(self, read_by_others: set[relax.Var]) -> ConvEpilogue:
        """What the rebuilt kernel computes: every node, stored as an f32 map where `read_by_others` reads it (in
        the order of `fold.nodes`), and every cast's pairs."""
        return ConvEpilogue(tuple(self.terms), tuple(self.operands[e][1] for e in self.operand_args()),
                            tuple(node for var, node in self.nodes.items() if var in read_by_others),
                            tuple(self.pairs.values()))

    def take(self, mod: tvm.IRModule, binding: relax.VarBinding) -> bool:
        """Take `binding` (which reads a value of this epilogue) if the kernel can compute it."""
        value = binding.value
        cast = _callee_attr(mod, value, INPUT_PARAMS)
        if cast is not None:
            source = value.args[1].fields[0]
            blocks = int(binding.var.ty.shape.values[1])
            if source not in self.nodes or blocks != self.out[1]:
                return False
            self.pairs[binding.var] = PairsOutput(self.nodes[source], cast[0], tuple(cast[1:]))
            return True
        if not (isinstance(value, relax.Call) and value.op in _OPS):
            return False
        shape = batched_f32_shape(binding.var.ty)
        terms = [self.term(arg) for arg in value.args]
        if shape is None or not same_dims(shape, self.out) or None in terms:
            return False
        self.terms.append((_OPS[value.op], *(self.operand(t) for t in terms)))
        self.nodes[binding.var] = len(self.terms)
        return True


@dataclass
class _Block:
    """What the folds in one dataflow block share: the vars read outside it (by other blocks or the function's
    result), its vars bound to a constant, and the vars each binding reads (by binding, on first need)."""

    outside: set[relax.Var]
    constants: dict[relax.Var, tvm.ir.Constant]
    skips: dict[relax.Var, relax.Var]
    read: dict[relax.VarBinding, list[relax.Var]] = field(default_factory=dict)

    @staticmethod
    def of(mod: tvm.IRModule, func: relax.Function, at: int, bindings: list[relax.VarBinding]) -> _Block:
        outside: set[relax.Var] = set(relax.analysis.free_vars(func.body.body))
        for k, other in enumerate(func.body.blocks):
            if k != at:
                for b in other.bindings:
                    outside.update(relax.analysis.free_vars(b.value))
        return _Block(outside, {b.var: b.value for b in bindings if isinstance(b.value, tvm.ir.Constant)},
                      {b.var: b.value.args[1].fields[0] for b in bindings
                       if _callee_attr(mod, b.value, SKIP_PARAMS) is not None})

    def reads(self, binding: relax.VarBinding) -> list[relax.Var]:
        if binding not in self.read:
            self.read[binding] = relax.analysis.free_vars(binding.value)
        return self.read[binding]


def _fold_from(mod: tvm.IRModule, builder: relax.BlockBuilder, bindings: list[relax.VarBinding], start: int,
               block: _Block, model: CPUModel) -> tuple[list[relax.VarBinding], int] | None:
    """`bindings` with the first plain conv kernel call from `start` on that takes an epilogue rebuilt with it, and
    where to look for the next one; None when none is left."""
    for i in range(start, len(bindings)):
        conv = bindings[i]
        kind, geometry = _geometry(mod, conv.value)
        out = batched_f32_shape(conv.var.ty) if geometry is not None else None
        if out is None:
            continue
        fold = _Fold(out, [i], {conv.var: 0}, {conv.var}, block.constants, block.skips)
        for j in range(i + 1, len(bindings)):
            b = bindings[j]
            if any(v in fold.dependent for v in block.reads(b)):
                if fold.take(mod, b):
                    fold.taken.append(j)
                fold.dependent.add(b.var)
        if len(fold.taken) > 1:
            others = _read_by_others(bindings, fold, block)
            kernel = rebuilt_kernel(kind, geometry, model, fold.epilogue(others))
            return _rebuilt(builder, bindings, fold, others, kernel, kind), i
    return None


def _geometry(mod: tvm.IRModule, value: relax.Expr) -> tuple[str, list[int] | None]:
    """(which, geometry) of a plain bf16 conv or depthwise kernel call, else (CONV_PARAMS, None)."""
    for kind in (CONV_PARAMS, DEPTHWISE_PARAMS):
        geometry = _callee_attr(mod, value, kind)
        if geometry is not None:
            return kind, geometry
    return CONV_PARAMS, None


def _read_by_others(bindings: list[relax.VarBinding], fold: _Fold, block: _Block) -> set[relax.Var]:
    """The vars read by the bindings `fold` does not take, and outside the block."""
    taken = set(fold.taken)
    return {v for j, b in enumerate(bindings) if j not in taken for v in block.reads(b)} | block.outside


def _rebuilt(builder: relax.BlockBuilder, bindings: list[relax.VarBinding], fold: _Fold, others: set[relax.Var],
             kernel: tirx.PrimFunc, kind: str) -> list[relax.VarBinding]:
    """`bindings` with `fold`'s bindings replaced by one call of `kernel` (the conv's, rebuilt with the fold's
    epilogue, which stores the nodes `others` read), at the last one's place; the other bindings computed from
    the conv before that place move after it."""
    first, last = fold.taken[0], fold.taken[-1]
    taken = set(fold.taken)
    outs = [*(var for var in fold.nodes if var in others), *fold.pairs]
    name = DEPTHWISE_KERNEL_NAME if kind == DEPTHWISE_PARAMS else CONV_KERNEL_NAME
    gvar = builder.add_func(kernel, f"{name}_epilogue")
    call = relax.call_tir(gvar, [*bindings[first].value.args[1].fields, *fold.operand_args()], [v.ty for v in outs])
    if len(outs) == 1:
        folded = [relax.VarBinding(outs[0], call)]
    else:
        results = relax.DataflowVar("conv_epilogue", relax.TupleType([v.ty for v in outs]))
        folded = [relax.VarBinding(results, call), *(relax.VarBinding(v, relax.TupleGetItem(results, k))
                                                    for k, v in enumerate(outs))]
    between = [(j, b) for j, b in enumerate(bindings[first + 1:last], start=first + 1) if j not in taken]
    return [*bindings[:first], *(b for _, b in between if b.var not in fold.dependent), *folded,
            *(b for _, b in between if b.var in fold.dependent), *bindings[last + 1:]]


def _skips_from_pairs(mod: tvm.IRModule, builder: relax.BlockBuilder, bindings: list[relax.VarBinding]
                      ) -> list[relax.VarBinding]:
    """`bindings` with each residual add's skip that a conv also reads unpadded (a marked cast of it bound before
    the add) read back from that cast's pairs by a `bf16_skip` kernel bound right after the cast. The conv whose
    epilogue computes the skip then stores only the pairs, and the add's conv reads them in its store: a ResNet
    block's output makes no f32 round trip (at batch 8 its 56² maps are 26 MB each, beyond L3). The skip is then
    rounded to bf16 once, as the next conv's input is (docs/precision.md). An add counts as a residual's where
    its other operand is computed from a conv kernel's result by `SCALAR_OPS`.

    A projection's skip (a block's downsample conv, whose result only the add reads) gets such an unpadded cast of
    its own, bound right after it: its kernel then stores pairs, half the bytes of the f32 map it stored for the
    add (at batch 8 a 56² projection's map is 26 MB). Of an add's two operands computed from independent convs,
    the later bound is that skip: the earlier conv's fold takes the add."""
    bound = {b.var: b.value for b in bindings}
    known: dict[relax.Var, bool] = {}  # from_conv of each var asked (hard-swish reads its input three times)

    def from_conv(expr: relax.Expr) -> bool:
        value = bound.get(expr) if isinstance(expr, relax.Var) else None
        if value is None:
            return False
        if expr not in known:
            known[expr] = _geometry(mod, value)[1] is not None or (
                isinstance(value, relax.Call) and value.op in _OPS and any(from_conv(a) for a in value.args))
        return known[expr]

    casts: dict[relax.Var, tuple[int, relax.Var]] = {}  # a skip candidate: (its unpadded cast's place, the pairs)
    for i, b in enumerate(bindings):
        cast = _callee_attr(mod, b.value, INPUT_PARAMS)
        source = b.value.args[1].fields[0] if cast is not None else None
        shape = batched_f32_shape(source.ty) if isinstance(source, relax.Var) else None
        if shape is not None and len(shape) == 5 and not any(cast[1:]) and same_dims(
                [int(d) if isinstance(d, tirx.IntImm) else d for d in b.var.ty.shape.values[1:4]], shape[1:4]):
            casts.setdefault(source, (i, b.var))  # pairs of the skip's own blocks and map
    place = {b.var: i for i, b in enumerate(bindings)}
    readers: dict[relax.Var, int] = {}
    for b in bindings:
        for v in set(relax.analysis.free_vars(b.value)):
            readers[v] = readers.get(v, 0) + 1

    def projection(arg: relax.Expr, other: relax.Expr, add: relax.Var) -> bool:
        """Whether `arg` is a projection's skip: bound after `other`, neither computed from the other, from a conv,
        read by the add alone, a blocked map of the add's dims."""
        if not (isinstance(arg, relax.DataflowVar) and isinstance(other, relax.Var) and arg in place
                and other in place and place[arg] > place[other] and readers.get(arg) == 1):
            return False
        shape, out = batched_f32_shape(arg.ty), batched_f32_shape(add.ty)
        return (shape is not None and out is not None and len(shape) == 5 and same_dims(shape, out)
                and from_conv(arg) and from_conv(other) and not _reaches(bound, arg, other))

    added: dict[int, list[relax.VarBinding]] = {}  # a projection's new cast, right after its skip
    skips: dict[relax.Var, relax.Var] = {}  # a skip -> its f32 read from pairs
    rewritten: dict[int, relax.VarBinding] = {}
    for j, b in enumerate(bindings):
        v = b.value
        if not (isinstance(v, relax.Call) and v.op.same_as(_ADD)):
            continue
        args = list(v.args)
        for k, (arg, other) in enumerate(zip(args, reversed(args), strict=True)):
            if isinstance(arg, relax.Var) and arg not in casts and projection(arg, other, b.var):
                cast = builder.normalize(marked_cast(builder, arg, int(arg.ty.shape.values[1]) * N_TILE, [0] * 4))
                pairs = relax.DataflowVar(f"{arg.name}_pairs", cast.ty)
                added[place[arg]] = [relax.VarBinding(pairs, cast)]
                casts[arg] = (place[arg], pairs)
            if isinstance(arg, relax.Var) and arg in casts and casts[arg][0] < j and from_conv(other):
                skips.setdefault(arg, relax.DataflowVar(f"{arg.name}_bf16", arg.ty))
                args[k] = skips[arg]
                rewritten[j] = relax.VarBinding(b.var, relax.Call(v.op, args, v.attrs, v.ty_args, v.span))
                break
    after: dict[int, list[relax.VarBinding]] = {}
    for skip, var in skips.items():
        at, pairs = casts[skip]
        after.setdefault(at, []).append(relax.VarBinding(var, marked_skip(builder, pairs)))
    return [new for j, b in enumerate(bindings)
            for new in [rewritten.get(j, b), *added.get(j, []), *after.get(j, [])]]


def _reaches(bound: dict[relax.Var, relax.Expr], start: relax.Var, target: relax.Var) -> bool:
    """Whether the value bound to `start` is computed, through the bindings `bound`, from `target`."""
    seen, todo = set(), [start]
    while todo:
        var = todo.pop()
        if var is target or var.same_as(target):
            return True
        if var in seen or var not in bound:
            continue
        seen.add(var)
        todo.extend(relax.analysis.free_vars(bound[var]))
    return False


def fold_conv_epilogues(target: Target) -> tvm.transform.Pass:
    """The module pass computing each bf16 conv kernel's elementwise consumers and next-conv casts in its store."""
    model = cpu_model(target)

    @tvm.transform.module_pass(opt_level=0, name="KilnFoldConvEpilogues")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        builder = relax.BlockBuilder(mod)
        changed = False
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
                continue
            blocks, folded_here = list(func.body.blocks), False
            for k, block in enumerate(blocks):
                if not isinstance(block, relax.DataflowBlock):
                    continue
                bindings, start = _skips_from_pairs(builder.get(), builder, list(block.bindings)), 0
                shared = _Block.of(builder.get(), func, k, bindings)
                changed_here = bool(shared.skips)
                while (folded := _fold_from(builder.get(), builder, bindings, start, shared, model)):
                    (bindings, start), changed_here = folded, True
                if changed_here:
                    blocks[k], folded_here = relax.DataflowBlock(bindings, block.span), True
            if folded_here:
                changed = True
                builder.update_func(gvar, relax.Function(func.params, relax.SeqExpr(blocks, func.body.body),
                                                         func.ret_ty, func.is_pure, func.attrs, func.span))
        return relax.transform.DeadCodeElimination()(builder.get()) if changed else mod

    return _pass
