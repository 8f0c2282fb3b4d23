"""The Relax pass computing each float32 `softmax(s q kᵀ [+ mask]) v` with the fused attention kernel
(`attention.py`).

It matches `matmul(softmax(matmul(q, permute_dims(k)) · s [+ mask]), v)`: the scale a positive scalar multiply or
divide or none (`relax_rewrite.scaled_operand`), the mask added on either side and broadcast over any of batch, heads
and queries; q, k and v of one shape but for their last two dims, those static; the scores and weights used by
nothing else (else the products would run twice). A rank-4 operand that is a head split's transpose
(`permute_dims(y, [0, 2, 1, 3])`) is read from y, or from the projection y reshapes, and a result whose one user is
that transpose is written in its layout, so a multi-head layer's q, k, v and context are never copied to or from
[batch, heads, seq, d]. It runs before the fast-math rewrites (whose softmax it takes in) and only where its kernel's
kᵀ and scores fit the CPU's L2 (`Attention.fits`); anything else keeps the unfused kernels. In a bf16 build both
products are bf16 pairs where the CPU has `vdpbf16ps` (`Attention.takes_pairs`), else float32."""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator
from tvm.target import Target

from .attention import KERNEL_NAME, Attention, Layout, attention_kernel
from .cpu import CPUModel, cpu_model
from .relax_rewrite import (
    element_count,
    permute_axes,
    rewrite_functions,
    scaled_operand,
    swaps_last_two,
    use_counts,
)

_MATMUL = tvm.ir.Op.get("relax.matmul")
_SOFTMAX = tvm.ir.Op.get("relax.nn.softmax")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
_RESHAPE = tvm.ir.Op.get("relax.reshape")
_ADD = tvm.ir.Op.get("relax.add")
_HEAD_SPLIT = [0, 2, 1, 3]  # [batch, seq, heads, d] <-> [batch, heads, seq, d]


@dataclass(frozen=True)
class _Match:
    """An attention found in the original function: the q, k, v and mask its kernel reads (original exprs; q, k and
    v in `spec.layouts`) and its geometry."""

    q: relax.Expr
    k: relax.Expr
    v: relax.Expr
    mask: relax.Expr | None
    spec: Attention


def _last_two(ty: object) -> list[int] | None:
    """The last two dims of a tensor type of rank 2 or more where those are static and positive, else None."""
    dims = getattr(getattr(ty, "shape", None), "values", None)
    if dims is None or len(dims) < 2 or not all(isinstance(d, tvm.tirx.IntImm) and int(d) > 0 for d in dims[-2:]):
        return None
    return [int(d) for d in dims[-2:]]


def _folds(flat: relax.Expr, heads: relax.Expr) -> bool:
    """Whether `flat` [batch, seq, h x d] is `heads` [batch, seq, h, d] with its last two dims in one."""
    if flat.ty.ndim != 3 or flat.ty.shape is None:
        return False
    (*lead, width), (*heads_lead, h, d) = flat.ty.shape.values, heads.ty.shape.values
    analyzer = tvm.sym.Analyzer()
    return all(analyzer.can_prove_equal(a, b) for a, b in zip([*lead, width], [*heads_lead, h * d], strict=True))


def _mask_dims(mask: relax.Expr, scores: list[tvm.tirx.PrimExpr]) -> tuple[bool, bool, bool] | None:
    """Which of the [batch, heads, m] dims a float32 mask added to rank-4 `scores` has whole (not 1), where it
    broadcasts to them and its last dim is the scores' (n), else None."""
    dims = getattr(getattr(mask.ty, "shape", None), "values", None)
    if mask.ty.dtype != "float32" or dims is None or len(scores) != 4 or not 1 <= len(dims) <= 4:
        return None
    padded = [tvm.tirx.IntImm("int64", 1)] * (4 - len(dims)) + list(dims)
    analyzer = tvm.sym.Analyzer()
    if not analyzer.can_prove_equal(padded[-1], scores[-1]):
        return None
    whole = []
    for dim, full in zip(padded[:3], scores[:3]):
        if isinstance(dim, tvm.tirx.IntImm) and int(dim) == 1:
            whole.append(False)
        elif analyzer.can_prove_equal(dim, full):
            whole.append(True)
        else:
            return None
    return tuple(whole)


