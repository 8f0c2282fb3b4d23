"""Tests for kiln.runtime.atomic: the destination is the old file or the whole new one, never a half-written one."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main as cli_main
from kiln.runtime.atomic import atomic_file, atomic_path


@pytest.fixture
def old(tmp_path: Path) -> Path:
    path = tmp_path / "out.bin"
    path.write_bytes(b"the old contents, longer than the new")
    return path


def write_with_path(destination: Path, data: bytes) -> None:
    with atomic_path(destination) as temporary:
        temporary.write_bytes(data)


def write_with_file(destination: Path, data: bytes) -> None:
    with atomic_file(destination) as out:
        out.write(data)


WRITERS = pytest.mark.parametrize("write", [write_with_path, write_with_file], ids=["path", "file"])


@WRITERS
def test_success_replaces_the_destination_whole_and_leaves_no_temporary(write, old: Path) -> None:
    write(old, b"new")
    assert old.read_bytes() == b"new"
    assert list(old.parent.iterdir()) == [old]


@WRITERS
def test_success_creates_a_missing_destination(write, tmp_path: Path) -> None:
    write(tmp_path / "fresh.bin", b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["fresh.bin"]


def fail_with_path(destination: Path, error: type[BaseException]) -> None:
    with atomic_path(destination) as temporary:
        temporary.write_bytes(b"n")  # half-written
        raise error("writer failed")


def fail_with_file(destination: Path, error: type[BaseException]) -> None:
    with atomic_file(destination) as out:
        out.write(b"n")
        out.flush()
        raise error("writer failed")


@pytest.mark.parametrize("fail", [fail_with_path, fail_with_file], ids=["path", "file"])
@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt, SystemExit])
def test_a_failing_writer_leaves_the_destination_and_no_temporary(fail, error: type[BaseException],
                                                                  old: Path) -> None:
    before = old.read_bytes()
    with pytest.raises(error, match="writer failed"):
        fail(old, error)
    assert old.read_bytes() == before
    assert list(old.parent.iterdir()) == [old]


def test_the_temporary_is_a_hidden_sibling_with_the_suffix(old: Path) -> None:
    with atomic_path(old, ".so") as temporary:
        assert temporary.parent == old.parent and temporary.exists() and temporary.read_bytes() == b""
        assert temporary.name.startswith(f".{old.name}.") and temporary.name.endswith(".tmp.so")
    assert not temporary.exists()


def test_file_then_folder_are_fsynced_around_the_rename(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[tuple[bool, int, bytes]] = []  # (is a folder, inode, destination's contents at that moment)
    real_fsync = os.fsync

    def record(descriptor: int) -> None:
        info = os.fstat(descriptor)
        synced.append((stat.S_ISDIR(info.st_mode), info.st_ino, old.read_bytes()))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", record)
    write_with_file(old, b"new")
    old_contents = b"the old contents, longer than the new"
    assert synced == [(False, old.stat().st_ino, old_contents), (True, old.parent.stat().st_ino, b"new")]


def test_a_failing_fsync_leaves_the_destination_and_no_temporary(old: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = old.read_bytes()

    def fail(descriptor: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="Input/output"):
        write_with_path(old, b"new")
    assert old.read_bytes() == before
    assert list(old.parent.iterdir()) == [old]


def test_a_missing_folder_is_an_os_error_naming_it_and_creating_nothing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        write_with_file(tmp_path / "missing" / "out.bin", b"new")
    assert caught.value.filename == str(tmp_path / "missing")
    assert list(tmp_path.iterdir()) == []


@WRITERS
def test_a_folder_destination_is_refused_by_its_name(write, tmp_path: Path) -> None:
    """issue 15: `kiln opt -o DIR` reported the hidden temporary's name, not the user's path."""
    with pytest.raises(IsADirectoryError) as caught:
        write(tmp_path, b"new")
    assert caught.value.filename == str(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["opt", "-p", "dce"], ["compile"]])
def test_the_command_line_names_a_missing_output_folder_and_creates_none(
        command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """issue 15: `kiln compile -o /nonexistent/x.so` created /nonexistent and exited 0; it must exit 3 (I/O)."""
    source = tmp_path / "in.kir"
    source.write_text("module @M {\n  func @forward(%x: tensor<2xf32>) -> (tensor<2xf32>) {\n    return %x\n  }\n}\n")
    missing = tmp_path / "missing" / "deeper"
    assert cli_main([command[0], str(source), *command[1:], "-o", str(missing / "out")]) == 3
    assert f"error: {missing}: no such folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.kir"]


def test_new_files_get_the_umask_permissions(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_with_file(tmp_path / "out.bin", b"x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out.bin").stat().st_mode) == 0o644


def test_records_and_the_helper_import_neither_tvm_nor_onnx() -> None:
    code = ("import sys, kiln.runtime.atomic, kiln.runtime.records.record, kiln.runtime.records.qfloat; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'onnx', 'onnxruntime')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_kiln_opt_output_is_replaced_whole_or_not_at_all(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The command line's `-o` writes through the helper too."""
    source, output = tmp_path / "in.kir", tmp_path / "out.kir"
    source.write_text("module @M {\n  func @forward(%x: tensor<2xf32>) -> (tensor<2xf32>) {\n    return %x\n  }\n}\n")
    output.write_text("old")
    assert cli_main(["opt", str(source), "-p", "dce", "-o", str(output)]) == 0
    assert "@forward" in output.read_text()
    output.write_text("old")
    request.getfixturevalue("failing_fsync")
    assert cli_main(["opt", str(source), "-p", "dce", "-o", str(output)]) == 3
    assert output.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.kir", "out.kir"]


def _killed_writer(destination: Path) -> Path:
    """Start a process writing `destination` through the helper, kill it mid-write (SIGKILL: no cleanup runs)
    and return the temporary it left."""
    code = ("import sys, time; from pathlib import Path; from kiln.runtime.atomic import atomic_file\n"
            "with atomic_file(Path(sys.argv[1])) as out:\n"
            "    out.write(b'partial' * 1000); out.flush(); print('writing', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(destination)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    child.kill()
    child.wait()
    (left,) = [p for p in destination.parent.iterdir() if p.name.startswith(f".{destination.name}.")]
    return left


def test_the_next_write_removes_the_temporary_a_killed_writer_left(old: Path) -> None:
    """issue 15: every kill -9 during a save left a full-size hidden temporary that nothing removed."""
    left = _killed_writer(old)
    assert left.stat().st_size == 7000 and old.read_bytes().startswith(b"the old contents")
    unrelated = old.with_name(f".{old.name}.notes")  # a hidden sibling that is not a temporary
    unrelated.write_text("keep me")
    write_with_file(old, b"new")
    assert sorted(p.name for p in old.parent.iterdir()) == sorted([old.name, unrelated.name])


def test_a_live_writers_temporary_is_kept(old: Path) -> None:
    """Two processes may save one path at once: the other's temporary is not an orphan while it runs."""
    with atomic_path(old) as mine:
        write_with_file(old, b"concurrent")
        assert mine.exists()
        mine.write_bytes(b"mine")
    assert old.read_bytes() == b"mine" and list(old.parent.iterdir()) == [old]
