"""Reparameterization settings: Burn's Lora, QLora, Quantizer (with its QuantScheme) and the Reparameterizer
protocol for custom derivations; Module's `apply_lora`, `quantize_weights` and `apply_qlora` run the passes they
configure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from kiln.passes.group import ParamGroup

from .param import Param, Reparam


@dataclass(frozen=True)
class Lora:
    """LoRA settings: rank, alpha (scale = alpha / rank), factor init std (default 1/rank), which params."""

    rank: int
    alpha: float
    init_std: float | None = None
    param_group: ParamGroup = field(default_factory=ParamGroup.all)

    def set_param_group(self, group: ParamGroup) -> Lora:
        return replace(self, param_group=group)


class Reparameterizer(Protocol):
    """Custom reparameterizations: return the structural base and an optional Reparam for `Param.val`."""

    def reparameterize(self, path: str, param: Param) -> tuple[Param, Reparam | None]: ...


@dataclass(frozen=True)
class QuantScheme:
    """Value kind (q8f, q8s, q4f, q4s, q2f, q2s) and block shape (empty: one scale per tensor)."""

    value: str = "q8f"
    block: tuple[int, ...] = ()

    def with_value(self, value: str) -> QuantScheme:
        return replace(self, value=value)

    def per_block(self, block: tuple[int, ...]) -> QuantScheme:
        return replace(self, block=tuple(block))

    def per_tensor(self) -> QuantScheme:
        return replace(self, block=())


@dataclass
class Quantizer:
    """Calibration (minmax or absmean) and scheme over a parameter group (all float params by default).

    Like Burn's, it is mutable: `quantize_weights_group` sets its group."""

    calibration: str = "minmax"
    scheme: QuantScheme = field(default_factory=QuantScheme)
    param_group: ParamGroup = field(default_factory=ParamGroup.all)

    def set_param_group(self, group: ParamGroup) -> None:
        self.param_group = group


@dataclass(frozen=True)
class QLora:
    """Quantize the bases with `quantizer`, then attach `lora` adapters."""

    lora: Lora
    quantizer: Quantizer
