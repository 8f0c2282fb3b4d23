"""The collective op's run-time path on one process, with a stand-in communicator: both backends hand the installed
communicator the bucket's arrays and take its results (the interpreter from its reference semantics, TVM from the
packed function the Relax VM calls), and run the identity when none is installed. Plus the pass's option checks and
ZeRO-1's ownership rule."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from kiln.ir import Builder, DType, Graph, PassError, TensorType, interpret
from kiln.ir.ops.collective import communicating
from kiln.passes import PassManager
from kiln.passes.data_parallel import DataParallel, owners


class Tripling:
    """What three ranks holding the same values would compute: sum = 3x, mean = x."""

    rank, world_size = 0, 3

    def __init__(self) -> None:
        self.calls: list[tuple[list[tuple[int, ...]], str, str]] = []
        self.started: dict[int, tuple[np.ndarray, ...]] = {}

    def all_reduce(self, arrays: Sequence[np.ndarray], op: str, group: str) -> tuple[np.ndarray, ...]:
        self.calls.append(([a.shape for a in arrays], op, group))
        return tuple(a * (3 if op == "sum" else 1) for a in arrays)

    def all_reduce_start(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int) -> None:
        self.calls.append(([a.shape for a in arrays], f"start {op} {bucket}", group))
        self.started[bucket] = tuple(a * (3 if op == "sum" else 1) for a in arrays)

    def all_reduce_wait(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int
                        ) -> tuple[np.ndarray, ...]:
        self.calls.append(([a.shape for a in arrays], f"wait {op} {bucket}", group))
        return self.started.pop(bucket)

    def broadcast(self, arrays: Sequence[np.ndarray], src: int, group: str) -> tuple[np.ndarray, ...]:
        """Rank src's values, which here are this rank's plus 10 * src (so a result shows which src it came from)."""
        self.calls.append(([a.shape for a in arrays], f"broadcast from {src}", group))
        return tuple(a + 10 * src for a in arrays)


def bucket_graph() -> Graph:
    b = Builder("M")
    x, y = b.input("x", ((2, 3), DType.f32)), b.input("y", ((4,), DType.f32))
    s, t = b.op("all_reduce", b.op("add", x, x), y, op="sum")
    b.ret(b.op("mul", s, s), t)
    return b.build()


X, Y = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)


def test_the_interpreter_runs_a_bucket_through_the_installed_communicator() -> None:
    comm = Tripling()
    with communicating(comm):
        s2, t = interpret(bucket_graph(), [X, Y])
    assert comm.calls == [([(2, 3), (4,)], "sum", "world")]  # one bucket, one call
    np.testing.assert_array_equal(s2, (6 * X) ** 2)
    np.testing.assert_array_equal(t, 3 * Y)
    np.testing.assert_array_equal(interpret(bucket_graph(), [X, Y])[1], Y)  # no communicator: one process


def test_the_relax_vm_calls_the_communicator_from_inside_the_step() -> None:
    pytest.importorskip("tvm")
    from kiln.runtime.tvm.compile import compile_graph
    exe = compile_graph(bucket_graph(), target="llvm", params="inputs")
    comm = Tripling()
    with communicating(comm):
        s2, t = exe.run(X, Y)
    assert comm.calls == [([(2, 3), (4,)], "sum", "world")]
    np.testing.assert_array_equal(s2, (6 * X) ** 2)
    np.testing.assert_array_equal(t, 3 * Y)
    np.testing.assert_array_equal(exe.run(X, Y)[1], Y)


def split_graph() -> Graph:
    """bucket_graph's all_reduce as data-parallel{overlap} places it: started, a computation, then waited on."""
    b = Builder("M")
    x, y = b.input("x", ((2, 3), DType.f32)), b.input("y", ((4,), DType.f32))
    sent = b.op("all_reduce_start", b.op("add", x, x), y, op="sum", bucket=4)
    busy = b.op("exp", y)  # runs while the bucket is in flight
    s, t = b.op("all_reduce_wait", *sent, op="sum", bucket=4)
    b.ret(b.op("mul", s, s), t, busy)
    return b.build()


