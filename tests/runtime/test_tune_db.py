"""Tuning databases under killed writers and damage (issue 15: "A kill test for every writer: ... tuning databases
...: kill at random points, then check that the previous or the new complete file is there and no stray temp files
remain after the next write"; "Corrupted, truncated or swapped entries are rebuilt, never used").

The writer is `rewrite_database` around MetaSchedule's own JSONDatabase (`tuning_writer`), what `tune_graph` runs
around its search; it is killed in a forked copy of this process (TVM is imported once, not per kill)."""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from tuning_writer import BATCH, tune_once

from kiln.ir import Builder, interpret
from kiln.runtime.tvm import tune
from kiln.runtime.tvm.compile import compile_graph
from kiln.runtime.tvm.target import resolve_target
from kiln.runtime.tvm.tune import find_database, record_count, tuning_dir, was_tuned
from kiln.runtime.tvm.tune_db import DONE_FILE, RECORD_FILE, WORKLOAD_FILE, damage, rewrite_database

pytestmark = pytest.mark.usefixtures("cache_root")


def records(path: Path) -> list[str]:
    return (path / RECORD_FILE).read_text().splitlines()


def kill_a_writer(path: Path, rng: random.Random, run_seconds: float) -> None:
    """Fork a copy of this process that rewrites the database at `path` in a loop; once it has finished one run,
    SIGKILL it at a random point within about two runs' time."""
    done_reader, done_writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child never returns
        try:
            os.close(done_reader)
            run = 0
            while True:
                tune_once(path, run)
                os.write(done_writer, b".")
                run += 1
        finally:
            os._exit(0)
    os.close(done_writer)
    assert os.read(done_reader, 1) == b"."  # it wrote a whole run (the machine's load does not matter)
    time.sleep(rng.uniform(0.0, 2.0 * run_seconds))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(done_reader)


def test_a_killed_tuning_run_leaves_the_previous_or_the_new_database(tmp_path: Path) -> None:
    path = tmp_path / "tuning" / "key"
    start = time.monotonic()
    tune_once(path, 0)
    run_seconds = time.monotonic() - start
    rng = random.Random(3)
    counts = [record_count(path)]
    for _ in range(6):
        kill_a_writer(path, rng, run_seconds)
        assert damage(path) is None  # whole: every record indexes a workload and matches the done mark
        counts.append(record_count(path))
        assert counts[-1] % BATCH == 0 and counts[-1] >= counts[-2], counts  # whole runs only, none lost
    assert counts[-1] >= counts[0] + 6 * BATCH, counts  # each killed writer finished a run first
    tune_once(path, 1)
    assert [p.name for p in path.parent.iterdir()] == ["key"]  # the next write removed them
    assert sorted(p.name for p in path.iterdir()) == sorted([WORKLOAD_FILE, RECORD_FILE, DONE_FILE])


def cut_mid_line(path: Path) -> None:
    data = (path / RECORD_FILE).read_bytes()
    (path / RECORD_FILE).write_bytes(data[: len(data) - 7])


def cut_a_whole_line(path: Path) -> None:
    (path / RECORD_FILE).write_text("".join(line + "\n" for line in records(path)[:-1]))


def garbage_line(path: Path) -> None:
    (path / WORKLOAD_FILE).write_text((path / WORKLOAD_FILE).read_text() + "{not json\n")


def wrong_shape(path: Path) -> None:
    (path / RECORD_FILE).write_text('{"workload": 0}\n')


def index_past_the_workloads(path: Path) -> None:
    line = json.loads(records(path)[0])
    (path / RECORD_FILE).write_text(json.dumps([99, line[1]]) + "\n")


def link_to_dev_zero(path: Path) -> None:
    (path / RECORD_FILE).unlink()
    (path / RECORD_FILE).symlink_to("/dev/zero")


def broken_mark(path: Path) -> None:
    (path / DONE_FILE).write_text("[1, 2")


DAMAGE = {
    "records cut mid-line": (cut_mid_line, "truncated"),
    "records cut at a line boundary": (cut_a_whole_line, "not the one its finished run wrote"),
    "a line that is not JSON": (garbage_line, "line 3 is not JSON"),
    "a record of the wrong shape": (wrong_shape, "line 1 is not a tuning record"),
    "a record naming a missing workload": (index_past_the_workloads, "names workload 99"),
    "records that link to /dev/zero": (link_to_dev_zero, "not a regular file"),
    "a done mark that is not JSON": (broken_mark, "is not a JSON object"),
}


@pytest.mark.parametrize("case", DAMAGE)
def test_a_damaged_database_is_refused_then_rebuilt(case: str, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tuning" / "key"
    tune_once(path, 0)
    tune_once(path, 1)
    spoil, message = DAMAGE[case]
    spoil(path)
    reason = damage(path)
    assert reason is not None and message in str(reason) and str(path) in str(reason), reason
    assert len(str(reason).splitlines()) == 1
    caplog.set_level(logging.WARNING, logger="kiln.runtime.tvm.tune_db")
    with rewrite_database(path) as stage:  # the next run starts from nothing, saying why
        assert not (stage / RECORD_FILE).exists() and not (stage / WORKLOAD_FILE).exists()
    assert any("rebuilding it" in r.getMessage() and message in r.getMessage() for r in caplog.records)
    tune_once(path, 2)
    assert damage(path) is None and record_count(path) == BATCH


def test_a_build_never_applies_a_damaged_database(caplog: pytest.LogCaptureFixture,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """find_database, which every build asks, reports the damage and answers None: the build uses kiln's rules
    and a `kiln.compile(tune=N)` tunes again."""
    b = Builder("Tiny")
    x = b.input("x", ((4, 8), "f32"))
    b.ret(b.relu(x))
    graph = b.build()
    target = resolve_target("llvm")
    path = tuning_dir(graph, target)
    tune_once(path, 0)
    assert find_database(graph, target) == path and was_tuned(graph, target)
    cut_mid_line(path)
    caplog.set_level(logging.INFO, logger="kiln.runtime.tvm.tune")
    assert find_database(graph, target) is None and not was_tuned(graph, target)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "truncated" in warning.getMessage() and "kiln's schedule rules" in warning.getMessage()
    applied = []
    monkeypatch.setattr(tune, "apply_database_pass", lambda *a: applied.append(a))
    data = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(compile_graph(graph)(data), interpret(graph, [data])[0])
    assert applied == []
