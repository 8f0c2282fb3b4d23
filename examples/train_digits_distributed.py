"""examples/train_digits.py's MLP trained data-parallel on torch.distributed (gloo): each rank reads its slice of
every shuffled global batch of 64, the data-parallel pass averages the gradients across the ranks, rank 0 writes
the checkpoints, logs and reports the test accuracy.

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 examples/train_digits_distributed.py [--epochs 30]
        [--checkpoints DIR]          (torchrun, where torch installed its script)

Under `torchrun --max-restarts 1` a killed worker restarts the group, and every rank resumes from the newest
checkpoint in DIR. Needs `pip install 'kiln[distributed]'`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from threadpoolctl import threadpool_limits

import kiln
from kiln import optim
from kiln.passes.data_parallel import DataParallel
from kiln.runtime.distributed import TorchEngine
from kiln.train import Checkpointing, DataLoader, Learner
from kiln.train import checkpoint as checkpoints

sys.path.insert(0, str(Path(__file__).parent))
from train_digits import BATCH, MLP, digits, loss_and_logits  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--checkpoints", help="checkpoint folder (every 50 steps; resumed from when it holds one)")
    args = parser.parse_args(argv)
    engine = TorchEngine()
    x_train, y_train, x_test, y_test = digits()
    train_data = DataLoader((x_train, y_train), BATCH // engine.world_size, shuffle=True, seed=0, drop_last=True)
    steps = len(x_train) // BATCH  # optimizer steps an epoch: one per global batch
    schedule = optim.LinearWarmupLr(optim.CosineAnnealingLr(3e-3, max(1, (args.epochs - 1) * steps)), steps)
    rule = Checkpointing(args.checkpoints, every_steps=50) if args.checkpoints else None
    kiln.seed(0)  # the same ParamIds, so the same initial weights, on every rank (checked at start)
    learner = Learner(MLP(), optim.AdamW(weight_decay=1e-4), loss_and_logits, schedule, checkpointing=rule,
                      data_parallel=DataParallel(), engine=engine)
    resume = args.checkpoints if args.checkpoints and checkpoints.checkpoints(args.checkpoints) else None
    start = time.perf_counter()
    with threadpool_limits(limits=1, user_api="blas"):
        learner.fit(train_data, epochs=args.epochs, resume=resume)
    if engine.rank == 0:
        accuracy = learner.evaluate(DataLoader((x_test, y_test), len(x_test)))["accuracy"]
        print(f"MLP on {engine.world_size} ranks: test accuracy {accuracy:.2%}, trained in "
              f"{time.perf_counter() - start:.1f}s")
    engine.dist.destroy_process_group()


if __name__ == "__main__":
    main()
