"""Op locations: where an op came from (a `.kir` position, a traced Python line and module path, an ONNX node, or
several of these fused), so printed IR and error messages point back at the user's source.

Locations are metadata: they never enter structural hashes, equality, cse keys or compile-cache keys. Their text
form is MLIR's `loc(...)` syntax, written by the printer only on request (`print_graph(..., locations=True)`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar


@dataclass(frozen=True, slots=True)
class FileLoc:
    """A position in a file: `.kir` text (line and column) or Python source (line only, `col` None)."""

    file: str
    line: int
    col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f":{self.col}" if self.col is not None else "")

    def text(self) -> str:
        return f"{json.dumps(self.file)}:{self.line}" + (f":{self.col}" if self.col is not None else "")


@dataclass(frozen=True, slots=True)
class NameLoc:
    """A named place, optionally over a child location: a module path over the traced Python line
    (`encoder.layers.2.attn` at `model.py:12`), or an ONNX node name over its op type."""

    name: str
    child: FileLoc | NameLoc | None = None

    def __str__(self) -> str:
        return self.name if self.child is None else f"{self.name} ({self.child})"

    def text(self) -> str:
        return json.dumps(self.name) + (f"({self.child.text()})" if self.child is not None else "")


@dataclass(frozen=True, slots=True)
class FusedLoc:
    """Several sources merged into one op (cse keeping one of equal ops), in order, without repeats."""

    locs: tuple[FileLoc | NameLoc, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.locs)) + "]"

    def text(self) -> str:
        return "fused[" + ", ".join(loc.text() for loc in self.locs) + "]"


Location = FileLoc | NameLoc | FusedLoc


def fuse(locs: Iterable[Location | None]) -> Location | None:
    """One location standing for all of `locs`: None without any, the one when all are equal, else a flat
    `FusedLoc` keeping first occurrences in order."""
    flat: dict[FileLoc | NameLoc, None] = {}  # an ordered set: cse may merge thousands of equal constants
    for loc in locs:
        if isinstance(loc, FusedLoc):
            flat.update(dict.fromkeys(loc.locs))
        elif loc is not None:
            flat[loc] = None
    if not flat:
        return None
    parts = tuple(flat)
    return parts[0] if len(parts) == 1 else FusedLoc(parts)


def loc_text(loc: Location) -> str:
    """The printed suffix of an op at `loc`: `loc("model.kir":3:5)`."""
    return f"loc({loc.text()})"


def onnx_loc(node_name: str, op_type: str) -> NameLoc:
    """Where an imported op came from: the ONNX node (by name; an unnamed node by its op type alone)."""
    return NameLoc(node_name, NameLoc(op_type)) if node_name else NameLoc(op_type)


E = TypeVar("E", bound=Exception)


def located(loc: Location | None, error: E) -> E:
    """`error` with its message prefixed by `loc`, so it names the user's line and layer; unchanged without a
    location, or when the error is not a plain message (an exception class taking other arguments)."""
    if loc is None or error.args != (str(error),):
        return error
    return type(error)(f"{loc}: {error}")
