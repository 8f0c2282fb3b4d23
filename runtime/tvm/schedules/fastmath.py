"""Fast-math Relax passes: gelu via a polynomial erf, softmax via kiln's row kernel (`softmax_rows.py`) or TVM's
fast variant, exp/erf/tanh via TVM's fast variants.

Exact `erf` and `exp` lower to scalar libm calls inside vectorized loops, which made a gelu epilogue cost
more than the matmul it follows; these passes run before legalization and replace them with polynomial
approximations that vectorize.

Measured error of the float32 kernels against exact float64 math (`bench/tvm_rules.py --accuracy`,
TVM 0.27, x86-64 AVX-512):
* gelu over 2M points in [-20, 20]: max abs error 1.5e-6; max rel error 4.5e-4 where |gelu(x)| >= 1e-3
  (x >= -3.4); further left gelu itself is below 1e-3 and only the abs bound is meaningful.
* softmax over 512 rows of 1000 logits ~ N(0, s^2), s in {1, 10, 30}: max abs error 2.3e-7; max rel
  error 5.8e-7 on probabilities >= 1e-6 (`softmax_rows.py`'s kernel and exp; TVM's `fast_exp`, still used over
  other axes, gave 1.1e-6 and 1.8e-6).
Both are inside the 3e-3 relative tolerance kiln's tests allow for fast-math kernels.
"""

import math

import tvm
from tvm import relax, topi

from ..relax_rewrite import scaled_operand
from ..softmax_rows import is_row_softmax, softmax_rows

_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def _fast_gelu(x: tvm.te.Tensor) -> tvm.te.Tensor:
    """gelu(x) = x * (1 + erf(x / sqrt 2)) / 2 with TVM's rational-polynomial erf."""
    return x * (0.5 + 0.5 * topi.fast_erf(x * _INV_SQRT2))


def _fast_softmax(x: tvm.te.Tensor, axis: int, scale: float = 1.0) -> tvm.te.Tensor:
    """softmax(scale * x) for a positive `scale` with `topi.fast_exp`, scaled by the reciprocal of each row's sum:
    one division a row, not one an element (a vector division takes about as long as 5-10 FMAs; topi's
    `fast_softmax` divides every element). max(scale * x) = scale * max(x), so the scale multiplies inside the exp
    and x is read as it is."""
    shifted = x - topi.max(x, axis=axis, keepdims=True)
    shifted = topi.fast_exp(shifted if scale == 1.0 else shifted * tvm.tirx.const(scale, x.dtype))
    return shifted * topi.divide(tvm.tirx.const(1, x.dtype), topi.sum(shifted, axis=axis, keepdims=True))


@relax.expr_functor.mutator
class _FastRewriter(relax.PyExprMutator):
    """Replace each `relax.nn.gelu` call by a TE kernel using `topi.fast_erf`, and each float32 `relax.nn.softmax`
    by `_fast_softmax`, taking in a positive scalar multiply of its input (attention's score scale); `lanes`: the
    CPU's float32 vector lanes, where a softmax over a last axis of static width is `softmax_rows`' kernel (None:
    `_fast_softmax` for every softmax, scheduled by the rules)."""

    def __init__(self, mod: tvm.IRModule, lanes: int | None) -> None:
        super().__init__(mod)
        self.lanes = lanes

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = self.visit_expr_post_order(call)
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.gelu":
            return self.builder_.call_te(_fast_gelu, call.args[0], primfunc_name_hint="fast_gelu")
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.softmax" and call.ty.dtype == "float32":
            x, scale = scaled_operand(call.args[0], self.lookup_binding)
            if self.lanes and is_row_softmax(call):
                return softmax_rows(self.builder_, x, scale, self.lanes)
            return self.builder_.call_te(_fast_softmax, x, int(call.attrs.axis), scale,
                                         primfunc_name_hint="fast_softmax")
        return call


@tvm.transform.module_pass(opt_level=0, name="FastGeluSoftmax")
class FastGeluSoftmax:
    """Rewrite gelu with fast_erf (FastMathTransform misses gelu, which legalizes straight to T.erf) and softmax
    with one division a row (FastMathTransform's `fast_softmax` divides each element), over a last axis as
    `softmax_rows` for a CPU of `lanes` float32 lanes."""

    def __init__(self, lanes: int | None = None) -> None:
        self.lanes = lanes

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        rewriter = _FastRewriter(mod, self.lanes)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        return relax.transform.DeadCodeElimination()(rewriter.builder_.get())  # a scale the softmax took in


def fast_math_passes(lanes: int | None = None) -> list[tvm.transform.Pass]:
    """The fast-math pre-legalization passes, in order, for a CPU of `lanes` float32 vector lanes."""
    return [FastGeluSoftmax(lanes), relax.transform.FastMathTransform()]
