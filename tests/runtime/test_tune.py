"""`kiln tune`: tuning databases under the cache dir, applied automatically (and only) to builds of the same graph,
target and options, with kiln's rules as the fallback.

The fast tests write a small MetaSchedule database by hand (a real JSONDatabase with a real schedule trace for
the graph's fused kernel), since a real tuning run costs ~45 s here (~20-30 s of it TVM importing its tensor
intrinsics). The end-to-end tuning tests run with KILN_SLOW_TESTS=1.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import tvm
from terminal import stderr_terminal
from tvm.s_tir import meta_schedule as ms

import kiln
from kiln.cli import main as cli_main
from kiln.ir import Builder, Graph, KilnError, interpret, print_graph
from kiln.runtime.tvm import compile_cache, tune_prune
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.target import resolve_target
from kiln.runtime.tvm.tune import (
    DONE_FILE,
    RECORD_FILE,
    WORKLOAD_FILE,
    _Progress,
    find_database,
    fused_module,
    mark_done,
    record_count,
    tune_graph,
    tuning_dir,
    was_tuned,
)
from kiln.runtime.tvm.tune_prune import prune_database

slow = pytest.mark.skipif(os.environ.get("KILN_SLOW_TESTS") != "1", reason="real tuning runs; KILN_SLOW_TESTS=1")


pytestmark = pytest.mark.usefixtures("cache_root")  # every test gets an empty compile cache


def matmul_relu(n: int = 32, seed: int = 0) -> Graph:
    b = Builder("Tiny")
    x = b.input("x", ((32, 64), "f32"))
    w = b.param("w", (64, n), id=7, data=np.random.default_rng(seed).normal(size=(64, n)).astype(np.float32))
    b.ret(b.relu(b.matmul(x, w)))
    return b.build()


def write_database(graph: Graph, run_secs: float = 1e-6) -> Path:
    """A database with one hand-made record per kernel (parallel outer loop), where tuning would put it, claiming
    `run_secs` per call."""
    target = resolve_target("llvm")
    path = tuning_dir(graph, target)
    path.mkdir(parents=True)
    db = ms.database.JSONDatabase(path_workload=str(path / WORKLOAD_FILE), path_tuning_record=str(path / RECORD_FILE))
    for task in ms.relax_integration.extract_tasks(fused_module(graph, target), target):
        mod = task.dispatched[0]
        sch = tvm.s_tir.Schedule(mod)
        first = sch.get_child_blocks(sch.get_sblock("root"))[0]
        sch.parallel(sch.get_loops(first)[0])
        workload = db.commit_workload(mod)
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, workload, run_secs=[run_secs], target=target))
    return path


def applied(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "kiln_tuned_kernels")]


def kept_kernels(path: Path) -> list[int]:
    """What a build logs applying the database after pruning: the one kernel if its record survived, else
    nothing (a database without records is not applied)."""
    return [1] if record_count(path) else []


def check_matches_interpreter(graph: Graph, exe) -> None:
    x = np.random.default_rng(1).normal(size=(32, 64)).astype(np.float32)
    (want,) = interpret(graph, [x])
    np.testing.assert_allclose(exe(x), want, rtol=1e-4, atol=1e-4)


def test_database_applies_to_same_graph_only(cache_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    graph = matmul_relu()
    path = write_database(graph)
    assert path.parent == cache_root / "tuning"
    assert find_database(graph, resolve_target("llvm")) == path
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    exe = compile_graph(graph)
    (record,) = applied(caplog)
    assert record.kiln_tuned_kernels == 1 and record.kiln_tuning_dir == str(path)
    check_matches_interpreter(graph, exe)

    caplog.clear()
    other = matmul_relu(n=16)  # another shape: another key, and its kernel is not in the database anyway
    assert find_database(other, resolve_target("llvm")) is None
    check_matches_interpreter(other, compile_graph(other))
    assert applied(caplog) == []
    # options are part of the key: an exact-math build does not use the fast-math database
    assert find_database(graph, resolve_target("llvm"), fast_math=False) is None
    assert find_database(graph, resolve_target("llvm"), params="inputs") is None


def test_new_weights_keep_their_tuning() -> None:
    graph = matmul_relu()
    path = write_database(graph)
    assert find_database(matmul_relu(seed=5), resolve_target("llvm")) == path


def test_tuned_build_is_not_served_from_untuned_cache(caplog: pytest.LogCaptureFixture) -> None:
    graph = matmul_relu()
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    compile_graph(graph)  # untuned, cached in memory and on disk
    assert applied(caplog) == []
    write_database(graph)
    exe = compile_graph(graph)  # must rebuild with the database, not hit the untuned entry
    assert [r.kiln_tuned_kernels for r in applied(caplog)] == [1]
    check_matches_interpreter(graph, exe)
    caplog.clear()
    compile_graph(graph)  # now a cache hit of the tuned build
    assert applied(caplog) == []
    compile_cache.clear_memory()
    check_matches_interpreter(graph, compile_graph(graph))  # the tuned disk entry
    assert applied(caplog) == []


@pytest.mark.parametrize(("claimed", "kept"), [(1e-9, 1), (10.0, 0)], ids=["beats-the-rules", "slower-than-rules"])
def test_pruning_keeps_only_schedules_that_beat_the_rules(claimed: float, kept: int,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A tuned record stays only if its measured time beats kiln's rules on the same kernel; a database left
    without records is not applied at all, so the build is the default one."""
    graph = matmul_relu()
    path = write_database(graph, run_secs=claimed)
    assert prune_database(path, resolve_target("llvm"), WORKLOAD_FILE, RECORD_FILE) == (kept, 1 - kept)
    assert record_count(path) == kept and not list(path.glob("*.scratch"))
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    check_matches_interpreter(graph, compile_graph(graph))
    assert [r.kiln_tuned_kernels for r in applied(caplog)] == ([1] if kept else [])


