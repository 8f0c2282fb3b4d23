"""The Learner: epochs of captured training steps (`compile_step`), evaluation through the model's `valid()`,
metrics per step and per epoch on a progress display and in a JSON-lines log, early stopping, gradient
accumulation, and checkpoints that a later `fit(resume=...)` continues from exactly.

Exactness: a step's dropout seed is the run's seed plus the number of steps before it, epoch e's order depends on
(loader seed, e) only, and a checkpoint holds every counter, the optimizer and scheduler state, the data position
and the log's length (a resumed run cuts the log back to it), so the resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from kiln.ir import DType, TensorType
from kiln.passes.data_parallel import DataParallel
from kiln.runtime.distributed import TorchEngine, check_same_model

from ..module import Module
from ..optim.accumulation import GradientAccumulation
from ..optim.optimizer import Optimizer
from ..optim.scheduler import LrScheduler
from ..param import Param
from ..step import LossFn, TrainStep, compile_step
from ..tensor import Tensor, tensor
from . import checkpoint
from .checkpoint import Checkpointing
from .data import Batch, DataLoader
from .metrics import Metric, StepOutput, default_metrics, measure, summarize
from .metrics_log import LogFormat, MetricsLog, columns, pick_format
from .progress import ProgressBar


@dataclass(frozen=True)
class EarlyStopping:
    """Stop after `patience` epochs in which `monitor` (an epoch log key: `valid_loss`, `train_accuracy`...) did
    not improve on its best by more than `min_delta`."""

    monitor: str = "valid_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_delta: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping.mode must be 'min' or 'max', got {self.mode!r}")
        if self.patience < 1:
            raise ValueError(f"EarlyStopping.patience must be at least 1, got {self.patience}")

    def improved(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta


@dataclass
class Position:
    """Where a run is: steps taken (micro-steps under accumulation), the epoch and batch within it, what this
    epoch's steps measured, the log's length, early stopping's best and wait, every finished epoch's summary
    (`history`, for the caller). All of it goes in a checkpoint."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    epoch_values: dict[str, list[float]] = field(default_factory=dict)
    epoch_sizes: dict[str, list[int]] = field(default_factory=dict)
    log_offset: int = 0
    best: float | None = None
    waited: int = 0
    stopped: bool = False
    history: list[dict[str, float]] = field(default_factory=list)


def _array(value: Any) -> np.ndarray:
    return value.numpy() if isinstance(value, Tensor) else np.asarray(value)


def _outputs(result: Any) -> tuple[float, np.ndarray | None]:
    """The loss and predictions (loss_fn's second result, when it has one) of a step's or loss_fn's results."""
    parts = result if isinstance(result, tuple) else (result,)
    return float(_array(parts[0])), _array(parts[1]) if len(parts) > 1 else None


def _input_specs(batch: Batch) -> tuple[TensorType, ...]:
    """The step's input types: the batch's arrays with a dynamic batch dimension."""
    return tuple(TensorType((None, *a.shape[1:]), DType.from_numpy(a.dtype)) for a in batch)


