"""Reading register tiles back from scheduled TIR text."""

from __future__ import annotations

import re

_LOOP = re.compile(r"for (\w+) in T\.(\w+)\((?:T\.int64\()?(\d+)")


def column_widths(text: str) -> list[int]:
    """The column extent of every vectorized loop in `text`, with the unrolled loop of whole vectors split off it
    folded back in (`for c_0 in T.unroll(2)` over `for c_1 in T.vectorized(16)`: 32)."""
    loops = [(name, kind, int(extent)) for name, kind, extent in _LOOP.findall(text)]
    widths = []
    for i, (name, kind, extent) in enumerate(loops):
        if kind != "vectorized":
            continue
        outer = loops[i - 1] if i else None
        split = outer is not None and outer[1] == "unroll" and split_pair(outer[0], name)
        widths.append(extent * (outer[2] if split else 1))
    return widths


def unrolled_extents(text: str) -> list[int]:
    """The extents of the unrolled loops in `text`, in order, but for the vectors split off a vectorized loop."""
    loops = _LOOP.findall(text)
    return [int(extent) for i, (name, kind, extent) in enumerate(loops) if kind == "unroll"
            and not (i + 1 < len(loops) and loops[i + 1][1] == "vectorized" and split_pair(name, loops[i + 1][0]))]


def split_pair(outer: str, inner: str) -> bool:
    """Whether loop names `outer` and `inner` are the two halves of one split loop (`c_0`, `c_1`, either with an
    `_init` suffix as `decompose_reduction` names them)."""
    found = re.fullmatch(r"(\w+)_0(_init)?", outer)
    return found is not None and inner == f"{found[1]}_1{found[2] or ''}"
