"""One rank of the data-parallel tests, started by tests/runtime/distributed/test_distributed.py (RANK, WORLD_SIZE,
MASTER_ADDR=127.0.0.1, MASTER_PORT in the environment, one thread) or by torchrun:

    python worker.py checks OUT                    gradients, DLPack, ZeRO-1, overlap, another model -> OUT/rank<r>.npz
    python worker.py learner OUT CKPT [--kill-at N] [--zero 1]   a data-parallel Learner run -> OUT/learner<r>.npz
    python worker.py tvm OUT                       the averaged gradients and a ZeRO-1 step on TVM -> OUT/tvm<r>.npz
    python worker.py tvm-learner OUT               Learners on TVM: ZeRO-1 + clipping, synced BN -> OUT/tvml<r>.npz

`learner --kill-at N` SIGKILLs rank 1 after its N-th step on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0);
the restarted group resumes from the newest checkpoint in CKPT.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

import kiln
from kiln import nn, optim
from kiln.frontend.autograd import differentiate
from kiln.frontend.trace import trace_function
from kiln.ir import DType, Graph, Interpreter, TensorType
from kiln.ir.ops.collective import communicating
from kiln.passes.data_parallel import DataParallel, SyncBatchNorm
from kiln.runtime.distributed import TorchEngine
from kiln.runtime.records.record import ModuleRecord
from kiln.train import Checkpointing, DataLoader, Learner
from kiln.train import checkpoint as checkpoints
from kiln.train.metrics import Loss

BATCH, D_IN, D_HIDDEN, D_OUT = 6, 5, 7, 3  # per rank
CLIP = 0.25  # the global gradient norm clipped to: below every step's norm at 2 and at 4 ranks (first step: 0.58, 0.32)


class MLP(kiln.Module):
    def __init__(self, hidden: int = D_HIDDEN) -> None:
        device = kiln.Device("cpu").autodiff()
        self.fc1, self.fc2 = nn.Linear(D_IN, hidden, device=device), nn.Linear(hidden, D_OUT, device=device)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


def mse(model: MLP, x: kiln.Tensor, y: kiln.Tensor) -> kiln.Tensor:
    return ((model(x) - y) ** 2).mean()


def global_batch(world: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The batch all ranks together take (rank r's share: rows r*BATCH ... (r+1)*BATCH)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((BATCH * world, D_IN)).astype(np.float32),
            rng.standard_normal((BATCH * world, D_OUT)).astype(np.float32))


def params(model: kiln.Module) -> dict[str, np.ndarray]:
    return {path: np.asarray(p.state.get()) for path, p in model.leaves() if isinstance(p, kiln.Param)}


TYPES = (TensorType((BATCH, D_IN), DType.f32), TensorType((BATCH, D_OUT), DType.f32))


def data_parallel_graph(engine: TorchEngine, overlap: bool = True) -> tuple[np.ndarray, np.ndarray, slice, MLP, Graph]:
    """The global batch, this rank's slice of it, the seeded model and its forward_backward after the data-parallel
    pass (small buckets: several all_reduces, started and waited on apart or, without `overlap`, in one op each)."""
    x, y = global_batch(engine.world_size)
    kiln.seed(7)
    model = MLP()
    traced, _ = trace_function(model, lambda a, b: mse(model, a, b), *TYPES)
    graph = DataParallel(bucket_bytes=64, overlap=overlap).apply(differentiate(traced))
    return x, y, slice(engine.rank * BATCH, (engine.rank + 1) * BATCH), model, graph


class _Timed:
    """A future as torch's work handle: wait() returns once it is done; the engine learns when the first wait came."""

    def __init__(self, future: Any, engine: SlowFirstBucket) -> None:
        self.future, self.engine = future, engine

    def wait(self) -> None:
        self.engine.waited()
        self.future.result()


