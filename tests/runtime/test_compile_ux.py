"""What compiling tells and does to the user: `kiln compile` builds in valid state unless `--train-state`,
`kiln.compile` warns about training flags, every stage is logged with its seconds on `kiln.compile`, and status
lines go to terminals only."""

from __future__ import annotations

import io
import logging
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from terminal import stderr_terminal

import kiln
from kiln import nn
from kiln.cli import main as cli_main
from kiln.ir import Builder, Graph, ShapeError, TrainingStateWarning, print_graph
from kiln.runtime import progress
from kiln.runtime.tvm.executable import Executable, load_executable

pytestmark = pytest.mark.usefixtures("cache_root")  # every test gets an empty compile cache

P = 0.3


def dropout_graph() -> Graph:
    """A module whose one flag (a dropout's training flag) is on, as a freshly built model's is."""
    b = Builder("Drop")
    x = b.input("x", ((None, 300), "f32"))
    b.ret(b.dropout(x, b.flag("training", True), p=P, seed=11))
    return b.build()


def compile_cli(tmp_path: Path, *extra: str) -> Executable:
    src = tmp_path / "drop.kir"
    src.write_text(print_graph(dropout_graph()))
    out = tmp_path / f"drop{len(extra)}.so"
    assert cli_main(["compile", str(src), "-o", str(out), *extra]) == 0
    return load_executable(str(out))


def test_kiln_compile_builds_in_valid_state_as_export_onnx_does(tmp_path: Path) -> None:
    """Spec, `valid`: "Returns a validation snapshot without autodiff or active training flags." Dropout in
    valid state is the identity (numpy: y == x), whatever the run seed."""
    exe = compile_cli(tmp_path)
    x = np.random.default_rng(0).standard_normal((64, 300)).astype(np.float32)
    for seed in (0, 1, 2):
        np.testing.assert_array_equal(exe.run(x, seed=seed)[0], x)


def test_kiln_compile_train_state_keeps_dropout_training(tmp_path: Path) -> None:
    """`--train-state` keeps the file's state: training dropout zeroes about p of the values, scales the rest by
    1/(1-p) (torch's and Burn's inverted dropout), and draws a new mask for another run seed."""
    exe = compile_cli(tmp_path, "--train-state")
    x = np.ones((200, 300), np.float32)
    a = exe.run(x, seed=5)[0]
    assert set(np.unique(a)) <= {0.0, np.float32(1.0) / np.float32(1 - P)}
    assert abs((a == 0).mean() - P) < 0.02
    assert (exe.run(x, seed=6)[0] != a).any()


