"""Adam and AdamW: torch.optim.Adam / AdamW's single-tensor update (bias-corrected, no amsgrad)."""

from __future__ import annotations

import numpy as np

from kiln.ir import FunctionBuilder, TensorType, Value
from kiln.ir.gradients import emit

from .clipping import GradientClipping
from .optimizer import Optimizer, State, cast_like, scalar


class Adam(Optimizer):
    """m = m + (1 - b1)(g - m); v = b2 v + (1 - b2) g^2; p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t)
    + eps). `weight_decay` adds wd * p to the gradient (L2), as torch's Adam does. The step count t is state."""

    state_names = ("exp_avg", "exp_avg_sq", "step")
    decoupled = False

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 grad_clipping: GradientClipping | None = None):
        super().__init__(grad_clipping)
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay

    def init_state(self, t: TensorType) -> State:
        zeros = np.zeros(t.shape, t.dtype.numpy)  # type: ignore[arg-type]
        return {"exp_avg": zeros, "exp_avg_sq": zeros.copy(), "step": np.zeros((), t.dtype.numpy)}

    def update(self, fb: FunctionBuilder, param: Value, grad: Value, state: dict[str, Value], lr: Value
               ) -> tuple[Value, dict[str, Value]]:
        b1, b2 = self.betas
        step = emit(fb, "add", state["step"], scalar(fb, 1.0, state["step"]))
        if self.weight_decay and self.decoupled:  # scalar factors in f64, as torch's Python floats
            decay = emit(fb, "sub", scalar(fb, 1.0, lr), emit(fb, "mul", lr, scalar(fb, self.weight_decay, lr)))
            param = emit(fb, "mul", param, cast_like(fb, decay, param))
        elif self.weight_decay:
            grad = emit(fb, "add", grad, emit(fb, "mul", param, scalar(fb, self.weight_decay, param)))
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m = emit(fb, "add", m, emit(fb, "mul", emit(fb, "sub", grad, m), scalar(fb, 1 - b1, param)))
        v = emit(fb, "add", emit(fb, "mul", v, scalar(fb, b2, param)),
                 emit(fb, "mul", emit(fb, "mul", grad, scalar(fb, 1 - b2, param)), grad))
        t = cast_like(fb, step, lr)
        correction1 = emit(fb, "sub", scalar(fb, 1.0, lr), emit(fb, "pow", scalar(fb, b1, lr), t))
        correction2 = emit(fb, "sub", scalar(fb, 1.0, lr), emit(fb, "pow", scalar(fb, b2, lr), t))
        step_size = cast_like(fb, emit(fb, "div", lr, correction1), param)
        denom = emit(fb, "add", emit(fb, "div", emit(fb, "sqrt", v), cast_like(fb, emit(fb, "sqrt", correction2),
                                                                               param)),
                     scalar(fb, self.eps, param))
        new = emit(fb, "sub", param, emit(fb, "mul", step_size, emit(fb, "div", m, denom)))
        return new, {"exp_avg": m, "exp_avg_sq": v, "step": step}


class AdamW(Adam):
    """Adam with decoupled weight decay: p = p (1 - lr wd) before the Adam update (torch's default wd 0.01)."""

    decoupled = True

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 grad_clipping: GradientClipping | None = None):
        super().__init__(betas, eps, weight_decay, grad_clipping)
