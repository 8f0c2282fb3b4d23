"""Gradient accumulation as an update rule: the gradients of `steps` micro-batches are summed in optimizer state
and the wrapped optimizer updates once, with their mean, on every `steps`-th call. Equal-sized micro-batches under
a mean loss thus take the step one big batch would; a captured step stays one IR function (no host-side branch)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.ir import FunctionBuilder, TensorType, Value
from kiln.ir.gradients import emit

from .optimizer import Optimizer, State, scalar


class GradientAccumulation(Optimizer):
    """`inner`'s update applied every `steps` calls to the mean of the gradients since the last one; between, the
    parameters and `inner`'s state are unchanged. State: `inner`'s, plus `grad_sum` and `micro_step`."""

    def __init__(self, inner: Optimizer, steps: int):
        if steps < 1:
            raise ValueError(f"gradient accumulation steps must be at least 1, got {steps}")
        super().__init__()
        self.inner, self.steps = inner, steps
        self.state_names = (*inner.state_names, "grad_sum", "micro_step")

    def init_state(self, t: TensorType) -> State:
        return {**self.inner.init_state(t), "grad_sum": np.zeros(t.shape, t.dtype.numpy),  # type: ignore[arg-type]
                "micro_step": np.zeros((), t.dtype.numpy)}

    def emit_step(self, fb: FunctionBuilder, params: Sequence[Value], grads: Sequence[Value],
                  states: Sequence[dict[str, Value]], lr: Value, clipped: bool = False
                  ) -> list[tuple[Value, dict[str, Value]]]:
        """Sum, then `inner`'s whole step (its clipping included) on the mean, kept only on the last micro-step."""
        counts = [emit(fb, "add", s["micro_step"], scalar(fb, 1.0, s["micro_step"])) for s in states]
        sums = [emit(fb, "add", s["grad_sum"], g) for s, g in zip(states, grads)]
        means = [emit(fb, "div", total, scalar(fb, float(self.steps), total)) for total in sums]
        inner_states = [{n: s[n] for n in self.inner.state_names} for s in states]
        updates = self.inner.emit_step(fb, params, means, inner_states, lr, clipped)
        out = []
        for param, state, count, total, (new, new_state) in zip(params, states, counts, sums, updates):
            last = emit(fb, "equal", count, scalar(fb, float(self.steps), count))

            def keep(updated: Value, old: Value, last: Value = last) -> Value:
                return emit(fb, "where", last, updated, old)

            kept = {n: keep(v, state[n]) for n, v in new_state.items()}
            kept["grad_sum"] = keep(scalar(fb, 0.0, total), total)
            kept["micro_step"] = keep(scalar(fb, 0.0, count), count)
            out.append((keep(new, param), kept))
        return out
