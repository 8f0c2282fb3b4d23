"""DataLoader.sharded: the data-parallel ranks' share of each epoch's (seed, epoch) order. Issue 14: "each rank
reads its slice of the (seed, epoch) order", so the ranks' batches of a step together are one global batch."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.train import DataLoader

X = np.arange(50, dtype=np.float32)[:, None]


@pytest.mark.parametrize("world", [2, 4])
def test_the_ranks_batches_make_the_global_batches_of_the_unsharded_order(world: int) -> None:
    loader = DataLoader((X,), 3, shuffle=True, seed=5, drop_last=True, prefetch=0)
    whole = DataLoader((X,), 3 * world, shuffle=True, seed=5, drop_last=True, prefetch=0)
    for epoch in (0, 1):
        ranks = [list(loader.sharded(r, world).batches(epoch)) for r in range(world)]
        assert all(len(batches) == len(whole) == 50 // (3 * world) for batches in ranks)
        for step, (big,) in enumerate(whole.batches(epoch)):
            np.testing.assert_array_equal(np.concatenate([ranks[r][step][0] for r in range(world)]), big)
    # a resumed rank starts where it was, in its own share
    shard = loader.sharded(1, 2)
    np.testing.assert_array_equal(next(shard.batches(1, 2))[0], list(shard.batches(1))[2][0])


def test_sharding_refuses_what_cannot_be_split_evenly() -> None:
    with pytest.raises(ValueError, match="drop_last=True"):
        DataLoader((X,), 3).sharded(0, 2)
    with pytest.raises(ValueError, match="rank 2 is outside a world of 2"):
        DataLoader((X,), 3, drop_last=True).sharded(2, 2)
