"""`kiln.grad(t, grads)`: one parameter's gradient out of what `backward` returned (Burn's `tensor.grad(&grads)`)."""

from __future__ import annotations

import numpy as np

from kiln.ir import KilnError, ParamId

from .device import Device
from .gradients import Gradients
from .param import Param
from .tensor import Tensor, leaf


def grad(value: Tensor | Param, grads: Gradients) -> Tensor:
    """The gradient of `value` (a Param, or the tensor its `val()` read) in `grads`, found by ParamId: a tensor on
    the same device without autodiff, as Burn returns it on the inner backend."""
    if isinstance(value, Param):
        pid, device = value.id, value.device
    elif isinstance(value, Tensor):
        pid, device = value.node.param_id, value.device
        if pid is None:
            raise KilnError(f"grad: {value!r} is the result of a {value.node.kind!r} op, not a parameter's value; "
                            f"gradients are kept for parameters only")
    else:
        raise TypeError(f"grad: expected a Tensor or a Param, got {type(value).__name__}")
    if pid not in grads:
        raise KilnError(f"grad: no gradient for parameter {ParamId(pid)} in {grads!r}: it requires no gradient "
                        f"(frozen, or not on an autodiff device) or the loss does not use it")
    return leaf(np.array(grads[pid]), Device(device.name))
