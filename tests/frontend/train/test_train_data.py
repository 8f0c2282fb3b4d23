"""Data loading (issue 14: "batching and seeded shuffling over numpy arrays and any iterable of batches, with a
`Dataset`/`DataLoader`-like protocol (indexable datasets, transforms, drop_last, background prefetch thread),
deterministic given a seed")."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kiln
from kiln.runtime.tvm.aligned import is_aligned
from kiln.train import ArrayDataset, DataLoader

X = np.arange(10, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)
Y = np.arange(10)


def firsts(batches) -> list[list[int]]:
    return [b[1].tolist() for b in batches]


def test_batches_in_order_with_a_short_last_one_or_dropped():
    assert firsts(DataLoader((X, Y), 4)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert firsts(DataLoader((X, Y), 4, drop_last=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(DataLoader((X, Y), 4)) == 3 and len(DataLoader((X, Y), 4, drop_last=True)) == 2
    first = next(iter(DataLoader((X, Y), 4)))
    np.testing.assert_array_equal(first[0], X[:4])


def test_shuffling_is_a_function_of_seed_and_epoch():
    loader = DataLoader((X, Y), 3, shuffle=True, seed=7)
    epoch0, epoch1 = firsts(loader.batches(0)), firsts(loader.batches(1))
    assert sorted(sum(epoch0, [])) == list(range(10)) and epoch0 != epoch1
    assert firsts(loader.batches(0)) == epoch0
    assert firsts(DataLoader((X, Y), 3, shuffle=True, seed=7).batches(1)) == epoch1  # another loader, same seed
    assert firsts(DataLoader((X, Y), 3, shuffle=True, seed=8).batches(0)) != epoch0
    assert firsts(loader.batches(1, start=2)) == epoch1[2:]  # a resumed epoch continues its order


class Squares:
    """An indexable dataset that is not arrays."""

    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return np.array([i, i * i], np.float32), np.array(i)


def test_a_dataset_with_a_transform_is_collated_per_field():
    loader = DataLoader(Squares(), 2, transform=lambda s: (s[0] * 10, s[1]), prefetch=0)
    batches = list(loader)
    assert [b[0].shape for b in batches] == [(2, 2), (2, 2), (1, 2)]
    np.testing.assert_array_equal(batches[1][0], [[20, 40], [30, 90]])


def test_gathered_batches_are_aligned_so_a_compiled_step_takes_them_without_a_copy():
    """Array and indexable datasets batch into 64-byte aligned arrays (`kiln.aligned`'s test) of numpy's values and
    dtypes; a field of strings is stacked as numpy stacks it."""
    x = np.random.default_rng(0).standard_normal((9, 3, 5)).astype(np.float32)
    for loader in (DataLoader((x, Y[:9]), 4, shuffle=True, seed=3, prefetch=0), DataLoader(Squares(), 2, prefetch=0)):
        for batch in loader:
            assert all(is_aligned(b) for b in batch), [b.ctypes.data % 64 for b in batch]
    order = DataLoader((x, Y[:9]), 4, shuffle=True, seed=3).order(0)[:4]
    first = next(iter(DataLoader((x, Y[:9]), 4, shuffle=True, seed=3)))
    np.testing.assert_array_equal(first[0], x[order])
    assert first[0].dtype == np.float32 and first[1].dtype == Y.dtype
    words = DataLoader((np.array(list("abcdef")), Y[:6]), 3)
    assert next(iter(words))[0].tolist() == ["a", "b", "c"]


def test_an_iterable_of_batches_is_taken_as_it_comes():
    batches = [(X[:3], Y[:3]), (X[3:], Y[3:])]
    loader = DataLoader(batches)
    assert firsts(loader) == [[0, 1, 2], list(range(3, 10))] and len(loader) == 2
    assert firsts(loader.batches(0, start=1)) == [list(range(3, 10))]
    with pytest.raises(ValueError, match="shuffle, transform and drop_last need a batch_size"):
        DataLoader(batches, shuffle=True)


def test_prefetch_runs_on_another_thread_and_reraises_there_errors():
    seen = []

    def record(sample):
        seen.append(threading.current_thread().name)
        return sample

    assert firsts(DataLoader((X, Y), 5, transform=record, prefetch=1)) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert set(seen) == {"kiln-prefetch"}

    def fail(sample):
        raise RuntimeError(f"bad sample {int(sample[1])}")

    with pytest.raises(RuntimeError, match="bad sample 0"):
        list(DataLoader((X, Y), 5, transform=fail))


def test_bad_arguments_are_named():
    with pytest.raises(kiln.ShapeError, match=r"differ in length: \[10, 9\]"):
        ArrayDataset(X, Y[:9])
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        DataLoader((X, Y), 0)
    with pytest.raises(ValueError, match="prefetch must be 0 or more, got -1"):
        DataLoader((X, Y), 2, prefetch=-1)