class SlowFirstBucket(TorchEngine):
    """A slow network for the first collective after `reset()`: it takes `delay` seconds more, synchronous or started
    in the background (one worker thread, so the ranks' collectives keep their order). It also measures `window`:
    how long the backward went on between starting the first bucket and the first wait on any."""

    def __init__(self) -> None:
        super().__init__(timeout_s=60)
        self.pool = ThreadPoolExecutor(1)
        self.delay = 0.0
        self.reset()

    def reset(self) -> None:
        self.collectives, self.started, self.window = 0, 0.0, 0.0

    def waited(self) -> None:
        if not self.window:
            self.window = time.perf_counter() - self.started

    def all_reduce(self, arrays, op, group):  # type: ignore[no-untyped-def]
        self.collectives += 1
        if self.collectives == 1:
            time.sleep(self.delay)
        return super().all_reduce(arrays, op, group)

    def launch(self, flat: np.ndarray) -> Any:
        def run(delay: float) -> None:
            time.sleep(delay)
            self.dist.all_reduce(self.tensor(flat), op=self.dist.ReduceOp.SUM)
        self.collectives += 1
        if self.collectives == 1:
            self.started = time.perf_counter()
        return _Timed(self.pool.submit(run, self.delay if self.collectives == 1 else 0.0), self)


class Wide(kiln.Module):
    """A backward heavy enough to hide a slow bucket behind: the last layer's gradient is computed first and small
    (its own bucket), the wide first layers' after it."""

    def __init__(self) -> None:
        device = kiln.Device("cpu").autodiff()
        self.fc1, self.fc2, self.fc3 = (nn.Linear(768, 768, device=device) for _ in range(3))
        self.head = nn.Linear(768, 4, device=device)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        relu = nn.functional.relu
        return self.head(relu(self.fc3(relu(self.fc2(relu(self.fc1(x)))))))


def overlap_times(engine: SlowFirstBucket, rows: int = 1024) -> dict[str, np.ndarray]:
    """Wall time of forward_backward with the first bucket's all_reduce slow, started and waited on apart (overlap)
    and in one op; and the overlapped run's averaged gradients against the other's. The delay is the backward's
    window measured without one (the slowest rank's), so all of it can hide on any CPU, fast or slow."""
    kiln.seed(1)
    model = Wide()
    types = (TensorType((rows, 768), DType.f32), TensorType((rows, 4), DType.f32))
    traced, _ = trace_function(model, lambda a, b: mse(model, a, b), *types)
    rng = np.random.default_rng(engine.rank)
    x, y = rng.standard_normal((rows, 768)).astype(np.float32), rng.standard_normal((rows, 4)).astype(np.float32)
    interpreters = {how: Interpreter(DataParallel(bucket_bytes=4 * 768 * 4, overlap=how == "overlap")
                                     .apply(differentiate(traced))) for how in ("overlap", "sync")}

    def fastest(how: str) -> tuple[float, list[np.ndarray]]:
        times = []
        for _ in range(3):
            engine.barrier()
            engine.reset()
            start = time.perf_counter()
            grads = interpreters[how].run([x, y], "forward_backward")[1:]
            times.append(time.perf_counter() - start)
        return min(times), grads

    out: dict[str, np.ndarray] = {}
    with communicating(engine):
        engine.delay = 0.0
        out["slow.base.time"] = np.asarray(fastest("overlap")[0])
        out["slow.window"] = np.asarray(engine.window)
        engine.delay = max(engine.all_gather_object(engine.window))
        out["slow.delay"] = np.asarray(engine.delay)
        for how in ("overlap", "sync"):
            took, grads = fastest(how)
            out[f"slow.{how}.time"] = np.asarray(took)
            out.update({f"slow.{how}.grad{i}": g for i, g in enumerate(grads)})
    return out


