"""Reparameterization settings: Burn's Lora, QLora, Quantizer (with its QuantScheme), DoRA's Dora and the
Reparameterizer protocol for custom derivations; Module's `apply_lora`, `apply_dora`, `quantize_weights` and
`apply_qlora` run the passes they configure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol, Self

from kiln.passes.group import ParamGroup

from .param import Param, Reparam


@dataclass(frozen=True)
class Adapter:
    """Low-rank adapter settings: rank, alpha (scale = alpha / rank), factor init std (default 1/rank), which
    params; `kind` names the `reparameterize` derivation they configure."""

    kind: ClassVar[str]
    rank: int
    alpha: float
    init_std: float | None = None
    param_group: ParamGroup = field(default_factory=ParamGroup.all)

    def set_param_group(self, group: ParamGroup) -> Self:
        return replace(self, param_group=group)


@dataclass(frozen=True)
class Lora(Adapter):
    """LoRA: the weight becomes base + scale * (a @ b)."""

    kind: ClassVar[str] = "lora"


@dataclass(frozen=True)
class Dora(Adapter):
    """DoRA (weight-decomposed LoRA): magnitude * V / ||V||_c with V = base + scale * (a @ b), the trainable
    magnitude [out] starting at the base's column norms, so the weight starts equal to the base."""

    kind: ClassVar[str] = "dora"


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
