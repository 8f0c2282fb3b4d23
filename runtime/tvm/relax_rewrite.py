"""What kiln's Relax-level rewrites (layouts, constant folding) share: the static shapes and the convs they match
on, their attributes as Python ints, and running a mutator over every Relax function of a module."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping, Sequence

import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.relax.expr_functor import PyExprMutator, mutator


def static_shape(ty: object) -> list[int] | None:
    """The shape of a tensor type whose dims are all known, else None."""
    dims = getattr(getattr(ty, "shape", None), "values", None)
    if dims is None or not all(isinstance(d, tirx.IntImm) for d in dims):
        return None
    return [int(d) for d in dims]


def static_f32_shape(ty: object) -> list[int] | None:
    """The shape of a float32 tensor type whose dims are all known, else None."""
    return static_shape(ty) if getattr(ty, "dtype", None) == "float32" else None


Dims = list  # a shape of Python ints whose first entry may be a symbolic `tirx.PrimExpr` (`batched_f32_shape`)


def batched_f32_shape(ty: object) -> Dims | None:
    """The shape of a float32 tensor type whose dims are known but for the first, which may be symbolic (a dynamic
    batch: an ONNX model exported with `dynamic_axes`), else None. The kernels of the conv-region and matmul-layout
    rewrites need every dim but the batch, which only bounds their outermost parallel loop."""
    dims = getattr(getattr(ty, "shape", None), "values", None)
    if getattr(ty, "dtype", None) != "float32" or dims is None or not all(
            isinstance(d, tirx.IntImm) for d in dims[1:]):
        return None
    return [int(d) if isinstance(d, tirx.IntImm) else d for d in dims]


def batched_nchw(call: relax.Call) -> Dims | None:
    """The float32 shape of `call`'s first operand when it and the result are 4-D, non-empty and static but for the
    batch (`batched_f32_shape`: a dynamic batch only bounds a kernel's parallel loop over images and channels)."""
    x, out = batched_f32_shape(call.args[0].ty), batched_f32_shape(call.ty)
    return x if x is not None and out is not None and len(x) == len(out) == 4 and min(x[1:] + out[1:]) > 0 else None


def window_out_size(size: int, before: int, after: int, kernel: int, stride: int, dilation: int) -> int:
    """Outputs along one axis of a conv or pool window (no `ceil_mode`) over `size` elements padded before and
    after."""
    return (size + before + after - dilation * (kernel - 1) - 1) // stride + 1


def same_dims(a: Dims, b: Dims) -> bool:
    """Whether two `batched_f32_shape`s are equal (a symbolic batch: the same variable or expression)."""
    return len(a) == len(b) and all(
        x == y if isinstance(x, int) and isinstance(y, int) else tvm_ffi.structural_equal(x, y) for x, y in zip(a, b))


CONV2D = tvm.ir.Op.get("relax.nn.conv2d")


def nchw_conv(call: relax.Call) -> tuple[Dims, list[int]] | None:
    """The input and weight shapes of a float32 conv2d in NCHW / OIHW / NCHW whose operand shapes are static but for
    the input's batch (`batched_f32_shape`), else None (read from the operands alone, so a call not yet normalized,
    with no type of its own, can be asked)."""
    if call.op != CONV2D:
        return None
    x, w = batched_f32_shape(call.args[0].ty), static_f32_shape(call.args[1].ty)
    layouts = (call.attrs.data_layout, call.attrs.kernel_layout, call.attrs.out_layout)
    if x is None or w is None or len(x) != 4 or layouts != ("NCHW", "OIHW", "NCHW"):
        return None
    return x, w


def depthwise_conv(call: relax.Call) -> bool:
    """Whether `call` is an `nchw_conv` with one filter per channel (groups = in = out channels), the convs computed
    channel by channel."""
    shapes = nchw_conv(call)
    if shapes is None:
        return False
    x, w = shapes
    return int(call.attrs.groups) == x[1] == w[0] and w[1] == 1


def int_lists(*arrays: object) -> list[list[int]]:
    """Relax attribute arrays (strides, padding, dilation, pool sizes) as lists of Python ints."""
    return [[int(v) for v in vs] for vs in arrays]  # type: ignore[attr-defined]


def rewrite_functions(mod: tvm.IRModule, rewriter: PyExprMutator) -> tvm.IRModule:
    """`mod` with every Relax function replaced by `rewriter`'s visit of it (the rewriter was made over `mod`)."""
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()


def marked_kernels(mod: tvm.IRModule, pick: Callable[[tirx.PrimFunc, Mapping[str, object]], bool], key: str,
                   value: object) -> tvm.IRModule:
    """`mod` with attribute `key` set to `value` on each PrimFunc `pick(func, its attributes)` chooses."""
    out = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs, global_infos=mod.global_infos)
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc) and pick(func, func.attrs if func.attrs is not None else {}):
            out[gvar] = func.with_attr(key, value)
    return out


