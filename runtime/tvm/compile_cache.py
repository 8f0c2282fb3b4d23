"""The compile cache: built programs by key, in memory and on disk under `$KILN_CACHE_DIR/compile` (default
`~/.cache/kiln`).

A disk entry is an artifact (`artifact.py`): the library and a checksummed sidecar, each written atomically. An
entry whose sidecar or library fails its checksum, or whose sidecar names an older artifact format, is reported as
a miss (and logged), so the caller rebuilds it and `store` replaces it; a damaged file is never loaded.

The disk cache is bounded: after each store, the least recently used entries (a hit touches its sidecar) leave
until the folder holds at most $KILN_CACHE_MAX_BYTES (default 4 GiB); `kiln cache info|prune|clear` reports and
trims it by hand.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.ir import KilnError

from .artifact import PARAMS, SIDECAR, Program, load_program, write_artifact

CACHE_ENV = "KILN_CACHE_DIR"
MAX_BYTES_ENV = "KILN_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30
MEMORY_ENTRIES = 256

_log = logging.getLogger(__name__)
_memory: OrderedDict[str, tuple[Program, str | None]] = OrderedDict()


def cache_dir() -> str:
    """The cache root: $KILN_CACHE_DIR, else ~/.cache/kiln (read on every call, so tests can redirect it)."""
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "kiln")


def max_bytes() -> int:
    """The disk cache's size bound: $KILN_CACHE_MAX_BYTES (a byte count), else DEFAULT_MAX_BYTES."""
    text = os.environ.get(MAX_BYTES_ENV)
    if text is None or not text.strip():
        return DEFAULT_MAX_BYTES
    if not text.strip().isdigit():
        raise KilnError(f"{MAX_BYTES_ENV}={text!r} is not a byte count (a non-negative integer)")
    return int(text)


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
    _touch(path + SIDECAR)
    return program, path


def _touch(path: str) -> None:
    """Mark an entry used now (its sidecar's mtime orders eviction); a read-only cache just keeps its order."""
    try:
        os.utime(path)
    except OSError:
        pass


def _remember(key: str, program: Program, path: str | None) -> None:
    """Keep a program in the in-memory cache (least recently used entries leave first)."""
    _memory[key] = (program, path)
    _memory.move_to_end(key)
    while len(_memory) > MEMORY_ENTRIES:
        _memory.popitem(last=False)


def store(key: str, program: Program, export: Callable[[str], None]) -> tuple[Program, str | None]:
    """Write a freshly built program to disk and remember it (a failed write is logged, not raised); returns what to
    run: the stored library loaded back, whose machine code the write made (a built LLVM module generates it again
    when first called: 8 s for ResNet-50), or the built program where the write or the load failed."""
    try:
        os.makedirs(os.path.dirname(entry_path(key)), mode=0o700, exist_ok=True)  # the cache is the user's own
        write_artifact(entry_path(key), program, export, key=key)
    except Exception as e:  # a read-only or full disk, or a target whose modules cannot be exported
        _log.warning("kiln compile cache: could not write entry %s: %s", key, e)
        return _remembered(key, program, None)
    try:
        evicted = prune(keep=key)
    except KilnError as e:  # a malformed size bound: the build stands, the user hears of it
        _log.warning("kiln compile cache: not pruning: %s", e)
        evicted = []
    for entry in evicted:
        _log.info("kiln compile cache: evicted %s (%d bytes, least recently used)", entry.key, entry.bytes)
    try:
        return _remembered(key, load_program(entry_path(key))[0], entry_path(key))
    except KilnError as e:  # not loadable on this host (a CUDA library without a driver)
        _log.info("kiln compile cache: running the built program of %s: %s", key, e)
        return _remembered(key, program, None)


def _remembered(key: str, program: Program, path: str | None) -> tuple[Program, str | None]:
    """`_remember` the program `store` hands back, and hand it back."""
    _remember(key, program, path)
    return program, path


def clear_memory() -> None:
    """Forget the in-memory entries (the disk cache stays)."""
    _memory.clear()


@dataclass(frozen=True)
class DiskEntry:
    """One entry on disk: its key, its files (library, sidecar, weights), their bytes and when it was last used."""

    key: str
    files: tuple[Path, ...]
    bytes: int
    last_used: float


def disk_entries() -> list[DiskEntry]:
    """The disk cache's entries, least recently used first (files of a dead write, without a sidecar, count as
    used when they were written)."""
    folder = Path(cache_dir()) / "compile"
    groups: dict[str, list[Path]] = {}
    try:
        names = sorted(folder.iterdir())
    except OSError:
        return []
    for path in names:
        if not path.name.startswith("."):  # a live writer's temporary belongs to no entry yet
            groups.setdefault(path.name.split(".so", 1)[0], []).append(path)
    entries = []
    for key, files in groups.items():
        sizes = [f.lstat() for f in files]
        sidecar = [s for f, s in zip(files, sizes) if f.name.endswith(SIDECAR)]
        used = (sidecar or sizes)[0].st_mtime
        entries.append(DiskEntry(key, tuple(files), sum(s.st_size for s in sizes), used))
    return sorted(entries, key=lambda e: e.last_used)


def _remove(entry: DiskEntry) -> None:
    """Delete an entry's files, sidecar first, so a reader never sees a sidecar without its library."""
    for f in sorted(entry.files, key=lambda f: not f.name.endswith(SIDECAR)):
        try:
            f.unlink()
        except FileNotFoundError:
            pass


def prune(limit: int | None = None, keep: str | None = None) -> list[DiskEntry]:
    """Remove least recently used entries (never `keep`) until the disk cache holds at most `limit` bytes
    (default: max_bytes()); returns what left."""
    limit = max_bytes() if limit is None else limit
    entries = disk_entries()
    total = sum(e.bytes for e in entries)
    removed = []
    for entry in entries:
        if total <= limit:
            break
        if entry.key == keep:
            continue
        _remove(entry)
        total -= entry.bytes
        removed.append(entry)
    return removed


def clear() -> list[DiskEntry]:
    """Remove every disk entry and forget the in-memory ones; returns what left."""
    entries = disk_entries()
    for entry in entries:
        _remove(entry)
    clear_memory()
    return entries
