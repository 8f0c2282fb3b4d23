"""Parameter data in the structural hash (the compile cache's key for bound builds): read in place, by content,
and digested once per read-only array (a record's views), so a large model is not copied or rehashed per build."""

from __future__ import annotations

import hashlib
import tracemalloc

import numpy as np

from kiln.ir import Builder
from kiln.ir.hashing import data_digest, structural_hash


def graph_with(w: np.ndarray):
    b = Builder("M")
    x = b.input("x", ((None, w.shape[0]), "f32"))
    b.ret(b.matmul(x, b.param("w", w.shape, data=w)))
    return b.build()


def test_the_digest_is_sha256_of_the_bytes_and_ignores_how_they_are_laid_out():
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert data_digest(w) == hashlib.sha256(w.tobytes()).digest()[:20]  # hashlib is the oracle
    assert data_digest(np.asfortranarray(w)) == data_digest(w) and data_digest(w.T) != data_digest(w)
    assert data_digest(np.zeros((0, 3), np.float32)) == hashlib.sha256(b"").digest()[:20]


def test_bound_keys_follow_content_not_identity():
    w = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    assert structural_hash(graph_with(w), include_data=True) == structural_hash(graph_with(w.copy()), True)
    changed = w.copy()
    changed[0, 0] += 1
    assert structural_hash(graph_with(changed), include_data=True) != structural_hash(graph_with(w), True)


def test_a_read_only_array_is_digested_once_and_a_writable_one_sees_edits():
    frozen = np.ones(1 << 16, np.float32)
    frozen.flags.writeable = False
    first = data_digest(frozen)
    tracemalloc.start()
    again = data_digest(frozen)
    calls, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert again == first and peak < frozen.nbytes // 4  # neither copied nor rehashed
    live = np.ones(8, np.float32)
    before = data_digest(live)
    live[3] = 2.0
    assert data_digest(live) != before
