"""SGD with momentum, Nesterov momentum and L2 weight decay: torch.optim.SGD's update (no dampening)."""

from __future__ import annotations

from kiln.ir import FunctionBuilder, Value
from kiln.ir.gradients import emit

from .clipping import GradientClipping
from .optimizer import Optimizer, cast_like, scalar


class SGD(Optimizer):
    """d = g + wd * p; with momentum b = momentum * b + d (b = d on the first step), d = b, or d + momentum * b
    with Nesterov; p = p - lr * d."""

    def __init__(self, momentum: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
                 grad_clipping: GradientClipping | None = None):
        if nesterov and momentum <= 0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        super().__init__(grad_clipping)
        self.momentum, self.nesterov, self.weight_decay = momentum, nesterov, weight_decay
        self.state_names = ("momentum_buffer",) if momentum else ()

    def update(self, fb: FunctionBuilder, param: Value, grad: Value, state: dict[str, Value], lr: Value
               ) -> tuple[Value, dict[str, Value]]:
        d = grad
        if self.weight_decay:
            d = emit(fb, "add", d, emit(fb, "mul", param, scalar(fb, self.weight_decay, param)))
        new_state = {}
        if self.momentum:
            m = scalar(fb, self.momentum, param)
            buf = emit(fb, "add", emit(fb, "mul", state["momentum_buffer"], m), d)  # zeros at first: b = d exactly
            new_state["momentum_buffer"] = buf
            d = emit(fb, "add", d, emit(fb, "mul", buf, m)) if self.nesterov else buf
        return emit(fb, "sub", param, emit(fb, "mul", d, cast_like(fb, lr, param))), new_state
