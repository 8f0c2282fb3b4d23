"""A small training run for the checkpoint tests, run as its own process so a test can SIGKILL it:

    python train_script.py CHECKPOINTS LOG [--resume] [--die-in-save N]

It trains a dropout MLP for 3 epochs of 7 batches, checkpointing every 2 steps; each sample's transform sleeps a
little so a watcher can kill it mid-epoch. `--die-in-save N` SIGKILLs the process inside its N-th checkpoint write,
after the model record is on disk and before the folder is complete."""

from __future__ import annotations

import argparse
import os
import signal
import time

import numpy as np

import kiln
from kiln import nn, optim
from kiln.train import Checkpointing, DataLoader, Learner
from kiln.train import checkpoint as checkpoint_module

EPOCHS, BATCH, SAMPLES = 3, 16, 104  # 7 batches an epoch, the last one short


class MLP(kiln.Module):
    def __init__(self) -> None:
        device = kiln.Device("cpu").autodiff()
        self.fc1, self.drop, self.fc2 = nn.Linear(6, 12, device=device), nn.Dropout(0.3), nn.Linear(12, 3,
                                                                                                     device=device)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc2(self.drop(self.fc1(x).relu()))


def loss_fn(model: MLP, x: kiln.Tensor, y: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
    logits = model(x)
    return nn.cross_entropy(logits, y), logits


def slow(sample: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    time.sleep(0.002)
    return sample


def learner(checkpoints: str, log: str) -> Learner:
    kiln.seed(11)
    schedule = optim.LinearWarmupLr(optim.CosineAnnealingLr(0.05, 30), 4)
    return Learner(MLP(), optim.AdamW(), loss_fn, schedule, accumulation=1, log=log,
                   checkpointing=Checkpointing(checkpoints, every_steps=2, keep=2), seed=5)


def data() -> DataLoader:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 6)).astype(np.float32)
    return DataLoader((x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0)), BATCH, shuffle=True, seed=2,
                      transform=slow)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoints")
    parser.add_argument("log")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--die-in-save", type=int, default=0)
    args = parser.parse_args()
    if args.die_in_save:
        saves, save_file = [0], kiln.ModuleRecord.save

        def dying_save(record: kiln.ModuleRecord, path: str) -> None:
            save_file(record, path)
            if os.path.basename(path) == "model.bpk":
                saves[0] += 1
                if saves[0] == args.die_in_save:
                    os.kill(os.getpid(), signal.SIGKILL)

        kiln.ModuleRecord.save = dying_save  # type: ignore[method-assign]
    run = learner(args.checkpoints, args.log)
    run.fit(data(), epochs=EPOCHS, resume=args.checkpoints if args.resume else None)
    assert checkpoint_module.checkpoints(args.checkpoints), "the run wrote no checkpoint"


if __name__ == "__main__":
    main()
