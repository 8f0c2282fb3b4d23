"""Arrays TVM's CPU kernels take without a copy: 64-byte aligned, C-contiguous, writeable.

TVM allocates every buffer on a 64-byte boundary and its kernels are built assuming their arguments are too (LLVM
emits aligned vector moves on them), so an executable copies any input that is not; numpy's own allocations are
usually only 16-byte aligned. `aligned_empty` / `aligned` make arrays an executable hands to the kernel as they are.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ALIGNMENT = 64  # bytes: TVM's allocation alignment, which its kernels assume of every argument


def aligned_empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def is_aligned(x: np.ndarray) -> bool:
    """Whether an executable takes `x` zero-copy: C-contiguous, writeable, data on a 64-byte boundary."""
    return bool(x.flags.c_contiguous and x.flags.writeable and x.ctypes.data % ALIGNMENT == 0)


def aligned(x: Any) -> np.ndarray:
    """`x` itself when an executable takes it zero-copy, else a 64-byte aligned C-contiguous copy."""
    x = np.asarray(x)
    if is_aligned(x):
        return x
    out = aligned_empty(x.shape, x.dtype)
    np.copyto(out, x)
    return out