def test_compile_with_tune_does_not_tune_a_build_tuned_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished run marks its directory, even when pruning left no records; `kiln.compile(tune=N)` then only
    builds. Without the mark (no run, or one interrupted) it tunes."""
    graph = matmul_relu()
    path = write_database(graph, run_secs=10.0)
    prune_database(path, resolve_target("llvm"), WORKLOAD_FILE, RECORD_FILE)
    calls = []
    monkeypatch.setattr("kiln.runtime.tvm.tune.tune_graph", lambda *a, **k: calls.append(a))
    assert not was_tuned(graph, resolve_target("llvm"))
    kiln.compile(graph, tune=2)
    assert len(calls) == 1
    (path / DONE_FILE).write_text("{}")
    assert was_tuned(graph, resolve_target("llvm"))
    check_matches_interpreter(graph, kiln.compile(graph, tune=2))
    assert len(calls) == 1


def test_progress_bar_counts_the_records_as_they_land() -> None:
    path = write_database(matmul_relu())
    with stderr_terminal() as tty, _Progress(path, total=4, interval=0.01):
        time.sleep(0.05)
    lines = tty.getvalue().split("\r")
    assert lines[-1].startswith("kiln tune [" + "#" * 7 + "." * 23 + "] 1/4 trials, ") and lines[-1].endswith("s\n")
    assert len(lines) > 2  # redrawn while it ran, not only at the end


def test_progress_off_a_terminal_is_two_summary_lines(capsys: pytest.CaptureFixture) -> None:
    """Logs and pipes (capsys's stderr is not a terminal) get no redraws, however long the run."""
    path = write_database(matmul_relu())
    with _Progress(path, total=4, interval=0.01):
        time.sleep(0.05)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert err.splitlines() == [f"kiln tune: 4 trials into {path}", err.splitlines()[1]]
    assert re.fullmatch(r"kiln tune: 1/4 trials, \d+s", err.splitlines()[1])


def test_tune_rejects_what_it_cannot_tune(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = Builder("Dyn")
    x = b.input("x", ((None, 8), "f32"))
    b.ret(b.relu(x))
    dynamic = b.build()
    with pytest.raises(KilnError, match="static shapes"):
        tune_graph(dynamic, trials=1)
    with pytest.raises(KilnError, match="LLVM"):
        tune_graph(matmul_relu(), target="cuda", trials=1)
    with pytest.raises(KilnError, match="trials"):
        tune_graph(matmul_relu(), trials=0)
    src = tmp_path / "dyn.kir"
    src.write_text(print_graph(dynamic))
    assert cli_main(["tune", str(src), "--trials", "2"]) == 1
    assert "static shapes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["tune", str(src), "--target", "cuda"])


@slow
def test_tune_graph_end_to_end(cache_root: Path, caplog: pytest.LogCaptureFixture) -> None:
    graph = matmul_relu()
    path = tune_graph(graph, trials=4, progress=False)
    assert path.parent == cache_root / "tuning"
    assert (path / WORKLOAD_FILE).stat().st_size > 0 and (path / RECORD_FILE).is_file()
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    exe = compile_graph(graph)
    assert [r.kiln_tuned_kernels for r in applied(caplog)] == kept_kernels(path)
    check_matches_interpreter(graph, exe)
    caplog.clear()
    other = matmul_relu(n=16)
    check_matches_interpreter(other, compile_graph(other))
    assert applied(caplog) == []


@slow
def test_cli_tune_and_compile_option(tmp_path: Path, capsys: pytest.CaptureFixture,
                                     caplog: pytest.LogCaptureFixture) -> None:
    graph = matmul_relu()
    src = tmp_path / "tiny.kir"
    src.write_text(print_graph(graph))
    assert cli_main(["tune", str(src), "--trials", "2", "-q"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert (path / RECORD_FILE).is_file()
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    exe = kiln.compile(graph, tune=2)  # tuned already: no second tuning run, and the build applies what was kept
    assert [r.kiln_tuned_kernels for r in applied(caplog)] == kept_kernels(path)
    check_matches_interpreter(graph, exe)


def test_the_done_mark_is_written_whole_or_not_at_all(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    mark_done(tmp_path, {"trials": 2, "kept": 1, "dropped": 0})
    assert json.loads((tmp_path / DONE_FILE).read_text()) == {"trials": 2, "kept": 1, "dropped": 0}
    (tmp_path / DONE_FILE).unlink()
    request.getfixturevalue("failing_fsync")
    with pytest.raises(OSError, match="Input/output error"):
        mark_done(tmp_path, {"trials": 2, "kept": 1, "dropped": 0})
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_prune_leaves_the_records_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_database(matmul_relu(), run_secs=10.0)  # slower than the rules: pruning rewrites the records
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    monkeypatch.setattr(tune_prune, "rules_seconds", lambda mod, target: 1.0)
    opened = []
    real = ms.database.JSONDatabase

    def interrupted(*args, **kwargs):
        opened.append(kwargs)
        if len(opened) == 2:  # the pruned copy, written into the temporary records file
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ms.database, "JSONDatabase", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prune_database(path, resolve_target("llvm"), WORKLOAD_FILE, RECORD_FILE)
    assert len(opened) == 2 and opened[1]["path_tuning_record"] != str(path / RECORD_FILE)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
