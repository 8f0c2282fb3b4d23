"""Batches for the Learner: indexable datasets (numpy arrays or anything with `__len__` and `__getitem__`) batched
with seeded shuffling, per-sample transforms and drop_last, or any re-iterable of ready batches; a background
thread prefetches. Epoch e's order is a function of (seed, e) alone, and a random transform's generator one of
(seed, e, sample index), so a run, or a resumed one that starts at a batch position, sees the same batches.
Batches the loader gathers are 64-byte aligned (`kiln.aligned`), so a compiled step takes them without a copy."""

from __future__ import annotations

import copy
import inspect
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np

from kiln.ir import ShapeError
from kiln.runtime.tvm.aligned import aligned_empty

Batch = tuple[np.ndarray, ...]
Sample = tuple[np.ndarray, ...]


class Dataset(Protocol):
    """What the DataLoader indexes: a length and one sample (a tuple of arrays) per index."""

    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Sample: ...


class ArrayDataset:
    """Samples i of equal-length arrays (features, targets...): `ArrayDataset(x, y)[i] == (x[i], y[i])`."""

    def __init__(self, *arrays: np.ndarray):
        if not arrays:
            raise ValueError("ArrayDataset needs at least one array")
        self.arrays = tuple(np.asarray(a) for a in arrays)
        lengths = [len(a) for a in self.arrays]
        if len(set(lengths)) != 1:
            raise ShapeError(f"ArrayDataset arrays differ in length: {lengths}")

    def __len__(self) -> int:
        return len(self.arrays[0])

    def __getitem__(self, index: int) -> Sample:
        return tuple(a[index] for a in self.arrays)

    def take(self, indices: np.ndarray) -> Batch:
        """The batch of these samples, gathered at once (into aligned arrays where the dtype is numeric)."""
        return tuple(np.take(a, indices, axis=0, out=_aligned_out((len(indices), *a.shape[1:]), a.dtype))
                     for a in self.arrays)


def _aligned_out(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
    """An aligned array to gather a batch into; None (numpy allocates) for dtypes that are not plain numbers."""
    return aligned_empty(shape, dtype) if dtype.kind in "biufc" else None


def _collate(samples: Sequence[Sample]) -> Batch:
    """Stack the samples field by field (into aligned arrays where the dtype is numeric)."""
    batch = []
    for field in zip(*samples):
        parts = [np.asarray(x) for x in field]
        batch.append(np.stack(parts, out=_aligned_out((len(parts), *parts[0].shape), np.result_type(*parts))))
    return tuple(batch)


class DataLoader:
    """With a `batch_size`, `data` is a Dataset (a tuple of arrays is an ArrayDataset) cut into batches, in a fresh
    seeded order each epoch when `shuffle`, each sample mapped by `transform`; without one, `data` is a re-iterable
    of batches taken as they come. A transform with an `rng` parameter is random: it gets `rng=`, a numpy Generator
    seeded by (seed, epoch, sample index), so its draws repeat exactly in any run and on resume. `prefetch`
    batches are made ahead on a background thread (0: none)."""

    rank, world = 0, 1  # a data-parallel rank's share of each global batch (`sharded`)

    def __init__(self, data: Dataset | tuple[np.ndarray, ...] | Iterable[Batch], batch_size: int | None = None, *,
                 shuffle: bool = False, seed: int = 0, drop_last: bool = False,
                 transform: Callable[..., Sample] | None = None, prefetch: int = 2):
        self.indexed = batch_size is not None
        if self.indexed and isinstance(data, tuple) and all(isinstance(a, np.ndarray) for a in data):
            data = ArrayDataset(*data)
        if self.indexed and batch_size < 1:  # type: ignore[operator]
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not self.indexed and (shuffle or transform is not None or drop_last):
            raise ValueError("without a batch_size, data is an iterable of batches taken as they come: shuffle, "
                             "transform and drop_last need a batch_size")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {prefetch}")
        self.data, self.batch_size, self.shuffle, self.seed = data, batch_size, shuffle, seed
        self.drop_last, self.transform, self.prefetch = drop_last, transform, prefetch
        self.random_transform = transform is not None and "rng" in inspect.signature(transform).parameters

    def __len__(self) -> int:
        """Batches per epoch (an iterable of batches without a length raises TypeError)."""
        if not self.indexed:
            return len(self.data)  # type: ignore[arg-type]
        n, size = len(self.data), self.batch_size * self.world  # type: ignore[arg-type, operator]
        return n // size if self.drop_last else -(-n // size)

    def order(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`: the same for the same (seed, epoch) in any process; a sharded loader's is
        its rank's slice of every global batch of `world` batches."""
        n = len(self.data)  # type: ignore[arg-type]
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if self.world == 1:
            return order
        steps, size = len(self), self.batch_size
        return order[:steps * size * self.world].reshape(steps, self.world, size)[:, self.rank].ravel()  # type: ignore[operator, arg-type]

    def sharded(self, rank: int, world: int) -> DataLoader:
        """This loader as rank `rank` of `world` reads it: batch b is the rank-th of the `world` consecutive batches
        making global batch b, so the ranks' batches together are the unsharded loader's `world * batch_size`."""
        if not self.indexed or not self.drop_last:
            raise ValueError("a sharded DataLoader needs a batch_size and drop_last=True, so every rank's batch of "
                             "every step is full (the averaged gradient is then the global batch's)")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of {world}")
        shard = copy.copy(self)
        shard.rank, shard.world = rank, world
        return shard

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator[Batch]:
        """Epoch `epoch`'s batches from batch number `start` on (a resumed run skips what it has seen)."""
        source = self._indexed(epoch, start) if self.indexed else self._iterated(start)
        return _prefetched(source, self.prefetch) if self.prefetch else source

    def __iter__(self) -> Iterator[Batch]:
        return self.batches()

    def _indexed(self, epoch: int, start: int) -> Iterator[Batch]:
        order, size, data = self.order(epoch), self.batch_size, self.data
        for b in range(start, len(self)):
            indices = order[b * size:(b + 1) * size]  # type: ignore[operator]
            if self.transform is None and isinstance(data, ArrayDataset):
                yield data.take(indices)
            else:
                yield _collate([self._sample(int(i), epoch) for i in indices])

    def _sample(self, index: int, epoch: int) -> Sample:
        """Sample `index`, transformed; a random transform draws from the generator of (seed, epoch, index)."""
        sample = self.data[index]  # type: ignore[index]
        if self.transform is None:
            return sample
        if self.random_transform:
            return self.transform(sample, rng=np.random.default_rng([self.seed, epoch, index]))
        return self.transform(sample)

    def _iterated(self, start: int) -> Iterator[Batch]:
        for b, batch in enumerate(self.data):  # type: ignore[arg-type]
            if b >= start:
                yield tuple(np.asarray(a) for a in batch)


_DONE = object()


def _prefetched(source: Iterator[Batch], depth: int) -> Iterator[Batch]:
    """`source` run on a daemon thread `depth` batches ahead; its exceptions re-raise here, in order."""
    items: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple[object, BaseException | None]) -> bool:
        """Queue `item` unless the consumer has left; whether it was queued."""
        while not stop.is_set():
            try:
                items.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for batch in source:
                if not put((batch, None)):
                    return
            put((_DONE, None))
        except BaseException as error:  # handed to the consumer
            put((_DONE, error))

    thread = threading.Thread(target=produce, name="kiln-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            batch, error = items.get()
            if error is not None:
                raise error
            if batch is _DONE:
                return
            yield batch
    finally:
        stop.set()
