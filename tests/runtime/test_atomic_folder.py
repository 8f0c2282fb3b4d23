"""kiln.runtime.atomic.atomic_folder: a folder of files appears whole under its name or not at all (the Learner's
checkpoints; a kill inside one is tests/frontend/train/test_train_checkpoint.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.runtime.atomic import atomic_file, atomic_folder


def test_the_folder_appears_only_when_complete(tmp_path: Path) -> None:
    destination = tmp_path / "ckpt"
    with atomic_folder(destination) as staged:
        with atomic_file(staged / "a.bin") as out:
            out.write(b"a")
        assert not destination.exists() and staged.parent == tmp_path and staged.name.startswith(".ckpt.")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and (destination / "a.bin").read_bytes() == b"a"


def test_a_failed_writer_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="disk on fire"), atomic_folder(tmp_path / "ckpt") as staged:
        (staged / "a.bin").write_bytes(b"a")
        raise RuntimeError("disk on fire")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_destination_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileExistsError, match="ckpt"), atomic_folder(tmp_path / "ckpt"):
        pass