@pytest.mark.parametrize("backend", ["interpreter", "tvm"])
def test_a_started_bucket_is_waited_on_with_all_reduces_result(backend: str) -> None:
    """Issue 14: "bucketed so communication overlaps the remaining backward": the start hands the communicator the
    bucket, the wait (paired by bucket number) takes all_reduce's result; both are the identity on one process."""
    run = runner(split_graph(), backend)
    comm = Tripling()
    with communicating(comm):
        s2, t, busy = run(X, Y)
    assert comm.calls == [([(2, 3), (4,)], "start sum 4", "world"), ([(2, 3), (4,)], "wait sum 4", "world")]
    np.testing.assert_array_equal(s2, (6 * X) ** 2)
    np.testing.assert_array_equal(t, 3 * Y)
    np.testing.assert_allclose(busy, np.exp(Y), rtol=1e-6)
    s2, t, _ = run(X, Y)
    np.testing.assert_array_equal(s2, (2 * X) ** 2)
    np.testing.assert_array_equal(t, Y)



def runner(graph: Graph, backend: str) -> Callable[..., tuple[np.ndarray, ...]]:
    """`graph`'s forward on the interpreter or as an LLVM build with its parameters as inputs."""
    if backend == "tvm":
        pytest.importorskip("tvm")
        from kiln.runtime.tvm.compile import compile_graph
        return compile_graph(graph, target="llvm", params="inputs").run
    return lambda *xs: interpret(graph, list(xs))

def broadcast_graph() -> Graph:
    b = Builder("M")
    x, y = b.input("x", ((2, 3), DType.f32)), b.input("y", ((4,), DType.f32))
    s, t = b.op("broadcast", b.op("add", x, x), y, src=2)
    b.ret(b.op("mul", s, s), t)
    return b.build()


@pytest.mark.parametrize("backend", ["interpreter", "tvm"])
def test_broadcast_hands_the_communicator_its_bucket_and_source_rank(backend: str) -> None:
    """ZeRO-1's gather: one call per bucket naming the source rank; the identity on one process."""
    run = runner(broadcast_graph(), backend)
    comm = Tripling()
    with communicating(comm):
        s2, t = run(X, Y)
    assert comm.calls == [([(2, 3), (4,)], "broadcast from 2", "world")]
    np.testing.assert_array_equal(s2, (2 * X + 20) ** 2)
    np.testing.assert_array_equal(t, Y + 20)
    s2, t = run(X, Y)
    np.testing.assert_array_equal(s2, (2 * X) ** 2)
    np.testing.assert_array_equal(t, Y)


@pytest.mark.parametrize(("options", "message"), [
    ("bucket-bytes=-1", r"^data-parallel: bucket-bytes = -1 is negative"),
    ("zero=2", r"^data-parallel: zero = 2; only ZeRO stages 0 and 1 exist here"),
])
def test_bad_options_are_one_line_pass_errors(options: str, message: str) -> None:
    with pytest.raises(PassError, match=message):
        PassManager.parse(f"data-parallel{{{options}}}")


def test_the_pass_needs_autodiffs_output() -> None:
    with pytest.raises(PassError, match=r"^data-parallel: module @M has no function @forward_backward \(run autodiff"):
        DataParallel().apply(bucket_graph())


def test_zero1_owners_balance_the_bytes_largest_first() -> None:
    """Each parameter's optimizer state lives on one rank; the largest go first, each to the emptiest rank."""
    types = [TensorType(s, DType.f32) for s in ((5, 7), (7,), (7, 3), (3,))]
    assert owners(types, 2) == (0, 1, 1, 1)  # 35 | 21 + 7 + 3 elements
    assert owners(types, 4) == (0, 2, 1, 3)
    assert owners(types, 1) == (0, 0, 0, 0)


class Rank:
    """Rank `rank` of two holding the same gradients (mean = x)."""

    world_size = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def all_reduce(self, arrays: Sequence[np.ndarray], op: str, group: str) -> tuple[np.ndarray, ...]:
        return tuple(arrays)

    def all_reduce_start(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int) -> None:
        pass

    def all_reduce_wait(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int
                        ) -> tuple[np.ndarray, ...]:
        return tuple(arrays)