def checks(engine: TorchEngine, out: Path) -> None:
    r, world = engine.rank, engine.world_size
    x, y, mine, model, graph = data_parallel_graph(engine)
    result: dict[str, np.ndarray] = {}
    with communicating(engine):
        grads = Interpreter(graph).run([x[mine], y[mine]], "forward_backward")[1:]
    result.update({f"grad{i}": g for i, g in enumerate(grads)})
    result.update({f"init.{k}": v for k, v in params(model).items()})
    *_, synchronous = data_parallel_graph(engine, overlap=False)
    with communicating(engine):
        result.update({f"sync.grad{i}": g for i, g in enumerate(Interpreter(synchronous).run(
            [x[mine], y[mine]], "forward_backward")[1:])})
    # DLPack: torch reduces the very buffer kiln hands it
    buffer = np.arange(4, dtype=np.float32)
    result["same_pointer"] = np.asarray(engine.tensor(buffer).data_ptr() == buffer.ctypes.data)
    # a broadcast from a rank outside the group: one error, before any communication
    try:
        engine.broadcast([buffer], world, "world")
        result["bad_src"] = np.asarray("")
    except kiln.DistributedError as e:
        result["bad_src"] = np.asarray(str(e))
    # a wait for a bucket never started: one error naming it, before any communication
    try:
        engine.all_reduce_wait([buffer], "mean", "world", 99)
        result["unstarted"] = np.asarray("")
    except kiln.DistributedError as e:
        result["unstarted"] = np.asarray(str(e))
    # three Adam steps, plain data parallel and ZeRO-1
    for zero in (0, 1):
        kiln.seed(7)
        step = kiln.compile_step(MLP(), mse, optim.Adam(), *TYPES, data_parallel=DataParallel(zero=zero),
                                 communicator=engine)
        for k in range(3):
            step(0.05, *(a[mine] + k for a in (x, y)))
        result.update({f"zero{zero}.{k}": v for k, v in params(step.model()).items()})
        result[f"zero{zero}.state_arrays"] = np.asarray(sum(len(s) for s in step.optimizer.state.values()))
    # clipping by the global norm: ZeRO-1 (each rank updating its share) and plain data parallel
    for zero in (0, 1):
        kiln.seed(7)
        step = kiln.compile_step(MLP(), mse, optim.Adam(grad_clipping=optim.GradientClipping.norm(CLIP)), *TYPES,
                                 data_parallel=DataParallel(zero=zero), communicator=engine)
        for k in range(3):
            step(0.05, *(a[mine] + k for a in (x, y)))
        result.update({f"clip{zero}.{k}": v for k, v in params(step.model()).items()})
    # a slow first bucket, started where it closes or reduced in one op
    result.update(overlap_times(SlowFirstBucket()))
    result.update(zero_resume(engine, out))
    result.update(sync_batch_norm(engine))
    # a rank with another model: the Learner refuses to start, on every rank
    kiln.seed(7)
    other = MLP(hidden=D_HIDDEN + 1 if r == world - 1 else D_HIDDEN)
    learner = Learner(other, optim.SGD(), mse, optim.ConstantLr(0.1), stream=open(os.devnull, "w"),
                      data_parallel=DataParallel(), engine=engine)
    try:
        learner.fit(DataLoader((x, y), BATCH, drop_last=True), epochs=1)
        result["disagreement"] = np.asarray("")
    except kiln.DistributedError as e:
        result["disagreement"] = np.asarray(str(e))
    np.savez(out / f"rank{r}.npz", **result)


