"""reparameterize: attach LoRA adapters to 2-D floating weights, freezing every base parameter.

`@w` becomes `reparam @w = lora(@w.base, @w.lora.a, @w.lora.b) {scale = alpha / rank}`: uses of `@w` are
unchanged; the base keeps the ParamId; `a` [d0, rank] ~ N(0, init_std or 1/rank) and `b` [rank, d1] = 0
are trainable where the base lives on autodiff (else the request waits for `train`). A quantized weight
(`reparam @w = dequantize(...)`, from quantize-weights) is QLoRA's base: its derivation is renamed `@w.base`,
its codes keep the ParamId, and the factors take the dequantized dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Init, ParamNode, PassError, ReparamNode, TensorType, new_param_id
from kiln.ir.naming import lora_a, lora_b, lora_base
from kiln.ir.verifier import DEQUANTIZE

from .param_state import GroupOptions, request_grad


def lora_factors(name: str, type: TensorType, home: ParamNode, rank: int, init_std: float | None
                 ) -> tuple[ParamNode, ParamNode]:
    """The factors of weight `name`, of `type`, placed (device, autodiff) like its stored base `home`."""
    d0, d1 = type.shape
    def factor(node_name: str, shape: tuple, init: Init) -> ParamNode:
        node = ParamNode(node_name, TensorType(shape, type.dtype), new_param_id(), init,
                         device=home.device, autodiff=home.autodiff, checkpointing=home.checkpointing)
        return request_grad(node, True)
    std = init_std if init_std is not None else 1.0 / rank
    return (factor(lora_a(name), (d0, rank), Init("normal", (("std", std),))),
            factor(lora_b(name), (rank, d1), Init("zeros")))


@dataclass(frozen=True)
class Reparameterize(GroupOptions):
    """Apply LoRA (`kind=lora`) with `rank` and `alpha` to matched 2-D floating parameters."""

    name = "reparameterize"
    kind: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    init_std: float | None = None

    def apply(self, graph: Graph) -> Graph:
        if self.kind != "lora":
            raise PassError(f"reparameterize: unknown kind {self.kind!r} (built in: lora)")
        if self.rank < 1:
            raise PassError(f"reparameterize: rank must be positive, got {self.rank}")
        nested = [r.name for r in graph.reparams.values() if r.kind != DEQUANTIZE]
        if nested:
            raise PassError("reparameterize: nested reparameterizations are not supported "
                            f"(@{nested[0]} is already derived)")
        hit = self.selected(graph)
        quantized = {o for r in graph.reparams.values() for o in r.operands}  # codes and scales
        params: dict[str, ParamNode] = {}
        reparams: dict[str, ReparamNode] = {}
        for name, p in graph.params.items():
            frozen = request_grad(p, False)
            if p.type.rank != 2 or not p.type.dtype.is_float or name in quantized or not hit(p):
                params[name] = frozen
                continue
            base = frozen.replace(name=lora_base(name))
            params[base.name] = base
            self.adapt(name, p.type, frozen, params, reparams)
        for name, r in graph.reparams.items():
            codes = graph.params[r.operands[0]]
            if r.type.rank != 2 or not hit(codes):
                reparams[name] = r
                continue
            reparams[lora_base(name)] = r.replace(name=lora_base(name))
            self.adapt(name, r.type, codes, params, reparams)
        return graph.replace(params=params, reparams=reparams)

    def adapt(self, name: str, type: TensorType, home: ParamNode, params: dict[str, ParamNode],
              reparams: dict[str, ReparamNode]) -> None:
        """Add the factors of weight `name` and `reparam @name = lora(@name.base, a, b)`."""
        a, b = lora_factors(name, type, home, self.rank, self.init_std)
        params.update({a.name: a, b.name: b})
        reparams[name] = ReparamNode(name, type, "lora", (lora_base(name), a.name, b.name),
                                     {"scale": self.alpha / self.rank})
