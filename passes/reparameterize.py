"""reparameterize: attach LoRA or DoRA adapters to 2-D floating weights, freezing every base parameter.

`kind=lora`: `@w` becomes `reparam @w = lora(@w.base, @w.lora.a, @w.lora.b) {scale = alpha / rank}`.
`kind=dora`: `reparam @w = dora(@w.base, @w.dora.a, @w.dora.b, @w.dora.magnitude) {scale = alpha / rank}`, the
magnitude [d1] holding ||W||_c (column norms over axis 0), so that the derived weight equals W at start. The
magnitude reads the base's value once, here: a lazy base is evaluated for it from its initializer and ParamId
(the value it will initialize to) and stays lazy itself.
Uses of `@w` are unchanged; the base keeps the ParamId; `a` [d0, rank] ~ N(0, init_std or 1/rank), `b`
[rank, d1] = 0 and the magnitude are trainable where the base lives on autodiff (else the request waits for
`train`). A quantized weight (`reparam @w = dequantize(...)`, from quantize-weights) is the base of QLoRA or
QDoRA: its derivation is renamed `@w.base`, its codes keep the ParamId, and the factors take the dequantized
dtype (DoRA's magnitude the dequantized weight's norms).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.ir import Graph, Init, Interpreter, ParamNode, PassError, ReparamNode, TensorType, new_param_id
from kiln.ir.naming import dora_a, dora_b, dora_magnitude, lora_a, lora_b, lora_base
from kiln.ir.ops.linalg import column_norms
from kiln.ir.verifier import DEQUANTIZE

from .param_state import GroupOptions, request_grad

KINDS = ("lora", "dora")


def _factor(name: str, type: TensorType, home: ParamNode, init: Init | None = None,
            data: np.ndarray | None = None) -> ParamNode:
    """A trainable factor `name` placed (device, autodiff) like the stored base `home`."""
    node = ParamNode(name, type, new_param_id(), init, data, device=home.device, autodiff=home.autodiff,
                     checkpointing=home.checkpointing)
    return request_grad(node, True)


def lora_factors(a_name: str, b_name: str, type: TensorType, home: ParamNode, rank: int, init_std: float | None
                 ) -> tuple[ParamNode, ParamNode]:
    """The factors a [d0, rank] ~ N(0, init_std or 1/rank) and b [rank, d1] = 0 of a weight of `type`."""
    d0, d1 = type.shape
    std = init_std if init_std is not None else 1.0 / rank
    return (_factor(a_name, TensorType((d0, rank), type.dtype), home, Init("normal", (("std", std),))),
            _factor(b_name, TensorType((rank, d1), type.dtype), home, Init("zeros")))


@dataclass(frozen=True)
class Reparameterize(GroupOptions):
    """Apply LoRA (`kind=lora`) or DoRA (`kind=dora`) with `rank` and `alpha` to matched 2-D floating parameters."""

    name = "reparameterize"
    kind: str = "lora"
    """lora or dora"""
    rank: int = 8
    """the adapters' inner dimension"""
    alpha: float = 16.0
    """the scale is alpha / rank"""
    init_std: float | None = None
    """the standard deviation of the first adapter's initial values (none: the default init)"""

    def apply(self, graph: Graph) -> Graph:
        if self.kind not in KINDS:
            raise PassError(f"reparameterize: unknown kind {self.kind!r} (built in: {', '.join(KINDS)})")
        if self.rank < 1:
            raise PassError(f"reparameterize: rank must be positive, got {self.rank}")
        nested = [r.name for r in graph.reparams.values() if r.kind != DEQUANTIZE]
        if nested:
            raise PassError("reparameterize: nested reparameterizations are not supported "
                            f"(@{nested[0]} is already derived)")
        hit = self.selected(graph)
        quantized = {o for r in graph.reparams.values() for o in r.operands}  # codes and scales
        values = Interpreter(graph)  # the weights DoRA's magnitudes are the norms of (computed on demand)
        params: dict[str, ParamNode] = {}
        reparams: dict[str, ReparamNode] = {}
        for name, p in graph.params.items():
            frozen = request_grad(p, False)
            if p.type.rank != 2 or not p.type.dtype.is_float or name in quantized or not hit(p):
                params[name] = frozen
                continue
            base = frozen.replace(name=lora_base(name))
            params[base.name] = base
            self.adapt(name, p.type, frozen, values, params, reparams)
        for name, r in graph.reparams.items():
            codes = graph.params[r.operands[0]]
            if r.type.rank != 2 or not hit(codes):
                reparams[name] = r
                continue
            reparams[lora_base(name)] = r.replace(name=lora_base(name))
            self.adapt(name, r.type, codes, values, params, reparams)
        return graph.replace(params=params, reparams=reparams)

    def adapt(self, name: str, type: TensorType, home: ParamNode, values: Interpreter,
              params: dict[str, ParamNode], reparams: dict[str, ReparamNode]) -> None:
        """Add the factors of weight `name` and `reparam @name = <kind>(@name.base, factors...)`."""
        names = (lora_a(name), lora_b(name)) if self.kind == "lora" else (dora_a(name), dora_b(name))
        factors: tuple[ParamNode, ...] = lora_factors(*names, type, home, self.rank, self.init_std)
        if self.kind == "dora":
            weight = values.symbol(name)
            norms = column_norms(weight.astype(np.float64))
            if not np.all(norms > 0):
                raise PassError(f"reparameterize: DoRA normalizes each column of @{name}, but column "
                                f"{int(np.argmin(norms > 0))} is all zeros (it has no direction)")
            norms = norms.astype(weight.dtype)
            factors += (_factor(dora_magnitude(name), TensorType(type.shape[1:], type.dtype), home, data=norms),)
        params.update({f.name: f for f in factors})
        reparams[name] = ReparamNode(name, type, self.kind, (lora_base(name), *(f.name for f in factors)),
                                     {"scale": self.alpha / self.rank})