def permute_axes(call: relax.Call) -> list[int] | None:
    """A permute_dims call's axes as Python ints (None: all reversed)."""
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def swaps_last_two(axes: list[int] | None, rank: int) -> bool:
    """Whether permute_dims `axes` (`permute_axes`) of a rank-`rank` tensor swap its last two dims only."""
    return axes == [*range(rank - 2), rank - 1, rank - 2] or (axes is None and rank == 2)


def use_counts(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings (and the function's result) use each var of `func`."""
    counts: dict[relax.Var, int] = {}
    values = [b.value for block in func.body.blocks for b in block.bindings] + [func.body.body]
    for value in values:
        for var in relax.analysis.free_vars(value):
            counts[var] = counts.get(var, 0) + 1
    return counts


def element_count(dims: Sequence[tirx.PrimExpr]) -> tirx.PrimExpr:
    """The element count of a shape's `dims`, symbolic ones included (int64 1 for none)."""
    return functools.reduce(operator.mul, dims, tirx.IntImm("int64", 1))


def _positive_scalar(expr: relax.Expr) -> float | None:
    """The value of a one-element float constant above zero, else None."""
    if not isinstance(expr, tvm.ir.Constant):
        return None
    value = expr.value.numpy()
    return float(value.reshape(())) if value.size == 1 and value.dtype.kind == "f" and value > 0 else None


def scaled_operand(x: relax.Expr, lookup: Callable[[relax.Var], relax.Expr | None]) -> tuple[relax.Expr, float]:
    """(y, s) where `x` is bound (`lookup`) to y * s or y / (1 / s) for a positive scalar constant s (attention's
    score scale: an imported BERT divides by 8), else (x, 1): a softmax (`fastmath.py`) or an attention kernel
    (`attention_fusion.py`) then reads y and takes the scale in, and the multiply or divide, left unused, is dead."""
    bound = lookup(x) if isinstance(x, relax.Var) else None
    name = bound.op.name if isinstance(bound, relax.Call) and isinstance(bound.op, tvm.ir.Op) else None
    if name not in ("relax.multiply", "relax.divide"):
        return x, 1.0
    a, b = bound.args
    for value, factor in [(a, b), (b, a)] if name == "relax.multiply" else [(a, b)]:
        scale = _positive_scalar(factor)
        if scale is not None and value.ty.dtype == "float32" and tvm_ffi.structural_equal(value.ty.shape, x.ty.shape):
            return value, scale if name == "relax.multiply" else 1 / scale
    return x, 1.0


def call_on_rows(builder: relax.BlockBuilder, kernel: tvm.ir.GlobalVar, x: relax.Expr, *operands: relax.Expr
                 ) -> relax.Expr:
    """`kernel` (float32 [rows, width] in, then `operands`, [rows, width] out) on `x` viewed as the rows of its last
    axis, its result in `x`'s shape: the row kernels (`softmax_rows.py`, `norm_rows.py`) take any rank, symbolic
    leading dims included, and a reshape of a dataflow value is a view, no copy."""
    *outer, width = x.ty.shape
    rows = tvm.sym.Analyzer().simplify(element_count(outer))
    flat = [rows, width]
    if len(outer) != 1:
        x = builder.emit(relax.op.reshape(x, flat))
    out = relax.call_tir(kernel, [x, *operands], relax.TensorType(flat, "float32"))
    return out if len(outer) == 1 else relax.op.reshape(builder.emit(out), [*outer, width])


CallRewrite = Callable[[relax.BlockBuilder, relax.Call], "relax.Expr | None"]


@mutator
class _CallRewriter(PyExprMutator):
    """Each call, its operands rewritten first, replaced by what `rewrite` makes of it (kept where that is None)."""

    def __init__(self, mod: tvm.IRModule, rewrite: CallRewrite) -> None:
        super().__init__(mod)
        self.rewrite = rewrite

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        call = super().visit_call_(call)
        new = self.rewrite(self.builder_, call)
        return call if new is None else new


def call_rewrites(name: str, rewrite: CallRewrite) -> tvm.transform.Pass:
    """The module pass `name` that replaces each call of every Relax function by `rewrite(builder, call)` where
    that is not None (the kernels of `plane_window.py`, `pool_rows.py`, `norm_rows.py`)."""

    @tvm.transform.module_pass(opt_level=0, name=name)
    def _pass(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        return rewrite_functions(mod, _CallRewriter(mod, rewrite))

    return _pass
