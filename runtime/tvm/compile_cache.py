"""The compile cache: built programs by key, in memory and on disk under `$KILN_CACHE_DIR/compile` (default
`~/.cache/kiln`).

A disk entry is an artifact (`artifact.py`): the library and a checksummed sidecar, each written atomically. An
entry whose sidecar or library fails its checksum, or whose sidecar names an older artifact format, is reported as
a miss (and logged), so the caller rebuilds it and `store` replaces it; a damaged file is never loaded.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable

from kiln.ir import KilnError

from .artifact import PARAMS, SIDECAR, Program, load_program, write_artifact

CACHE_ENV = "KILN_CACHE_DIR"
MEMORY_ENTRIES = 256

_log = logging.getLogger(__name__)
_memory: OrderedDict[str, tuple[Program, str | None]] = OrderedDict()


def cache_dir() -> str:
    """The cache root: $KILN_CACHE_DIR, else ~/.cache/kiln (read on every call, so tests can redirect it)."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kiln")


def entry_path(key: str) -> str:
    """Where the library of entry `key` lives (its sidecar sits beside it)."""
    return os.path.join(cache_dir(), "compile", f"{key}.so")


def lookup(key: str) -> tuple[Program, str | None] | None:
    """A cached program and the library file it was loaded from (None for a build of this process), or None."""
    if key in _memory:
        _memory.move_to_end(key)
        return _memory[key]
    path = entry_path(key)
    if not os.path.lexists(path + SIDECAR):
        return None
    links = [p for p in (path, path + SIDECAR, path + PARAMS) if os.path.islink(p)]
    if links:  # an entry is kiln's own files: a link may point anywhere (another user's library, /dev/zero)
        _log.warning("kiln compile cache: not using entry %s: %s is a symbolic link", key, links[0])
        return None
    try:
        program, payload = load_program(path)
    except KilnError as e:  # damaged (CorruptArtifact), or not loadable on this host
        _log.warning("kiln compile cache: not using entry %s: %s", key, e)
        return None
    if payload.get("key") != key:
        _log.warning("kiln compile cache: entry %s holds key %s; discarding it", path, payload.get("key"))
        return None
    _remember(key, program, path)
    return program, path


def _remember(key: str, program: Program, path: str | None) -> None:
    """Keep a program in the in-memory cache (least recently used entries leave first)."""
    _memory[key] = (program, path)
    _memory.move_to_end(key)
    while len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)


def store(key: str, program: Program, export: Callable[[str], None]) -> None:
    """Remember a freshly built program and write it to disk (a failed write is logged, not raised)."""
    _remember(key, program, None)
    try:
        os.makedirs(os.path.dirname(entry_path(key)), mode=0o700, exist_ok=True)  # the cache is the user's own
        write_artifact(entry_path(key), program, export, key=key)
    except Exception as e:  # a read-only or full disk, or a target whose modules cannot be exported
        _log.warning("kiln compile cache: could not write entry %s: %s", key, e)


def clear_memory() -> None:
    """Forget the in-memory entries (the disk cache stays)."""
    _memory.clear()
