"""reparameterize: attach LoRA adapters to 2-D floating weights, freezing every base parameter.

`@w` becomes `reparam @w = lora(@w.base, @w.lora.a, @w.lora.b) {scale = alpha / rank}`: uses of `@w` are
unchanged; the base keeps the ParamId; `a` [d0, rank] ~ N(0, init_std or 1/rank) and `b` [rank, d1] = 0
are trainable where the base lives on autodiff (else the request waits for `train`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.ir import Graph, Init, ParamNode, PassError, ReparamNode, TensorType, new_param_id

from .param_state import GroupOptions, request_grad


def lora_factors(p: ParamNode, rank: int, init_std: float | None) -> tuple[ParamNode, ParamNode]:
    d0, d1 = p.type.shape
    def factor(suffix: str, shape: tuple, init: Init) -> ParamNode:
        node = ParamNode(f"{p.name}.lora.{suffix}", TensorType(shape, p.type.dtype), new_param_id(), init,
                         device=p.device, autodiff=p.autodiff, checkpointing=p.checkpointing)
        return request_grad(node, True)
    std = init_std if init_std is not None else 1.0 / rank
    return (factor("a", (d0, rank), Init("normal", (("std", std),))), factor("b", (rank, d1), Init("zeros")))


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
        if graph.reparams:
            raise PassError("reparameterize: nested reparameterizations are not supported "
                            f"(@{next(iter(graph.reparams))} is already derived)")
        group = self.selected()
        params: dict[str, ParamNode] = {}
        reparams: dict[str, ReparamNode] = {}
        for name, p in graph.params.items():
            frozen = request_grad(p, False)
            if p.type.rank != 2 or not p.type.dtype.is_float or not group.matches(p.id, name):
                params[name] = frozen
                continue
            base = frozen.replace(name=f"{name}.base")
            a, b = lora_factors(p, self.rank, self.init_std)
            params.update({base.name: base, a.name: a, b.name: b})
            reparams[name] = ReparamNode(name, p.type, "lora", (base.name, a.name, b.name),
                                         {"scale": self.alpha / self.rank})
        return graph.replace(params=params, reparams=reparams)