def _view(lead: list[tvm.tirx.PrimExpr]) -> list[tvm.tirx.PrimExpr]:
    """An operand's lead dims as the kernel's [batch, heads]: rank 4's as they are, else all but the last in one
    batch and the last as heads (rank 3: one head a batch row; rank 2: one of each)."""
    if len(lead) < 2:
        return [*lead, *[tvm.tirx.IntImm("int64", 1)] * (2 - len(lead))]
    return [tvm.sym.Analyzer().simplify(element_count(lead[:-1])), lead[-1]]


class _Graph:
    """One Relax function's bindings and use counts, and the attentions the kernel takes in it (`found`: by the call
    that is to compute each, the context product or the head split's transpose that is its one user)."""

    def __init__(self, func: relax.Function, model: CPUModel, pairs: bool) -> None:
        self.pairs = pairs
        bindings = [(b.var, b.value) for block in func.body.blocks for b in block.bindings]
        self.bound = dict(bindings)
        self.uses = use_counts(func)
        splits = {value.args[0]: value for _, value in bindings if self._head_split(value)}
        self.found: dict[relax.Call, _Match] = {}
        for var, value in bindings:
            match = self.attention(value, model) if isinstance(value, relax.Call) else None
            if match is None:
                continue
            split = splits.get(var) if self.uses.get(var) == 1 else None
            if split is None:
                self.found[value] = match
            else:  # the transpose computes it, writing the context in its layout
                layouts = (*match.spec.layouts[:3], Layout(seq_first=True))
                self.found[split] = replace(match, spec=replace(match.spec, layouts=layouts))

    @staticmethod
    def _head_split(value: relax.Expr) -> bool:
        """Whether `value` is a head split's transpose ([batch, seq, heads, d] <-> [batch, heads, seq, d])."""
        return isinstance(value, relax.Call) and value.op.same_as(_PERMUTE) and value.ty.ndim == 4 \
            and permute_axes(value) == _HEAD_SPLIT

    def call(self, expr: relax.Expr, op: tvm.ir.Op, once: bool = False) -> relax.Call | None:
        """The call of `op` `expr` is bound to (used by one binding only, with `once`), else None."""
        value = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        if not isinstance(value, relax.Call) or not value.op.same_as(op):
            return None
        return value if not once or self.uses.get(expr) == 1 else None

    def unsplit(self, expr: relax.Expr) -> tuple[relax.Expr, Layout]:
        """A rank-4 operand bound to a head split's transpose as (its input, seq first), or where that is a reshape
        of [batch, seq, heads x d], (the reshape's input, folded), else (it, heads first). Reading the projection
        itself leaves its bias add an elementwise kernel of the projection's shape, which a bf16 product's store can
        take in (`amx_epilogue.py`)."""
        split = self.bound.get(expr) if isinstance(expr, relax.Var) else None
        if not self._head_split(split):
            return expr, Layout()
        heads = split.args[0]
        reshape = self.call(heads, _RESHAPE)
        if reshape is not None and _folds(reshape.args[0], heads):
            return reshape.args[0], Layout(seq_first=True, folded=True)
        return heads, Layout(seq_first=True)

    def attention(self, call: relax.Call, model: CPUModel) -> _Match | None:
        """The attention whose context product is `call`, where the kernel takes it, else None."""
        if not call.op.same_as(_MATMUL) or call.ty.dtype != "float32":
            return None
        weights, v = call.args
        softmax = self.call(weights, _SOFTMAX, once=True)
        if softmax is None or int(softmax.attrs.axis) not in (-1, softmax.ty.ndim - 1):
            return None
        product, scale, mask = self._scores(softmax.args[0])
        if product is None or product.ty.dtype != "float32":
            return None
        q, kt = product.args
        rank = q.ty.ndim
        flip = self.call(kt, _PERMUTE)
        if flip is None or rank < 2 or not swaps_last_two(permute_axes(flip), rank):
            return None
        k = flip.args[0]
        dims = [_last_two(x.ty) for x in (q, k, v)]
        if None in dims or any(x.ty.dtype != "float32" or x.ty.ndim != rank for x in (k, v)):
            return None
        (m, d), (n, dk), (nv, dv) = dims
        leads = [x.ty.shape.values[:-2] for x in (q, k, v)]
        if dk != d or nv != n or not all(tvm_ffi.structural_equal(leads[0], lead) for lead in leads[1:]):
            return None
        heads = _view(leads[0])[1]
        if not isinstance(heads, tvm.tirx.IntImm):
            return None
        whole = None if mask is None else _mask_dims(mask, product.ty.shape.values)
        if mask is not None and whole is None:
            return None
        if rank == 4:  # read through a head split where there is one
            (q, ql), (k, kl), (v, vl) = (self.unsplit(x) for x in (q, k, v))
            layouts = (ql, kl, vl, Layout())
        else:
            layouts = (Layout(),) * 4
        spec = Attention(int(heads), m, n, d, dv, scale, layouts, whole)
        spec = replace(spec, pairs=self.pairs and spec.takes_pairs(model))
        return _Match(q, k, v, mask, spec) if spec.fits(model) else None

    def _scores(self, x: relax.Expr) -> tuple[relax.Call | None, float, relax.Expr | None]:
        """(the product q kᵀ, the scale, the mask) of a softmax's input s q kᵀ or s q kᵀ + mask (either order),
        each step used only by the next; (None, 1, None) where it is neither."""
        add = self.call(x, _ADD, once=True)
        sides = [(x, None)] if add is None else [(add.args[0], add.args[1]), (add.args[1], add.args[0])]
        for scores, mask in sides:
            product, scale = scaled_operand(scores, self.bound.get)
            if scale != 1.0 and self.uses.get(scores) != 1:
                continue
            found = self.call(product, _MATMUL, once=True)
            if found is not None:
                return found, scale, mask
        return None, 1.0, None


