"""Learning-rate schedules, evaluated on the host (the learning rate is a run-time input of a step): constant,
cosine annealing and linear warmup, with torch.optim.lr_scheduler's formulas."""

from __future__ import annotations

import math


class LrScheduler:
    """`lr_at(i)` is the learning rate of iteration i; `step()` returns the current one and advances (Burn's)."""

    def __init__(self) -> None:
        self.iteration = 0

    def lr_at(self, iteration: int) -> float:
        raise NotImplementedError

    def step(self) -> float:
        lr = self.lr_at(self.iteration)
        self.iteration += 1
        return lr


class ConstantLr(LrScheduler):
    def __init__(self, lr: float):
        super().__init__()
        self.lr = lr

    def lr_at(self, iteration: int) -> float:
        return self.lr


class CosineAnnealingLr(LrScheduler):
    """min_lr + (initial_lr - min_lr) (1 + cos(pi t / num_iters)) / 2, t capped at num_iters."""

    def __init__(self, initial_lr: float, num_iters: int, min_lr: float = 0.0):
        if num_iters <= 0:
            raise ValueError(f"num_iters must be positive, got {num_iters}")
        super().__init__()
        self.initial_lr, self.num_iters, self.min_lr = initial_lr, num_iters, min_lr

    def lr_at(self, iteration: int) -> float:
        t = min(iteration, self.num_iters)
        return self.min_lr + (self.initial_lr - self.min_lr) * (1 + math.cos(math.pi * t / self.num_iters)) / 2


class LinearWarmupLr(LrScheduler):
    """`after`'s first rate scaled linearly from start_factor to 1 over `warmup_iters`, then `after` from its
    start (torch's LinearLR followed by the schedule)."""

    def __init__(self, after: LrScheduler, warmup_iters: int, start_factor: float = 1.0 / 3):
        if warmup_iters <= 0:
            raise ValueError(f"warmup_iters must be positive, got {warmup_iters}")
        super().__init__()
        self.after, self.warmup_iters, self.start_factor = after, warmup_iters, start_factor

    def lr_at(self, iteration: int) -> float:
        if iteration >= self.warmup_iters:
            return self.after.lr_at(iteration - self.warmup_iters)
        factor = self.start_factor + (1 - self.start_factor) * iteration / self.warmup_iters
        return self.after.lr_at(0) * factor