def tvm_run(engine: TorchEngine, out: Path) -> None:
    """The data-parallel gradients and two ZeRO-1 Adam steps built by TVM: the Relax VM calls the engine mid-step."""
    from kiln.runtime.backend import set_default_backend
    from kiln.runtime.tvm.backend import TVMBackend

    backend = TVMBackend()
    set_default_backend(backend)
    r = engine.rank
    x, y, mine, model, graph = data_parallel_graph(engine)
    with communicating(engine):
        grads = backend.run(graph, [x[mine], y[mine]], "forward_backward")[1:]
    result = {f"grad{i}": g for i, g in enumerate(grads)}
    result.update({f"init.{k}": v for k, v in params(model).items()})
    kiln.seed(7)
    step = kiln.compile_step(MLP(), mse, optim.Adam(), *TYPES, data_parallel=DataParallel(zero=1), communicator=engine)
    for k in range(2):
        step(0.05, *(a[mine] + k for a in (x, y)))
    result.update({f"zero1.{k}": v for k, v in params(step.model()).items()})
    np.savez(out / f"tvm{r}.npz", **result)


def learner(engine: TorchEngine, ckpt: str, zero: int, keep: int = 2, clip: bool | None = None
            ) -> tuple[Learner, DataLoader]:
    """The Learner runs' learner (AdamW, its gradients clipped if `clip`, by default under ZeRO-1) checkpointing
    every 2 steps, and data: 96 samples, 6 per rank and step."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((96, D_IN)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((D_IN, D_OUT))).astype(np.float32)
    kiln.seed(7)
    clipped = bool(zero) if clip is None else clip
    adamw = optim.AdamW(grad_clipping=optim.GradientClipping.norm(CLIP) if clipped else None)
    run = Learner(MLP(), adamw, mse, optim.ConstantLr(0.02), stream=open(os.devnull, "w"),
                  checkpointing=Checkpointing(ckpt, every_steps=2, keep=keep), data_parallel=DataParallel(zero=zero),
                  engine=engine, metrics=(Loss(),))
    return run, DataLoader((x, y), BATCH, shuffle=True, seed=4, drop_last=True)


class Normed(kiln.Module):
    """A linear layer whose output, as [batch, 3 channels, 2], batch norm normalizes."""

    def __init__(self) -> None:
        device = kiln.Device("cpu").autodiff()
        self.fc, self.bn = nn.Linear(D_IN, 6, device=device), nn.BatchNorm1d(3, device=device)

    def forward(self, x: kiln.Tensor) -> kiln.Tensor:
        return self.bn(self.fc(x).reshape((-1, 3, 2)))


def sync_batch_norm(engine: TorchEngine) -> dict[str, np.ndarray]:
    """forward_backward of Normed on this rank's batch with batch-norm statistics synced: the output, the new
    running statistics and the averaged gradients, by parameter name."""
    x, _, mine, _, _ = data_parallel_graph(engine)
    target = np.random.default_rng(5).standard_normal((BATCH * engine.world_size, 3, 2)).astype(np.float32)
    kiln.seed(3)
    model = Normed()
    types = (TensorType((None, D_IN), DType.f32), TensorType((None, 3, 2), DType.f32))

    def loss(a: kiln.Tensor, b: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
        out = model(a)
        return ((out - b) ** 2).mean(), out

    traced, _ = trace_function(model, loss, *types)
    graph = DataParallel(sync_batch_norm=True).apply(differentiate(SyncBatchNorm().apply(traced)))
    with communicating(engine):
        outs = Interpreter(graph).run([x[mine], target[mine]], "forward_backward")
    trained = [p.name for p in graph.params.values() if p.grad]
    result = {"bn.out": outs[1], "bn.running_mean": outs[2], "bn.running_var": outs[3], "bn.target": target}
    result.update({f"bn.grad.{name}": g for name, g in zip(trained, outs[4:])})
    result.update({f"bn.init.{k}": v for k, v in params(model).items()})
    return result


def tvm_learner(engine: TorchEngine, out: Path) -> None:
    """Learners whose steps TVM builds: AdamW with clipping under ZeRO-1 and plain data parallel (one epoch each),
    the same and an unclipped run on the interpreter; and SGD over Normed with synced batch norm on two unshuffled
    global batches."""
    from kiln.runtime.backend import InterpreterBackend, set_default_backend
    from kiln.runtime.tvm.backend import TVMBackend

    result: dict[str, np.ndarray] = {}
    for backend, runs in ((InterpreterBackend(), (("interp.clip0", 0, True), ("interp.noclip", 0, False))),
                          (TVMBackend(), (("tvm.clip0", 0, True), ("tvm.clip1", 1, True)))):
        set_default_backend(backend)
        for key, zero, clip in runs:
            run, loader = learner(engine, str(out / f"{key}-ckpt"), zero, clip=clip)
            result.update({f"{key}.{k}": v for k, v in params(run.fit(loader, epochs=1)).items()})
    x, _ = global_batch(2 * engine.world_size)  # two global batches
    target = np.random.default_rng(5).standard_normal((len(x), 3, 2)).astype(np.float32)
    kiln.seed(3)
    model = Normed()
    result.update({f"bn.init.{k}": v for k, v in params(model).items()})
    run = Learner(model, optim.SGD(), mse, optim.ConstantLr(0.1), stream=open(os.devnull, "w"),
                  data_parallel=DataParallel(sync_batch_norm=True), engine=engine)
    result.update({f"bn.{k}": v for k, v in params(run.fit(DataLoader((x, target), BATCH, drop_last=True))).items()})
    result["bn.target"] = target
    np.savez(out / f"tvml{engine.rank}.npz", **result)


def zero_resume(engine: TorchEngine, out: Path) -> dict[str, np.ndarray]:
    """ZeRO-1 checkpoints: a 2-epoch run, and a second Learner resumed from its step-6 checkpoint to the end; the
    number of optimizer-state arrays in a checkpoint (all ranks' shares) and in each rank's optimizer."""
    whole, loader = learner(engine, str(out / "zero-ckpt"), zero=1, keep=20)
    end = whole.fit(loader, epochs=2)
    resumed, loader = learner(engine, str(out / "zero-ckpt"), zero=1, keep=20)
    again = resumed.fit(loader, epochs=2, resume=out / "zero-ckpt" / "step-000000006")
    saved = ModuleRecord.load(out / "zero-ckpt" / "step-000000006" / "optimizer.bpk")
    result = {f"resume.whole.{k}": v for k, v in params(end).items()}
    result.update({f"resume.resumed.{k}": v for k, v in params(again).items()})
    result["resume.saved_arrays"] = np.asarray(len(saved))
    result["resume.rank_arrays"] = np.asarray(sum(len(s) for s in resumed.optimizer.state.values()))
    return result


def learner_run(engine: TorchEngine, out: Path, ckpt: str, kill_at: int | None, zero: int) -> None:
    r = engine.rank
    run, loader = learner(engine, ckpt, zero)
    seen: list[int] = []
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    real = run._record

    def record(output):  # the step counter and data position of each step this process runs
        seen.append(run.position.step)
        if kill_at is not None and first_attempt and r == 1 and len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(output)

    run._record = record  # type: ignore[method-assign]
    resume = ckpt if checkpoints.checkpoints(ckpt) else None
    trained = run.fit(loader, epochs=3, resume=resume)
    np.savez(out / f"learner{r}.npz", steps=np.asarray(seen), final_step=np.asarray(run.position.step),
             **{f"param.{k}": v for k, v in params(trained).items()})
    (out / f"learner{r}.json").write_text(json.dumps({"resumed": resume is not None}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("checks", "learner", "tvm", "tvm-learner"))
    parser.add_argument("out")
    parser.add_argument("ckpt", nargs="?")
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()
    engine = TorchEngine(timeout_s=60)
    if args.mode == "checks":
        checks(engine, Path(args.out))
    elif args.mode == "tvm":
        tvm_run(engine, Path(args.out))
    elif args.mode == "tvm-learner":
        tvm_learner(engine, Path(args.out))
    else:
        learner_run(engine, Path(args.out), args.ckpt, args.kill_at, args.zero)
    engine.dist.destroy_process_group()


if __name__ == "__main__":
    main()
