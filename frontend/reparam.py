"""Reparameterization settings: Burn's Lora, QLora, Quantizer (with its QuantScheme), DoRA's Dora and the
Reparameterizer protocol for custom derivations; Module's `apply_lora`, `apply_dora`, `quantize_weights` and
`apply_qlora` run the passes they configure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol, Self

from kiln.ir import DType
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
    """Value kind (Burn's q8f, q8s, q4f, q4s, q2f, q2s or kiln's nf4), block shape (empty: one scale per tensor)
    and the scales' dtype (Burn's ScaleDtype: f32, f16 or bf16) or, for nf4, double-quantized f32 scales."""

    value: str = "q8f"
    block: tuple[int, ...] = ()
    scale_dtype: DType | str = DType.f32
    double_quant: bool = False

    def __post_init__(self) -> None:
        """The block as a tuple and the scale dtype as a DType ("f16" names one), so schemes compare and print
        alike however they were written."""
        object.__setattr__(self, "block", tuple(self.block))
        object.__setattr__(self, "scale_dtype", DType(self.scale_dtype))

    def with_value(self, value: str) -> QuantScheme:
        return replace(self, value=value)

    def per_block(self, block: tuple[int, ...], scale_dtype: DType | str = DType.f32) -> QuantScheme:
        """One scale per block of `block` over the trailing dims, stored as `scale_dtype`."""
        return replace(self, block=tuple(block), scale_dtype=scale_dtype)

    def per_tensor(self, scale_dtype: DType | str = DType.f32) -> QuantScheme:
        """One scale for the whole tensor, stored as `scale_dtype`."""
        return replace(self, block=(), scale_dtype=scale_dtype)

    @classmethod
    def nf4(cls, block: int = 64, scale_dtype: DType | str = DType.f32, double_quant: bool = False) -> QuantScheme:
        """QLoRA's NF4 (kiln's scheme, not Burn's): 16 normal-float levels, absmax scales per `block` values,
        with `double_quant` stored as i8 codes in groups of 256 (QLoRA's double quantization)."""
        return cls("nf4", (block,), scale_dtype, double_quant)


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
