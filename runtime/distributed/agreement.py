"""The start-up check of a data-parallel run: every rank holds the same model (parameter paths, shapes, dtypes and
ParamIds), or all fail with one error naming the first difference. Ranks exchange a hash; only when the hashes
differ do they exchange the descriptions to find where."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kiln.ir import DistributedError

from .engine import TorchEngine

Description = Sequence[tuple[str, tuple[int | None, ...], str, str]]  # (path, shape, dtype, ParamId) per parameter


_FIELDS = ("path", "shape", "dtype", "ParamId")


def _first_difference(first: Description, other: Description, rank: int) -> str:
    for a, b in zip(first, other):
        for field, x, y in zip(_FIELDS, a, b):
            if x != y:
                show = (lambda v: list(v)) if field == "shape" else str
                return f"parameter {a[0]}: rank 0 has {field} {show(x)}, rank {rank} has {show(y)}"
    return f"rank 0 has {len(first)} parameters, rank {rank} has {len(other)}"


def check_same_model(engine: TorchEngine, description: Description) -> None:
    """Raise DistributedError on every rank unless all ranks' `description`s are equal."""
    digest = hashlib.blake2b(repr(list(description)).encode(), digest_size=16).hexdigest()
    digests = engine.all_gather_object(digest)
    if len(set(digests)) == 1:
        return
    descriptions = engine.all_gather_object(list(description))
    rank = next(r for r, d in enumerate(digests) if d != digests[0])
    raise DistributedError("the ranks hold different models: "
                           + _first_difference(descriptions[0], descriptions[rank], rank))  # type: ignore[arg-type]
