"""Adam's update as one kernel: `fuse_output_producers` merges the returned moments into the weight update's group,
and `CPUInjective` nests the group's outputs in one loop. The oracle for the values is torch.optim.Adam."""

from __future__ import annotations

import numpy as np
import torch
import tvm
from tvm.s_tir import dlight as dl

from kiln.frontend.optim.adam import Adam
from kiln.frontend.optim.optimizer import lr_type
from kiln.ir import DType, FunctionBuilder, Graph, TensorType
from kiln.runtime.tvm.compile import compile_graph, lowering_input
from kiln.runtime.tvm.lower import lower
from kiln.runtime.tvm.pipeline import cpu_fusion_passes
from kiln.runtime.tvm.schedules import default_cpu_rules
from kiln.runtime.tvm.target import cpu_target

SHAPE = (64, 48)


def adam_graph() -> Graph:
    """One parameter's Adam step as the optimizer emits it: (new weight, exp_avg, exp_avg_sq, step)."""
    opt, fb = Adam(), FunctionBuilder("step", lambda name: None)
    t = TensorType(SHAPE, DType.f32)
    param, grad = fb.input("param", t), fb.input("grad", t)
    state = {n: fb.input(f"state.{n}", TensorType(a.shape, DType.from_numpy(a.dtype)))
             for n, a in opt.init_state(t).items()}
    [(new, new_state)] = opt.emit_step(fb, [param], [grad], [state], fb.input("lr", lr_type()))
    return Graph("adam", functions={"step": fb.finish([new, *new_state.values()])})


def fused_module() -> tvm.IRModule:
    target = cpu_target()
    with target:
        mod = tvm.transform.Sequential(cpu_fusion_passes(target))(lower(lowering_input(adam_graph()), "inputs").module)
        return mod, dl.ApplyDefaultSchedule(*default_cpu_rules(target))(mod)


def test_adam_updates_weight_and_moments_in_one_kernel() -> None:
    """Relax's FuseOps keeps a returned value out of its consumer's group (the output tuple post-dominates it):
    without the pass the moments and the weight update were three kernels over the parameter's shape."""
    mod, scheduled = fused_module()
    calls = [line for line in str(mod["step"]).splitlines() if "R.call_tir(" in line]
    wide = [line for line in calls if "(64, 48)" in line.partition("out_ty=")[2]]
    assert len(wide) == 1, calls
    kernel, outputs = wide[0].split("R.call_tir(")[1].split(",")[0], wide[0].partition("out_ty=")[2]
    assert outputs.count('R.Tensor((64, 48), dtype="float32")') == 3, outputs
    # scheduled, every output in one vectorized loop: one pass over the weight, gradient and moments
    body = str(scheduled[kernel])
    assert body.count(" in ") == 2 and body.count("T.vectorized(") == 1, body


def test_fused_adam_is_torch_adam() -> None:
    """torch.optim.Adam (lr 1e-3, betas (0.9, 0.999), eps 1e-8), three steps, fed the same gradients."""
    exe = compile_graph(adam_graph(), params="inputs", functions=("step",))
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(SHAPE).astype(np.float32)
    grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
    ours = [p0, np.zeros(SHAPE, np.float32), np.zeros(SHAPE, np.float32), np.zeros((), np.float32)]
    for g in grads:
        new, m, v, step = exe.run(ours[0], g, *ours[1:], np.float64(1e-3), function="step")
        ours = [new, m, v, step]
    weight = torch.tensor(p0, requires_grad=True)
    adam = torch.optim.Adam([weight], lr=1e-3)
    for g in grads:
        weight.grad = torch.tensor(g)
        adam.step()
    theirs = adam.state[weight]
    np.testing.assert_allclose(ours[0], weight.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours[1], theirs["exp_avg"].numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ours[2], theirs["exp_avg_sq"].numpy(), rtol=1e-5, atol=1e-9)
    assert float(ours[3]) == 3.0