def test_each_rank_draws_its_own_dropout_masks_and_one_process_keeps_its_own() -> None:
    """Issue 14: "Per-rank dropout seeds (today every rank draws the same mask): the rank folds into the run seed".
    The oracle is kiln's documented mask, np.random.default_rng([op seed, run seed]) >= p, at run seed 5 + rank 2^40."""
    import kiln
    from kiln import nn, optim
    from kiln.ir.ops.random import rank_seed

    class Drop(kiln.Module):
        def __init__(self) -> None:
            self.fc, self.drop = nn.Linear(8, 8, device=kiln.Device("cpu").autodiff()), nn.Dropout(0.5)

        def forward(self, x: kiln.Tensor) -> kiln.Tensor:
            return self.drop(self.fc(x).exp())  # exp: no element is zero before the mask

    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)

    def loss(model: Drop, a: kiln.Tensor) -> tuple[kiln.Tensor, kiln.Tensor]:
        y = model(a)  # the trace's one dropout: op seed 1
        return y.sum(), y

    def dropped(communicator: Rank | None) -> np.ndarray:
        kiln.seed(0)
        step = kiln.compile_step(Drop(), loss, optim.SGD(), ((8, 8), "f32"), seed=5,
                                 data_parallel=DataParallel() if communicator else None, communicator=communicator)
        return step(0.0, x)[1]

    single, rank0, rank1 = dropped(None), dropped(Rank(0)), dropped(Rank(1))
    np.testing.assert_array_equal(single, rank0)
    assert ((rank0 == 0) != (rank1 == 0)).any()
    for got, rank in ((single, 0), (rank1, 1)):
        assert rank_seed(5, rank) == 5 + rank * 2 ** 40
        np.testing.assert_array_equal(got != 0, np.random.default_rng([1, 5 + rank * 2 ** 40]).random((8, 8)) >= 0.5)


@pytest.mark.parametrize("training", [True, False])
def test_sync_batch_norm_is_batch_norm_on_one_process(training: bool) -> None:
    """On one process the all_reduces are identities: sync-batch-norm computes batch_norm's three results (the
    interpreter's batch_norm, itself checked against torch, is the oracle), in training and with running stats."""
    from kiln.passes.data_parallel import SyncBatchNorm

    b = Builder("M")
    x = b.input("x", ((None, 3, 2), DType.f32))
    rng = np.random.default_rng(0)
    stats = [b.param(n, (3,), data=rng.uniform(0.5, 1.5, 3).astype(np.float32)) for n in ("g", "b", "m", "v")]
    b.ret(*b.op("batch_norm", x, *stats, b.flag("training", training), momentum=0.25))
    graph = b.build()
    synced = SyncBatchNorm().apply(graph)
    assert "batch_norm" not in {op.kind for op in synced.functions["forward"].ops}
    data = rng.standard_normal((5, 3, 2)).astype(np.float32)
    for want, got in zip(interpret(graph, [data]), interpret(synced, [data])):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


class Recording(Rank):
    """Rank 0 of two holding the same values, noting each collective's kind and op."""

    def __init__(self) -> None:
        super().__init__(0)
        self.ops: list[str] = []

    def all_reduce(self, arrays: Sequence[np.ndarray], op: str, group: str) -> tuple[np.ndarray, ...]:
        self.ops.append(f"all_reduce {op}")
        return tuple(a * (2 if op == "sum" else 1) for a in arrays)

    def all_reduce_start(self, arrays: Sequence[np.ndarray], op: str, group: str, bucket: int) -> None:
        self.ops.append(f"start {op}")


def test_compile_step_syncs_batch_norm_statistics_when_asked() -> None:
    """DataParallel(sync_batch_norm=True): the step's forward all-reduces batch norm's sums and count (two ranks
    holding the same batch: the mean and biased variance are this batch's, the count twice its own, which the
    running variance's unbiasing shows); without the option batch norm's statistics stay local."""
    import kiln
    from kiln import nn, optim

    class Normed(kiln.Module):
        def __init__(self) -> None:
            self.bn = nn.BatchNorm1d(3, device=kiln.Device("cpu").autodiff())

        def forward(self, x: kiln.Tensor) -> kiln.Tensor:
            return self.bn(x)

    x = np.random.default_rng(1).standard_normal((4, 3, 2)).astype(np.float32)

    def run(sync: bool) -> tuple[list[str], dict[str, np.ndarray]]:
        comm = Recording()
        kiln.seed(0)
        step = kiln.compile_step(Normed(), lambda m, a: (m(a) ** 2).mean(), optim.SGD(), ((4, 3, 2), "f32"),
                                 data_parallel=DataParallel(sync_batch_norm=sync), communicator=comm)
        step(0.1, x)
        return comm.ops, {p: np.asarray(v.state.get()) for p, v in step.model().leaves() if isinstance(v, kiln.Param)}

    synced, local = run(True), run(False)
    # the sums and count, then the squares' sums; the statistics lead back only to x, which needs no gradient
    assert synced[0].count("all_reduce sum") == 2 and "all_reduce sum" not in local[0]
    n = 8  # values per channel on one rank, 16 across the two
    mean, var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    np.testing.assert_allclose(synced[1]["bn.running_mean"], 0.1 * mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(synced[1]["bn.running_var"], 0.9 + 0.1 * var * 2 * n / (2 * n - 1), rtol=1e-6)
    np.testing.assert_allclose(local[1]["bn.running_var"], 0.9 + 0.1 * var * n / (n - 1), rtol=1e-6)