class Learner:
    """Trains `model` with `loss_fn(model, *batch) -> loss | (loss, predictions, ...)` (the targets are the batch's
    last array), `optimizer` and `lr_schedule` (advanced once per optimizer step). `accumulation=k` sums k batches'
    gradients per update; `log` is a file of every step and epoch, CSV for a `.csv` name (or `log_format="csv"`),
    else JSON lines; `stream` shows progress."""

    def __init__(self, model: Module, optimizer: Optimizer, loss_fn: LossFn, lr_schedule: LrScheduler,
                 metrics: Sequence[Metric] | None = None, *, accumulation: int = 1,
                 checkpointing: Checkpointing | None = None, early_stopping: EarlyStopping | None = None,
                 log: str | os.PathLike[str] | None = None, log_format: LogFormat | None = None,
                 stream: TextIO | None = None, seed: int = 0,
                 data_parallel: DataParallel | None = None, engine: TorchEngine | None = None):
        if data_parallel is not None and data_parallel.zero == 1 and checkpointing is not None \
                and checkpointing.every_seconds is not None:
            raise ValueError("ZeRO-1 checkpoints gather every rank's share of the optimizer state, so the ranks must "
                             "agree when to save: use Checkpointing(every_steps=...), not every_seconds")
        self.data_parallel, self.engine = data_parallel, engine
        self.model, self.loss_fn, self.lr_schedule = model, loss_fn, lr_schedule
        self.optimizer = optimizer if accumulation == 1 else GradientAccumulation(optimizer, accumulation)
        self.accumulation = accumulation
        self.metrics = tuple(default_metrics() if metrics is None else metrics)
        self.checkpointing, self.early_stopping = checkpointing, early_stopping
        self.log_path = None if log is None else Path(log)
        self.log_format = None if log is None else pick_format(log, log_format)
        self.stream = stream if stream is not None else sys.stdout
        self.seed = seed
        self.position = Position()
        self._step: TrainStep | None = None
        self._lr = 0.0

    # the run ------------------------------------------------------------------------------------------------------
    def fit(self, train_data: DataLoader | Iterable[Batch], valid_data: DataLoader | Iterable[Batch] | None = None,
            epochs: int = 1, resume: str | os.PathLike[str] | None = None) -> Module:
        """Train to `epochs` epochs (or an early stop), continuing from a checkpoint folder when `resume` is given;
        returns the trained module."""
        train = train_data if isinstance(train_data, DataLoader) else DataLoader(train_data, prefetch=0)
        self._data_seed = train.seed
        if self.data_parallel is not None:
            train = self._join(train)
        if resume is not None:
            self._resume(resume)
        self._open_log()
        pos = self.position
        self._last_save = time.monotonic()
        while pos.epoch < epochs and not pos.stopped:
            bar = self._train_epoch(train, epochs)
            summary = {f"train_{name}": value for name, value in self._summaries().items()}
            if valid_data is not None:
                summary.update({f"valid_{k}": v for k, v in self.evaluate(valid_data).items()})
            pos.epoch, pos.batch, pos.epoch_values, pos.epoch_sizes = pos.epoch + 1, 0, {}, {}
            pos.history.append(summary)
            self._early_stop(summary)
            self._write({"event": "epoch", "epoch": pos.epoch, **summary})
            bar.close(" ".join(f"{k} {v:.4g}" for k, v in summary.items() if not k.endswith(("_time", "_per_s"))))
            if self.checkpointing is not None:
                self._save()
        self._close_log()
        return self.trained()

    def trained(self) -> Module:
        """The module as training has left it (the initial one before any step)."""
        return self._step.model() if self._step is not None else self.model

    def _train_epoch(self, train: DataLoader, epochs: int) -> ProgressBar:
        """Run the epoch's remaining batches; returns its progress bar, for the epoch summary."""
        pos = self.position
        try:
            total = len(train)
        except TypeError:
            total = None
        bar = ProgressBar(f"epoch {pos.epoch + 1}/{epochs}", total, self.stream)
        for batch in train.batches(pos.epoch, pos.batch):
            if pos.step % self.accumulation == 0:
                self._lr = self.lr_schedule.step()
            step = self._step or self._compile(batch)
            start = time.perf_counter()
            loss, predictions = _outputs(step(self._lr, *batch))
            out = StepOutput(loss, predictions, batch[-1], self._lr, len(batch[0]), time.perf_counter() - start)
            values = self._record(out)
            pos.step, pos.batch = pos.step + 1, pos.batch + 1
            self._write({"event": "step", "epoch": pos.epoch + 1, "step": pos.step, **values})
            bar.update(pos.batch, " ".join(f"{k} {v:.4g}" for k, v in values.items() if k in ("loss", "accuracy")))
            if self._due():
                self._save()
        return bar

    def _compile(self, batch: Batch) -> TrainStep:
        """The captured step, its dropout seeds continuing where the run is (the same on every rank); data-parallel,
        the same program after the data-parallel pass, its collectives run by the engine."""
        self._step = compile_step(self.model, self.loss_fn, self.optimizer, *_input_specs(batch),
                                  seed=self.seed + self.position.step, data_parallel=self.data_parallel,
                                  communicator=self.engine)
        return self._step

    def _join(self, train: DataLoader) -> DataLoader:
        """Join the data-parallel group: check every rank holds this model, read this rank's share of the data, and
        leave the log, the progress display and the checkpoints to rank 0."""
        if not train.indexed:
            raise ValueError("data-parallel training shards a DataLoader with a batch_size (each rank reads its "
                             "slice of the seeded order); an iterable of batches cannot be sharded")
        engine = self.engine = self.engine or TorchEngine()
        check_same_model(engine, [(path, tuple(p.type.shape), p.type.dtype.value, str(p.id))
                                  for path, p in self.model.leaves() if isinstance(p, Param)])
        if engine.rank != 0:
            self.log_path, self.stream = None, open(os.devnull, "w")
            if not self._sharded():  # under ZeRO-1 every rank takes part in the saves (it holds a shard)
                self.checkpointing = None
        return train.sharded(engine.rank, engine.world_size)

    def _sharded(self) -> bool:
        """Whether each rank keeps only its share of the optimizer state (ZeRO-1 over more than one rank)."""
        dp, engine = self.data_parallel, self.engine
        return dp is not None and dp.zero == 1 and engine is not None and engine.world_size > 1

    def _whole_optimizer(self) -> Optimizer:
        """The optimizer with every parameter's state: under ZeRO-1 each rank's share, gathered from all ranks
        (every rank calls this at the same step), else the optimizer itself."""
        if not self._sharded():
            return self.optimizer
        assert self.engine is not None
        mine = {pid: (self.optimizer.paths[pid], state) for pid, state in self.optimizer.state.items()}
        whole = copy.copy(self.optimizer)
        whole.state, whole.paths = {}, {}
        for share in self.engine.all_gather_object(mine):
            for pid, (path, state) in share.items():  # type: ignore[attr-defined]
                whole.state[pid], whole.paths[pid] = state, path
        return whole

    def evaluate(self, data: DataLoader | Iterable[Batch]) -> dict[str, float]:
        """The metrics over `data`, the trained module in `valid()` state run eagerly."""
        model = self.trained().valid()
        batches = data.batches() if isinstance(data, DataLoader) else iter(data)
        values: dict[str, list[float]] = {}
        sizes: dict[str, list[int]] = {}
        for batch in batches:
            start = time.perf_counter()
            loss, predictions = _outputs(self.loss_fn(model, *(tensor(a) for a in batch)))
            out = StepOutput(loss, predictions, np.asarray(batch[-1]), None, len(batch[0]), time.perf_counter() - start)
            measure(self.metrics, out, values, sizes)
        return summarize(self.metrics, values, sizes)

    # metrics, log, early stopping -----------------------------------------------------------------------------
    def _record(self, out: StepOutput) -> dict[str, float]:
        return measure(self.metrics, out, self.position.epoch_values, self.position.epoch_sizes)

    def _summaries(self) -> dict[str, float]:
        return summarize(self.metrics, self.position.epoch_values, self.position.epoch_sizes)

    def _early_stop(self, summary: dict[str, float]) -> None:
        rule, pos = self.early_stopping, self.position
        if rule is None:
            return
        if rule.monitor not in summary:
            raise ValueError(f"early stopping monitors {rule.monitor!r}, which no epoch reports (they report "
                           f"{', '.join(summary)})")
        if rule.improved(summary[rule.monitor], pos.best):
            pos.best, pos.waited = summary[rule.monitor], 0
        else:
            pos.waited += 1
            pos.stopped = pos.waited >= rule.patience

    def _open_log(self) -> None:
        self._log = None
        if self.log_path is not None and self.log_format is not None:  # a resumed run drops what came after
            self._log = MetricsLog(self.log_path, self.log_format, columns([m.name for m in self.metrics]),
                                   self.position.log_offset)
            self.position.log_offset = self._log.file.tell()  # after a new CSV log's header

    def _write(self, record: dict[str, Any]) -> None:
        if self._log is not None:
            self.position.log_offset = self._log.write(record)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()

    # checkpoints ------------------------------------------------------------------------------------------------
    def _due(self) -> bool:
        rule = self.checkpointing
        if rule is None:
            return False
        by_steps = rule.every_steps is not None and self.position.step % rule.every_steps == 0
        by_time = rule.every_seconds is not None and time.monotonic() - self._last_save >= rule.every_seconds
        return by_steps or by_time

    def _save(self) -> None:
        rule = self.checkpointing
        assert rule is not None
        optimizer = self._whole_optimizer()
        folder = Path(rule.directory) / f"step-{self.position.step:09d}"
        if self.engine is not None and self.engine.rank != 0:  # a ZeRO-1 rank gave its share; rank 0 writes
            pass
        elif not folder.exists():  # the same step's checkpoint holds the same state
            checkpoint.save(rule.directory, self.position.step, self.trained(), optimizer,
                            {"position": asdict(self.position), "lr": self._lr,
                             "schedule_iteration": self.lr_schedule.iteration,
                             "rng": {"seed": self.seed, "data_seed": self._data_seed}}, rule.keep)
        self._last_save = time.monotonic()

    def _resume(self, path: str | os.PathLike[str]) -> None:
        self.model, self.optimizer, state = checkpoint.load(path, self.model, self.optimizer)
        self.position = Position(**state["position"])
        self.lr_schedule.iteration, self._lr = state["schedule_iteration"], state["lr"]
        self.seed, self._step = state["rng"]["seed"], None
        if state["rng"]["data_seed"] != self._data_seed:
            raise ValueError(f"the checkpoint's data was shuffled with seed {state['rng']['data_seed']}, this "
                             f"DataLoader's seed is {self._data_seed}: the resumed run would see other batches")
