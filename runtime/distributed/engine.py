"""The torch.distributed engine: kiln's collectives (`all_reduce`, `broadcast`) on the process group torchrun starts
(gloo on CPU, NCCL on CUDA). Arrays cross into torch through DLPack, so torch works on kiln's own buffer in place; a
bucket of several arrays is first packed into one flat buffer (one communication per bucket, as DDP does)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from kiln.ir import DistributedError


def torch_distributed() -> tuple[ModuleType, ModuleType]:
    """torch and torch.distributed, or one clear error saying how to get them."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise DistributedError("data-parallel training runs on torch.distributed: install it with "
                               "pip install 'kiln[distributed]'") from None
    if not dist.is_available():
        raise DistributedError(f"this torch ({torch.__version__}) was built without torch.distributed")
    return torch, dist


class TorchEngine:
    """A `kiln.ir.ops.collective.Communicator` over the default torch.distributed process group."""

    def __init__(self, timeout_s: float = 300.0):
        """Join the group torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
        use the one already initialized; a peer that does not answer within `timeout_s` is an error."""
        self.torch, self.dist = torch_distributed()
        if not self.dist.is_initialized():
            missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
            if missing:
                raise DistributedError(f"no process group to join: {', '.join(missing)} unset (launch with torchrun)")
            self._join(datetime.timedelta(seconds=timeout_s))
        self.rank, self.world_size = self.dist.get_rank(), self.dist.get_world_size()
        self.bytes_sent = 0  # payload bytes of the collectives so far, for bench/distributed.py
        self.wire_bytes = 0  # the bytes those put on the wire per rank (see _count)
        self._pending: dict[tuple[str, int], tuple[Any, np.ndarray, str]] = {}  # (group, bucket) -> work, buffer, op

    def _join(self, timeout: datetime.timedelta) -> None:
        """init_process_group on the rendezvous store under a prefix per torchrun attempt: a restarted group reuses
        torchrun's store, where the killed attempt's keys would otherwise send the ranks to dead peers."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent serves the store
        store = self.dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                                   is_master=not agent and rank == 0, timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        backend = "nccl" if self.torch.cuda.is_available() else "gloo"
        self.dist.init_process_group(backend, store=self.dist.PrefixStore(f"kiln/attempt-{attempt}", store),
                                     rank=rank, world_size=world, timeout=timeout)

    def tensor(self, array: np.ndarray) -> Any:
        """`array` as a torch tensor sharing its memory (DLPack; numpy exports only writeable arrays)."""
        return self.torch.from_dlpack(array)

    def all_reduce(self, arrays: Sequence[np.ndarray], op: str, group: str) -> tuple[np.ndarray, ...]:
        """Every rank's `arrays` summed or averaged elementwise, as new arrays (the operands are never written)."""
        flat = self._bucket("all_reduce", arrays, group)
        self.dist.all_reduce(self.tensor(flat), op=self.dist.ReduceOp.SUM)
        self._count(flat, 2)
        if op == "mean":
            flat /= self.world_size
        return _views(flat, arrays)

    def all_reduce_start(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int) -> None:
        """Begin all_reduce of `arrays` (a copy, so the caller may go on using them) in the background."""
        if (group, bucket) in self._pending:
            raise DistributedError(f"all_reduce_start: bucket {bucket} of group {group!r} is started and not waited on")
        flat = self._bucket("all_reduce", arrays, group)
        self._pending[group, bucket] = (self.launch(flat), flat, op)
        self._count(flat, 2)

    def launch(self, flat: np.ndarray) -> Any:
        """torch's asynchronous sum of `flat` across the group, in place: a handle whose wait() ends it."""
        return self.dist.all_reduce(self.tensor(flat), op=self.dist.ReduceOp.SUM, async_op=True)

    def all_reduce_wait(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int
                        ) -> tuple[np.ndarray, ...]:
        """The result of the all_reduce that `all_reduce_start` began for this bucket, once it has ended."""
        started = self._pending.pop((group, bucket), None)
        if started is None:
            raise DistributedError(f"all_reduce_wait: bucket {bucket} of group {group!r} was never started")
        work, flat, started_op = started
        if started_op != op or flat.size != sum(a.size for a in arrays):
            raise DistributedError(f"all_reduce_wait: bucket {bucket} was started as another all_reduce")
        work.wait()
        if op == "mean":
            flat /= self.world_size
        return _views(flat, arrays)

    def broadcast(self, arrays: Sequence[np.ndarray], src: int, group: str) -> tuple[np.ndarray, ...]:
        """Rank `src`'s `arrays` on every rank, as new arrays (the operands are never written)."""
        if not 0 <= src < self.world_size:
            raise DistributedError(f"broadcast: source rank {src} is outside the group of {self.world_size} ranks")
        flat = self._bucket("broadcast", arrays, group)
        self.dist.broadcast(self.tensor(flat), src=src)
        self._count(flat, 1)
        return _views(flat, arrays)

    def _bucket(self, what: str, arrays: Sequence[np.ndarray], group: str) -> np.ndarray:
        """One flat copy of a bucket's arrays, the buffer torch communicates in place."""
        if group != "world":
            raise DistributedError(f"{what}: process group {group!r} is unknown (only 'world' exists)")
        return np.concatenate([np.ravel(a) for a in arrays]) if len(arrays) > 1 else np.array(arrays[0]).reshape(-1)

    def _count(self, flat: np.ndarray, passes: int) -> None:
        """Tally a collective's payload, and the bytes an optimal algorithm puts on the wire per rank: (N - 1) / N of
        the payload for each pass over it (a ring all-reduce makes two, reduce-scatter then all-gather; a broadcast
        one)."""
        self.bytes_sent += flat.nbytes
        self.wire_bytes += passes * (self.world_size - 1) * flat.nbytes // self.world_size

    def all_gather_object(self, value: object) -> list[object]:
        """Every rank's picklable `value`, in rank order."""
        gathered: list[object] = [None] * self.world_size
        self.dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        self.dist.barrier()


def _views(flat: np.ndarray, arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, ...]:
    """`flat` cut back into arrays of the bucket's shapes (views, no copies)."""
    out, at = [], 0
    for a in arrays:
        out.append(flat[at:at + a.size].reshape(a.shape))
        at += a.size
    return tuple(out)
