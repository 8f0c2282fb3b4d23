"""A bf16 build's products of two activations, computed in bf16 after attention fusion has taken its own.

The lowering leaves a float32 product of two run-time operands (attention's `q @ kᵀ` and `p @ v`) in f32 where the
CPU has a bf16 product kernel, so `attention_fusion.py` can first compute a whole `softmax(s q kᵀ) v` with its f32
kernel: on Zen 4 that beat the bf16 products with their casts, packs, paddings and a softmax between (ViT-B/16 at
8 x 197: 5.7 against 7.3 ms). This pass then computes every such product left with the bf16 kernel (`amx.py`:
`activation_product`), or else with bf16 operands, as the lowering did before.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import op as R
from tvm.target import Target

from .amx import activation_product
from .relax_rewrite import call_rewrites

_MATMUL = tvm.ir.Op.get("relax.matmul")


def deferred_product(x: relax.Expr, y: relax.Expr) -> bool:
    """Whether a bf16 build's lowering leaves `x @ y` in f32 for this pass: two float32 run-time operands (no
    constant) of one rank, 2 or more."""
    return all(not isinstance(a, tvm.ir.Constant) and a.ty.dtype == "float32" for a in (x, y)) and \
        x.ty.ndim >= 2 and x.ty.ndim == y.ty.ndim


def bf16_activation_products(target: Target) -> tvm.transform.Pass:
    """The module pass computing each f32 product `deferred_product` takes in bf16 (a bf16 build's)."""

    def rewrite(builder: relax.BlockBuilder, call: relax.Call) -> relax.Expr | None:
        if not call.op.same_as(_MATMUL) or call.ty.dtype != "float32" or not deferred_product(*call.args):
            return None
        tiled = activation_product(builder, *call.args, target)
        if tiled is not None:
            return tiled
        x, y = (builder.emit(R.astype(a, "bfloat16")) for a in call.args)
        return R.matmul(x, y, out_dtype="float32")

    return call_rewrites("KilnBf16ActivationProducts", rewrite)
