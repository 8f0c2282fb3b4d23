"""Loss functions (mean reduction), with torch's formulas so values and gradients match `torch.nn.functional`."""

from __future__ import annotations

import numpy as np

from kiln.frontend.tensor import Tensor, apply

from . import functional as F


def _const(value: float | int, like: Tensor) -> np.ndarray:
    return np.asarray(value, like.dtype.numpy)


def cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0, ignore_index: int | None = None
                  ) -> Tensor:
    """Mean negative log-likelihood of integer class `targets` [N] under softmax(`logits` [N, C]).

    With label smoothing e the target distribution puts 1 - e + e/C on the class and e/C elsewhere; targets equal
    to `ignore_index` count for nothing, and the mean is over the others.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing {label_smoothing} is outside [0, 1]")
    logp = F.log_softmax(logits, axis=-1)
    index = targets
    if ignore_index is not None:
        ignored = apply("equal", targets, _const(ignore_index, targets))
        index = apply("where", ignored, _const(0, targets), targets)
    picked = apply("gather", logp, apply("reshape", index, shape=(-1, 1)), axis=1)
    loss = -apply("reshape", picked, shape=(-1,))
    if label_smoothing:
        smooth = -apply("mean", logp, axes=(1,))
        loss = loss * (1.0 - label_smoothing) + smooth * label_smoothing
    if ignore_index is None:
        return apply("mean", loss)
    weight = apply("where", ignored, _const(0.0, logits), _const(1.0, logits))
    return apply("sum", loss * weight) / apply("sum", weight)


def mse_loss(prediction: Tensor, target: Tensor) -> Tensor:
    """Mean squared error."""
    diff = prediction - target
    return apply("mean", diff * diff)


def bce_with_logits(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean binary cross-entropy of sigmoid(`logits`) against `targets` in [0, 1], in the stable form
    max(x, 0) - x * y + log(1 + exp(-|x|))."""
    softplus = apply("log", 1.0 + apply("exp", -apply("abs", logits)))
    return apply("mean", apply("relu", logits) - logits * targets + softplus)
