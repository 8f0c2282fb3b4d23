"""Layout: how a parameter's file form (records, state dicts) differs from its live form (Burn's param_mapper,
declared as data so it survives passes, `.kir` text, traces and records).

One description gives both directions: saving permutes the live value's axes by `permute` (file axis k is live
axis `permute[k]`), then reshapes to `reshape`; loading undoes the two in reverse order. Neither direction can
disagree with the other, and the file shape follows from the live shape alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import ShapeError


@dataclass(frozen=True)
class Layout:
    """A file form of a parameter: its live axes permuted by `permute`, then reshaped to `reshape` (either may
    be None, meaning no permutation or no reshape)."""

    permute: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.permute is None and self.reshape is None:
            raise ShapeError("a layout needs a permute or a reshape (no layout at all is None)")
        if self.permute is not None and sorted(self.permute) != list(range(len(self.permute))):
            raise ShapeError(f"layout permute{list(self.permute)} is not a permutation of the axes")
        if self.reshape is not None and any(not isinstance(d, int) or d < 0 for d in self.reshape):
            raise ShapeError(f"layout reshape{list(self.reshape)} needs non-negative sizes")

    @staticmethod
    def transpose() -> Layout:
        """A 2-D parameter stored transposed: PyTorch's Linear `[out, in]` file form of Burn's `[in, out]`."""
        return Layout(permute=(1, 0))

    def _permuted(self, live: tuple[int, ...]) -> tuple[int, ...]:
        if self.permute is None:
            return tuple(live)
        if len(self.permute) != len(live):
            raise ShapeError(f"layout {self} permutes {len(self.permute)} axes but the parameter has shape "
                             f"{list(live)}")
        return tuple(live[a] for a in self.permute)

    def check(self, live: tuple[int | None, ...]) -> None:
        """Raise ShapeError unless this layout applies to a parameter of live shape `live`."""
        self.file_shape(live)

    def file_shape(self, live: tuple[int | None, ...]) -> tuple[int, ...]:
        """The shape a parameter of live shape `live` has in a file."""
        if any(d is None for d in live):
            raise ShapeError(f"layout {self} needs a static shape, not {list(live)}")
        permuted = self._permuted(live)  # type: ignore[arg-type]
        if self.reshape is None:
            return permuted
        if math.prod(self.reshape) != math.prod(permuted):
            raise ShapeError(f"layout {self} cannot reshape a parameter of shape {list(live)} "
                             f"({math.prod(permuted)} elements) to {list(self.reshape)}")
        return self.reshape

    def save(self, live: np.ndarray) -> np.ndarray:
        """The file form of a live value."""
        out = live if self.permute is None else np.transpose(live, self.permute)
        return out if self.reshape is None else out.reshape(self.file_shape(live.shape))

    def load(self, stored: np.ndarray, live: tuple[int, ...]) -> np.ndarray:
        """The live value (of shape `live`) of a file form; a view where numpy can give one."""
        if tuple(stored.shape) != self.file_shape(live):
            raise ShapeError(f"layout {self}: a parameter of shape {list(live)} is stored as "
                             f"{list(self.file_shape(live))}, not {list(stored.shape)}")
        out = stored if self.reshape is None else stored.reshape(self._permuted(live))
        return out if self.permute is None else np.transpose(out, np.argsort(self.permute))

    def __str__(self) -> str:
        """The `.kir` text: `permute[1, 0]`, `reshape[6]` or both, space separated."""
        parts = [f"{word}[{', '.join(map(str, dims))}]" for word, dims in
                 (("permute", self.permute), ("reshape", self.reshape)) if dims is not None]
        return " ".join(parts)
