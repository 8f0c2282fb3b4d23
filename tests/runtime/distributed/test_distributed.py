"""Data-parallel training over torch.distributed (gloo, 127.0.0.1 only), each rank its own process of one thread,
every process under a hard timeout. The default suite runs the 2-rank checks; the 4-rank checks, the 2-rank TVM run
and the kill-a-worker test under torchrun need `KILN_DISTRIBUTED_TESTS=1` (they take minutes on a loaded 2-core
machine).

Issue 14: "The all-reduced gradients equal the single-process gradients of the concatenated batch (within 1e-6
relative)", "ZeRO-1 gives the same parameters as plain data parallel", "Ranks that disagree on the model ... fail at
start with one clear error naming the first difference", "kill one of two workers, check the step counter, the data
positions and the final parameters against an uninterrupted run". The oracle is torch on the concatenated batch.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("worker.py")
sys.path.insert(0, str(WORKER.parent))
import worker  # noqa: E402  (the ranks' script: its model and batch are the oracle's too)

SLOW = pytest.mark.skipif(os.environ.get("KILN_DISTRIBUTED_TESTS") != "1",
                          reason="4-rank and fault tests: set KILN_DISTRIBUTED_TESTS=1")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "TVM_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *args: str, timeout: float = 240) -> None:
    """`world` ranks of worker.py, as torchrun would start them, each killed past `timeout` seconds."""
    env = {**os.environ, **ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), *args], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{out[-3000:]}"


def torchrun(*args: str, restarts: int = 0, timeout: float = 400) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", str(restarts),
           str(WORKER), *args]
    proc = subprocess.run(cmd, env={**os.environ, **ONE_THREAD}, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def torch_mlp(init: dict[str, np.ndarray]) -> tuple[list[torch.Tensor], object]:
    """worker.MLP in torch (kiln's Linear stores its weight [in, out]) and its MSE loss."""
    ps = [torch.tensor(init[k], dtype=torch.float64, requires_grad=True)
          for k in PARAMS]

    def loss(x: np.ndarray, y: np.ndarray) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.from_numpy(x).double() @ ps[0] + ps[1])
        return ((h @ ps[2] + ps[3] - torch.from_numpy(y).double()) ** 2).mean()
    return ps, loss


def torch_adam(init: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, steps: int,
               clip: float | None = None) -> dict[str, np.ndarray]:
    """The parameters after `steps` torch Adam steps (lr 0.05) on the whole batch, shifted by k at step k as the
    worker's steps are, the gradients clipped to global norm `clip` if given."""
    ps, loss = torch_mlp(init)
    adam = torch.optim.Adam(ps, lr=0.05)
    for k in range(steps):
        adam.zero_grad()
        loss(x + k, y + k).backward()
        if clip is not None:
            assert float(torch.nn.utils.clip_grad_norm_(ps, clip)) > clip  # the clipping is live
        adam.step()
    return {name: p.detach().numpy() for name, p in zip(PARAMS, ps)}


def relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def check_ranks(tmp_path: Path, world: int) -> None:
    launch(world, "checks", str(tmp_path))
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]
    init = {k.removeprefix("init."): v for k, v in ranks[0].items() if k.startswith("init.")}
    x, y = worker.global_batch(world)
    # the averaged gradients are the concatenated batch's, on every rank
    ps, loss = torch_mlp(init)
    loss(x, y).backward()
    for i, p in enumerate(ps):
        for r in range(world):
            assert relative(ranks[r][f"grad{i}"], p.grad.numpy()) <= 1e-6, (i, r)
    # overlap: each bucket started where it closes and waited on at the end gives the one-op all_reduce's gradients
    for i in range(len(ps)):
        for rank in ranks:
            np.testing.assert_array_equal(rank[f"grad{i}"], rank[f"sync.grad{i}"])
    # the gradients crossed into torch without a copy
    assert all(bool(rank["same_pointer"]) for rank in ranks)
    # three data-parallel Adam steps are torch's on the concatenated batches; ZeRO-1 gives the same parameters bit
    # for bit, keeping each parameter's optimizer state on one rank only
    for name, p in torch_adam(init, x, y, 3).items():
        for rank in ranks:
            np.testing.assert_allclose(rank[f"zero0.{name}"], p, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(rank[f"zero1.{name}"], rank[f"zero0.{name}"])
    # gradient clipping under ZeRO-1: the global norm from every averaged gradient (each rank holds them all after
    # the all-reduce), so the result is plain data parallel's bit for bit, and torch's clip_grad_norm_ + Adam
    for name, p in torch_adam(init, x, y, 3, clip=worker.CLIP).items():
        for rank in ranks:
            np.testing.assert_allclose(rank[f"clip0.{name}"], p, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(rank[f"clip1.{name}"], rank[f"clip0.{name}"])
    bad_src = f"broadcast: source rank {world} is outside the group of {world} ranks"
    assert [str(rank["bad_src"]) for rank in ranks] == [bad_src] * world
    unstarted = "all_reduce_wait: bucket 99 of group 'world' was never started"
    assert [str(rank["unstarted"]) for rank in ranks] == [unstarted] * world
    full, shards = int(ranks[0]["zero0.state_arrays"]), [int(rank["zero1.state_arrays"]) for rank in ranks]
    assert sum(shards) == full and max(shards) < full
    # Issue 14: "bucketed so communication overlaps the remaining backward where the runtime allows". The first
    # bucket closes early (the small head); started there, it has the rest of the backward (the window, measured
    # with no delay) to run in. Its all_reduce then takes that window longer (a slow network): overlapped,
    # forward_backward hides much of the delay that the one-op all_reduce adds; the gradients are the same bit for bit
    for r, rank in enumerate(ranks):
        for i in range(8):
            np.testing.assert_array_equal(rank[f"slow.overlap.grad{i}"], rank[f"slow.sync.grad{i}"])
        # the first bucket starts where the backward has most of its work still to do, not where it is waited on
        assert float(rank["slow.window"]) >= 0.4 * float(rank["slow.base.time"]), r
        sync, overlapped, delay = (float(rank[f"slow.{k}"]) for k in ("sync.time", "overlap.time", "delay"))
        # a wall-time bound: only where the host is the test's alone (KILN_DISTRIBUTED_TESTS=1) and the ranks fit
        # the cores (more one-thread ranks leave none to overlap on)
        if os.environ.get("KILN_DISTRIBUTED_TESTS") == "1" and world <= (os.cpu_count() or 1):
            assert sync - overlapped >= 0.5 * delay, (r, sync, overlapped, delay)
    # Issue 14: "fit(resume=dir) continues exactly" under ZeRO-1 (with clipping): rank 0's checkpoint holds every
    # rank's share of the optimizer state (AdamW: 3 arrays x 4 parameters); a Learner resumed from the step-6
    # checkpoint re-shards it and ends with the uninterrupted run's parameters bit for bit
    for rank in ranks:
        assert int(rank["resume.saved_arrays"]) == 12 and int(rank["resume.rank_arrays"]) < 12
        for name in PARAMS:
            np.testing.assert_array_equal(rank[f"resume.resumed.{name}"], rank[f"resume.whole.{name}"])
    # Issue 14: "batch-norm statistics synced across ranks" (torch's SyncBatchNorm): with sync-batch-norm every rank
    # normalizes with the global batch's statistics, so its output is its slice of torch's on the concatenated batch,
    # the averaged gradients and the new running statistics are torch's (F.batch_norm, training, momentum 0.1)
    bn = {k.removeprefix("bn.init."): torch.tensor(v, dtype=torch.float64, requires_grad=True)
          for k, v in ranks[0].items() if k.startswith("bn.init.")}
    running_mean, running_var = bn.pop("bn.running_mean").detach(), bn.pop("bn.running_var").detach()
    h = (torch.from_numpy(x).double() @ bn["fc.weight"] + bn["fc.bias"]).reshape(-1, 3, 2)
    out = torch.nn.functional.batch_norm(h, running_mean, running_var, bn["bn.gamma"], bn["bn.beta"], training=True,
                                         momentum=0.1, eps=1e-5)
    ((out - torch.from_numpy(ranks[0]["bn.target"]).double()) ** 2).mean().backward()
    for r, rank in enumerate(ranks):
        mine = slice(r * worker.BATCH, (r + 1) * worker.BATCH)
        np.testing.assert_allclose(rank["bn.out"], out.detach().numpy()[mine], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(rank["bn.running_mean"], running_mean.numpy(), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(rank["bn.running_var"], running_var.numpy(), rtol=1e-6, atol=1e-7)
        for name, p in bn.items():
            assert relative(rank[f"bn.grad.{name}"], p.grad.numpy()) <= 1e-6, (name, r)
    # the last rank's hidden layer is one wider: every rank fails with the same one-line error naming it
    want = (f"the ranks hold different models: parameter fc1.weight: rank 0 has shape [5, 7], rank {world - 1} has "
            "[5, 8]")
    assert [str(rank["disagreement"]) for rank in ranks] == [want] * world


def test_two_ranks_average_gradients_shard_the_update_and_refuse_another_model(tmp_path: Path) -> None:
    check_ranks(tmp_path, 2)


@SLOW
def test_four_ranks(tmp_path: Path) -> None:
    check_ranks(tmp_path, 4)


@SLOW
@pytest.mark.parametrize("zero", ["0", "1"])
def test_a_killed_worker_restarts_the_group_and_resumes_with_no_step_lost_or_repeated(tmp_path: Path,
                                                                                     zero: str) -> None:
    """zero=1: ZeRO-1 with gradient clipping, its checkpoints holding every rank's optimizer shard."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "killed").mkdir()
    torchrun("learner", str(tmp_path / "whole"), str(tmp_path / "whole-ckpt"), "--zero", zero)
    torchrun("learner", str(tmp_path / "killed"), str(tmp_path / "killed-ckpt"), "--kill-at", "7", "--zero", zero,
             restarts=1)
    for r in range(2):
        whole, killed = (dict(np.load(tmp_path / run / f"learner{r}.npz")) for run in ("whole", "killed"))
        # 96 samples, 6 per rank and step: 8 steps an epoch, 24 in all; the restarted attempt resumed from the
        # step-6 checkpoint and ran steps 6..23 once each
        assert whole["steps"].tolist() == list(range(24))
        assert killed["steps"].tolist() == list(range(6, 24))
        assert int(killed["final_step"]) == int(whole["final_step"]) == 24
        for k in whole:
            if k.startswith("param."):
                np.testing.assert_array_equal(killed[k], whole[k])
    shutil.rmtree(tmp_path)


@SLOW  # two TVM builds per rank: ~55 s on the loaded 2-core machine
def test_two_ranks_on_tvm_average_gradients_and_gather_zero1_updates(tmp_path: Path) -> None:
    """Issue 14: "A multi-process run on the TVM backend (2 ranks, tiny model, 1 thread each, hard timeout): gradients
    equal the single-process gradients of the concatenated batch". The oracle is torch on the concatenated batch; the
    ZeRO-1 steps' broadcasts must leave both ranks with the same parameters, and those are torch's two Adam steps."""
    pytest.importorskip("tvm")
    launch(2, "tvm", str(tmp_path), timeout=180)
    ranks = [dict(np.load(tmp_path / f"tvm{r}.npz")) for r in range(2)]
    init = {k.removeprefix("init."): v for k, v in ranks[0].items() if k.startswith("init.")}
    x, y = worker.global_batch(2)
    ps, loss = torch_mlp(init)
    loss(x, y).backward()
    for i, p in enumerate(ps):
        for r in range(2):
            assert relative(ranks[r][f"grad{i}"], p.grad.numpy()) <= 1e-5, (i, r)  # fast-math f32 kernels
    for name, p in torch_adam(init, x, y, 2).items():
        np.testing.assert_array_equal(ranks[1][f"zero1.{name}"], ranks[0][f"zero1.{name}"])
        np.testing.assert_allclose(ranks[0][f"zero1.{name}"], p, rtol=1e-4, atol=1e-5)


@SLOW  # four TVM builds per rank
def test_learner_on_tvm_zero1_clipping_and_synced_batch_norm(tmp_path: Path) -> None:
    """Issue 14: "ZeRO-1 gives the same parameters as plain data parallel" (here with gradient clipping, under the
    Learner, on TVM) and "batch-norm statistics synced across ranks" as torch's SyncBatchNorm: the oracles are the
    interpreter's plain data-parallel Learner (itself torch's clip_grad_norm_ + Adam in the 2-rank test) and torch's
    `F.batch_norm` on each concatenated global batch with SGD."""
    pytest.importorskip("tvm")
    launch(2, "tvm-learner", str(tmp_path), timeout=400)
    ranks = [dict(np.load(tmp_path / f"tvml{r}.npz")) for r in range(2)]
    for name in PARAMS:
        # the clipping is live: the unclipped run ends elsewhere
        assert not np.allclose(ranks[0][f"interp.noclip.{name}"], ranks[0][f"interp.clip0.{name}"], atol=1e-4)
        for rank in ranks:
            np.testing.assert_allclose(rank[f"tvm.clip1.{name}"], rank[f"tvm.clip0.{name}"], rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(rank[f"tvm.clip1.{name}"], rank[f"interp.clip0.{name}"], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(ranks[1][f"tvm.clip1.{name}"], ranks[0][f"tvm.clip1.{name}"])
    # synced batch norm: two SGD steps (lr 0.1) of torch on each concatenated global batch of 2 x BATCH rows
    bn = {k.removeprefix("bn.init."): torch.tensor(v, dtype=torch.float64, requires_grad=True)
          for k, v in ranks[0].items() if k.startswith("bn.init.")}
    running_mean, running_var = bn.pop("bn.running_mean").detach(), bn.pop("bn.running_var").detach()
    x, _ = worker.global_batch(4)
    target = torch.from_numpy(ranks[0]["bn.target"]).double()
    for b in range(2):
        rows = slice(2 * b * worker.BATCH, 2 * (b + 1) * worker.BATCH)
        h = (torch.from_numpy(x[rows]).double() @ bn["fc.weight"] + bn["fc.bias"]).reshape(-1, 3, 2)
        out = torch.nn.functional.batch_norm(h, running_mean, running_var, bn["bn.gamma"], bn["bn.beta"],
                                             training=True, momentum=0.1, eps=1e-5)
        ((out - target[rows]) ** 2).mean().backward()
        with torch.no_grad():
            for p in bn.values():
                p -= 0.1 * p.grad
                p.grad = None
    want = {**{k: p.detach().numpy() for k, p in bn.items()}, "bn.running_mean": running_mean.numpy(),
            "bn.running_var": running_var.numpy()}
    for rank in ranks:
        for name, value in want.items():
            np.testing.assert_allclose(rank[f"bn.{name}"], value, rtol=1e-4, atol=1e-5, err_msg=name)
