"""Reading register tiles back from scheduled TIR text."""

from __future__ import annotations

import re

_LOOP = re.compile(r"for (\w+) in T\.(\w+)\((?:T\.int64\()?(\d+)")


def column_widths(text: str) -> list[int]:
    """The column extent of every vectorized loop in `text`, with the unrolled loop of whole vectors split off it
    folded back in (`for c_0 in T.unroll(2)` over `for c_1 in T.vectorized(16)`: 32)."""
    loops = _loops(text)
    return [extent * (loops[i - 1][2] if i and _splits_vectors(loops, i - 1) else 1)
            for i, (_, kind, extent) in enumerate(loops) if kind == "vectorized"]


def unrolled_extents(text: str) -> list[int]:
    """The extents of the unrolled loops in `text`, in order, but for the vectors split off a vectorized loop."""
    loops = _loops(text)
    return [extent for i, (_, kind, extent) in enumerate(loops) if kind == "unroll" and not _splits_vectors(loops, i)]


def conv_tasks(text: str) -> tuple[str, str]:
    """(name, extent text) of a scheduled blocked conv's parallel loop: the last one before its update block (a
    padding stage's comes first)."""
    return re.findall(r"for (\w+) in T\.parallel\(([^)]+)\)", text[:text.index('"conv_blocked_update"')])[-1]


def _loops(text: str) -> list[tuple[str, str, int]]:
    """(name, kind, extent) of every loop in `text`, in order."""
    return [(name, kind, int(extent)) for name, kind, extent in _LOOP.findall(text)]


def _splits_vectors(loops: list[tuple[str, str, int]], i: int) -> bool:
    """Whether loop `i` is the unrolled loop of vectors split off the vectorized loop right inside it (`c_0` over
    `c_1`, either with the `_init` suffix `decompose_reduction` gives)."""
    if loops[i][1] != "unroll" or i + 1 >= len(loops) or loops[i + 1][1] != "vectorized":
        return False
    found = re.fullmatch(r"(\w+)_0(_init)?", loops[i][0])
    return found is not None and loops[i + 1][0] == f"{found[1]}_1{found[2] or ''}"
