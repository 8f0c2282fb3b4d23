"""Devices: where values live, optionally with autodiff and a checkpointing strategy attached."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kiln.ir import KilnError
from kiln.ir.devices import checkpointing_name, device_name


@dataclass(frozen=True)
class Device:
    """`Device("cpu")`, `Device("cuda:0")` (`Device("cuda")` is `cuda:0`). Equality and hashing ignore autodiff and
    checkpointing. A CUDA device is accepted anywhere; reading a value on one this machine lacks is an error."""

    name: str = "cpu"
    autodiff_enabled: bool = False
    checkpointing: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", device_name(self.name))
        checkpointing_name(self.checkpointing)

    def autodiff(self, checkpointing: str | None = None) -> Device:
        """The same device with autodiff, and optionally a gradient-checkpointing strategy."""
        return replace(self, autodiff_enabled=True, checkpointing=checkpointing)

    def require_present(self) -> None:
        """Raise a one-line KilnError when this is a CUDA device the machine does not have (checked at realization,
        so a model can be built for a GPU anywhere)."""
        if self.name != "cpu":
            from kiln.runtime.tvm.target import cuda_present
            if not cuda_present(int(self.name.split(":")[1])):
                raise KilnError(f"device {self.name} is not available: TVM finds no CUDA GPU {self.name} on this "
                                f"machine (build on Device('cpu') instead)")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __str__(self) -> str:
        return self.name


def as_device(device: Device | str | None) -> Device:
    if device is None:
        return Device("cpu")
    return device if isinstance(device, Device) else Device(device)
