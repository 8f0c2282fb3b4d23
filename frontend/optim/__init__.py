"""kiln.optim: optimizers whose update rules are IR, gradient clipping and learning-rate schedules."""

from .accumulation import GradientAccumulation
from .adam import Adam, AdamW
from .clipping import GradientClipping
from .optimizer import Optimizer
from .scheduler import ConstantLr, CosineAnnealingLr, LinearWarmupLr, LrScheduler
from .sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "ConstantLr", "CosineAnnealingLr", "GradientAccumulation", "GradientClipping",
           "LinearWarmupLr", "LrScheduler", "Optimizer"]
