"""Linux's per-process permission for AMX tile data: without it the first tile instruction is SIGILL.

The kernel keeps AMX's 8 KiB of tile state off by default (XFEATURE_XTILEDATA is a dynamic feature); a process asks
once with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), and every thread it starts later inherits the grant.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

from kiln.ir import KilnError

SYS_ARCH_PRCTL = 158  # x86_64 syscall number
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


@functools.cache
def request_tile_data() -> None:
    """Ask Linux (once per process) to let this process use AMX tiles; a refusal is a KilnError naming why."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise KilnError(f"AMX tiles need Linux on x86_64, not {platform.system()} on {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        err = ctypes.get_errno()
        raise KilnError(f"Linux refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM): {os.strerror(err)}")
