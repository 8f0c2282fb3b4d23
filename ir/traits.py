"""Op traits: the properties an op kind declares once in the registry, which passes and backends query.

Each consumer reads a trait instead of keeping its own list of op kinds: cse (`STOCHASTIC`, `COMMUTATIVE`),
checkpoint (`MEMORY_BOUND`), and the Relax and ONNX lowerings (`EXACT`). Some traits imply others (`IMPLIES`);
an `OpDef`'s traits are closed under them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Trait(enum.StrEnum):
    """One property of an op kind.

    ELEMENTWISE    each result element depends only on the operand elements at its (broadcast) position:
                   unary math and activations, binary arithmetic and comparisons, `where`, `cast`, `dropout`.
    DATA_MOVEMENT  copies, rearranges or selects elements by position or index without computing on them:
                   transpose, reshape, broadcast_to, concat, slice, and `take` and `gather` (an index picks which
                   element is copied; the index is data, the element is never computed on). `where` selects too,
                   but element by element, so it is ELEMENTWISE and EXACT rather than data movement.
    SOURCE         makes its result from its attributes alone (constant, zeros, ones, full).
    EXACT          computes no rounded arithmetic on its floating operands (it moves, selects, converts or makes
                   them), so it is exact in any dtype: backends run it in its operands' own dtype instead of
                   widening f16 and bf16 to `DType.compute`. Data movement and sources are exact; so are `where`
                   and `cast`.
    MEMORY_BOUND   does O(1) work per element it writes and reads no more than it writes (plus indices), so it is
                   cheaper to recompute than to keep alive: checkpoint's balanced strategy recomputes it.
                   Elementwise ops, data movement (a `take` or `gather` reads one element per element written)
                   and sources are memory-bound; reductions, softmax, norms, matmuls, convolutions and pooling
                   are not.
    STOCHASTIC     draws random numbers: two ops with equal operands and attributes may differ, so cse never
                   merges them and constant folding never evaluates them (dropout).
    COLLECTIVE     communicates with the other ranks of a process group, which must make the same calls in the
                   same order: cse never merges two, constant folding never evaluates one (its value depends on
                   the other ranks), and the data-parallel pass places them (all_reduce).
    COMMUTATIVE    two operands that give the same result, bit for bit, in either order, so cse merges
                   `add(a, b)` with `add(b, a)`: add, mul, equal. maximum and minimum are not: numpy's and torch's
                   maximum(-0.0, 0.0) is -0.0 but maximum(0.0, -0.0) is 0.0.
    """

    ELEMENTWISE = "elementwise"
    DATA_MOVEMENT = "data_movement"
    SOURCE = "source"
    EXACT = "exact"
    MEMORY_BOUND = "memory_bound"
    STOCHASTIC = "stochastic"
    COMMUTATIVE = "commutative"
    COLLECTIVE = "collective"


IMPLIES: dict[Trait, frozenset[Trait]] = {
    Trait.ELEMENTWISE: frozenset({Trait.MEMORY_BOUND}),
    Trait.DATA_MOVEMENT: frozenset({Trait.EXACT, Trait.MEMORY_BOUND}),
    Trait.SOURCE: frozenset({Trait.EXACT, Trait.MEMORY_BOUND}),
}


def closure(traits: Iterable[Trait]) -> frozenset[Trait]:
    """`traits` with every trait they imply (IMPLIES is one level deep: implied traits imply nothing)."""
    given = frozenset(traits)
    return given.union(*(IMPLIES.get(t, frozenset()) for t in given))
