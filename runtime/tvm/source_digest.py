"""The compiler's version in cache keys: a digest of its own source, so that no cached build or calibration outlives
an edit of the code that made it. (A hand-bumped number was once forgotten: a change of the bf16 projection skip
shipped under the key of the build before it, and a warm cache kept running the old kernels.)"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import kiln.ir
import kiln.passes
import kiln.runtime


def source_digest(roots: Sequence[tuple[str, Path]]) -> str:
    """A digest of every `.py` file under each named root: its path relative to the root, under the root's name,
    and its bytes; independent of where the roots are installed."""
    h = hashlib.blake2b(digest_size=10)
    for name, root in roots:
        for path in sorted(root.rglob("*.py")):
            h.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def compiler_roots() -> list[tuple[str, Path]]:
    """The source folders of the layers a build depends on: the IR, the passes and the runtime."""
    return [(package.__name__, Path(folder)) for package in (kiln.ir, kiln.passes, kiln.runtime)
            for folder in package.__path__]


@cache
def compiler_version() -> str:
    """The digest of the installed compiler's source, read once per process on first use (not at import: a
    process that never builds, `kiln opt` on a pass, pays nothing)."""
    return source_digest(compiler_roots())