def test_kiln_compile_help_documents_the_state(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli_main(["compile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "put in valid state first" in text and "--train-state keep the module's state" in text


def test_kiln_compile_verbose_logs_every_stage_with_seconds(tmp_path: Path, capsys: pytest.CaptureFixture
                                                            ) -> None:
    compile_cli(tmp_path, "-v")
    err = capsys.readouterr().err
    for stage in ("passes: valid", "lowering @Drop to Relax", "building @Drop for llvm", "writing "):
        assert re.search(rf"^kiln: {re.escape(stage)}.*: \d+\.\d\ds$", err, re.M), (stage, err)
    assert re.search(r"^kiln: compile cache miss for @Drop", err, re.M)
    assert not logging.getLogger("kiln.compile").handlers  # the handler left with the command


class Net(kiln.Module):
    def __init__(self, dropout: bool = True):
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5) if dropout else None

    def forward(self, x):
        y = self.fc(x)
        return self.drop(y) if self.drop is not None else y


def compiles(model: kiln.Module) -> list[warnings.WarningMessage]:
    """The TrainingStateWarnings of compiling `model` three times from one call site, then once from another."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            kiln.compile(model, ((2, 4), "f32"))
        kiln.compile(model, ((2, 4), "f32"))
    return [w for w in caught if issubclass(w.category, TrainingStateWarning)]


def test_compiling_a_training_module_warns_once_per_call_site(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh model's flags are on (Burn's `Flag` starts active), so its build keeps training behaviour."""
    monkeypatch.setattr("kiln.frontend.warn_once.warned", set())
    caught = compiles(Net())
    assert len(caught) == 2 and caught[0].lineno != caught[1].lineno
    assert caught[0].filename == __file__
    message = str(caught[0].message)
    assert "drop.training" in message and "model.valid()" in message and "\n" not in message


@pytest.mark.parametrize("model", [Net().valid(), Net(dropout=False)], ids=["valid", "no-flags"])
def test_a_valid_or_flagless_module_compiles_without_warning(model: kiln.Module) -> None:
    assert compiles(model) == []


def test_kiln_compile_logs_trace_lowering_build_and_cache(caplog: pytest.LogCaptureFixture) -> None:
    model = Net(dropout=False)
    caplog.set_level(logging.INFO, logger="kiln.compile")
    kiln.compile(model, ((2, 4), "f32"))
    kiln.compile(model, ((2, 4), "f32"))
    messages = [r.getMessage() for r in caplog.records if r.name == "kiln.compile"]
    timed = [m for m in messages if re.fullmatch(r".*: \d+\.\d\ds", m)]
    assert [m.rsplit(":", 1)[0] for m in timed] == ["tracing Net", "lowering @Net to Relax", "building @Net for llvm",
                                                   "storing @Net in the compile cache", "tracing Net"]
    cache = [m.split(" (")[0] for m in messages if m.startswith("compile cache")]
    assert cache == ["compile cache miss for @Net", "compile cache hit for @Net"]


def test_a_long_stage_shows_a_status_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "STATUS_INTERVAL", 0.01)
    with stderr_terminal() as tty:
        with progress.stage("building @M for llvm", delay=0.02):
            time.sleep(0.1)
        text = tty.getvalue()
        with progress.stage("quick", delay=5):
            pass
    assert text.startswith("\rkiln: building @M for llvm... 0s") and text.count("\r") > 2
    assert text.endswith("\r\x1b[K")  # erased when the stage ends
    assert tty.getvalue() == text  # a stage under the delay shows nothing


def test_no_status_line_is_written_to_a_non_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = io.StringIO()
    monkeypatch.setattr("sys.stderr", pipe)
    with progress.stage("building @M for llvm", delay=0.0):
        time.sleep(0.05)
    assert pipe.getvalue() == ""


def test_a_module_with_dropout_retraces_to_the_same_graph_and_hits_the_cache(
        caplog: pytest.LogCaptureFixture) -> None:
    """Stochastic ops are numbered within their trace, so a retrace keys the same build; masks still come from
    the run seed: inverted dropout keeps each value as 0 or x / (1 - p) and differs between run seeds."""
    model = Net()
    assert print_graph(kiln.trace(model, ((2, 4), "f32"))) == print_graph(kiln.trace(model, ((2, 4), "f32")))
    caplog.set_level(logging.INFO, logger="kiln.compile")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrainingStateWarning)  # training dropout is the point here
        kiln.compile(model, ((64, 4), "f32"))
        exe = kiln.compile(model, ((64, 4), "f32"))
    cache = [r.getMessage().split(" (")[0] for r in caplog.records if r.getMessage().startswith("compile cache")]
    assert cache == ["compile cache miss for @Net", "compile cache hit for @Net"]
    x = np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)
    dense = model.fc(kiln.tensor(x)).numpy()  # the layer before the dropout, eagerly
    a, b = exe.run(x, seed=1)[0], exe.run(x, seed=2)[0]
    for out in (a, b):
        kept = out != 0
        np.testing.assert_allclose(out[kept], dense[kept] / 0.5, rtol=1e-5)
    assert (a != b).any()


def test_kiln_compile_plans_a_dynamic_batch_only_when_asked(tmp_path: Path) -> None:
    """A library serves any batch by default; `--max-batch N` plans its memory for batches up to N, and it then
    refuses a larger one with a ShapeError naming the bound (a loaded library has no unbounded build to fall back
    to). The oracle is valid-state dropout, the identity."""
    x = np.ones((200, 300), np.float32)
    assert compile_cli(tmp_path).signatures["forward"].bounds == ()
    np.testing.assert_array_equal(compile_cli(tmp_path).run(x)[0], x)
    bounded = compile_cli(tmp_path, "--max-batch", "256")
    assert bounded.signatures["forward"].bounds == ((0, 0, 256),)
    np.testing.assert_array_equal(bounded.run(x)[0], x)
    small = compile_cli(tmp_path, "--max-batch", "8", "-v")
    with pytest.raises(ShapeError, match="has 200 on axis 0, past the 8 this build planned its memory for"):
        small.run(x)