@mutator
class _Fuser(PyExprMutator):
    """Each call `_Graph.found` names, as the fused kernel."""

    def __init__(self, mod: tvm.IRModule, model: CPUModel, pairs: bool) -> None:
        super().__init__(mod)
        self.model = model
        self.found = {call: match for f in mod.functions.values() if isinstance(f, relax.Function)
                      for call, match in _Graph(f, model, pairs).found.items()}

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        match = self.found.get(call)
        if match is None:
            return super().visit_call_(call)
        operands = [self.visit_expr(x) for x in (match.q, match.k, match.v)]
        if call.ty.ndim != 4:  # viewed as [batch, heads, seq, d]
            operands = [self._viewed(x, [*_view(x.ty.shape.values[:-2]), *x.ty.shape.values[-2:]]) for x in operands]
        if match.mask is not None:  # [batch or 1, heads or 1, m or 1, n]
            mask = self.visit_expr(match.mask)
            operands.append(self._viewed(mask, [*[tvm.tirx.IntImm("int64", 1)] * (4 - mask.ty.ndim),
                                                *mask.ty.shape.values]))
        kernel = self.builder_.add_func(attention_kernel(match.spec, self.model), KERNEL_NAME)
        dims = list(call.ty.shape.values)
        out = relax.call_tir(kernel, operands, relax.TensorType(
            dims if call.ty.ndim == 4 else [*_view(dims[:-2]), *dims[-2:]], "float32"))
        return out if call.ty.ndim == 4 else relax.op.reshape(self.builder_.emit(out), call.ty.shape)

    def _viewed(self, x: relax.Expr, dims: list[tvm.tirx.PrimExpr]) -> relax.Expr:
        """`x` reshaped to `dims` (a view), or `x` where it has that rank already."""
        return x if x.ty.ndim == len(dims) else self.builder_.emit(relax.op.reshape(x, dims))


def fused_attention(target: Target, bf16: bool = False) -> tvm.transform.Pass:
    """The module pass computing each attention `_Graph` finds with `attention_kernel`: in a `bf16` build, the
    pairs kernel where the CPU and the geometry take it (`Attention.takes_pairs`)."""
    model = cpu_model(target)

    @tvm.transform.module_pass(opt_level=0, name="KilnFusedAttention")
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return relax.transform.DeadCodeElimination()(rewrite_functions(mod, _Fuser(mod, model, bf16)))

    return _pass
