"""Training checkpoints: a folder `step-<n>/` holding the model record (`model.bpk`), the optimizer state
(`optimizer.bpk`) and `checkpoint.json` (counters, scheduler and RNG state, data position, log offset, early
stopping, SHA-256 of both records). The folder is staged and renamed into place (`kiln.runtime.atomic`), so a
checkpoint is whole or absent; a damaged one is refused with a RecordError naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kiln.ir import RecordError
from kiln.runtime.atomic import atomic_file, atomic_folder
from kiln.runtime.records.record import ModuleRecord

from ..module import Module
from ..optim.optimizer import Optimizer

FORMAT = 1
MANIFEST = "checkpoint.json"
_RECORDS = ("model.bpk", "optimizer.bpk")
_NAME = re.compile(r"step-(\d+)")
M = TypeVar("M", bound=Module)


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often the Learner checkpoints: every `every_steps` steps and/or `every_seconds` seconds (and
    at each epoch's end), keeping the newest `keep`."""

    directory: str | os.PathLike[str]
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int = 3

    def __post_init__(self) -> None:
        for name in ("every_steps", "every_seconds"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"Checkpointing.{name} must be positive, got {value}")
        if self.keep < 1:
            raise ValueError(f"Checkpointing.keep must be at least 1, got {self.keep}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint folders in `directory`, oldest first (staged folders of killed writers are not listed)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(int(m[1]), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def save(directory: str | os.PathLike[str], step: int, model: Module, optimizer: Optimizer, state: dict[str, Any],
         keep: int) -> Path:
    """Write checkpoint `step` whole, then delete all but the newest `keep`; returns its folder."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    destination = root / f"step-{step:09d}"
    with atomic_folder(destination) as staged:
        model.save_file(staged / "model.bpk")
        optimizer.to_record().save(staged / "optimizer.bpk")
        manifest = {"format": FORMAT, **state, "files": {name: _sha256(staged / name) for name in _RECORDS}}
        with atomic_file(staged / MANIFEST) as out:
            out.write(json.dumps(manifest, indent=1).encode())
    for old in checkpoints(root)[:-keep]:
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    return destination


def resolve(path: str | os.PathLike[str]) -> Path:
    """`path` itself if it is a checkpoint folder, else the newest checkpoint in it."""
    path = Path(path)
    if (path / MANIFEST).exists() or _NAME.fullmatch(path.name):
        return path
    found = checkpoints(path)
    if not found:
        raise RecordError(f"no checkpoint to resume from in {str(path)!r}")
    return found[-1]


def load(path: str | os.PathLike[str], model: M, optimizer: Optimizer) -> tuple[M, Optimizer, dict[str, Any]]:
    """The model and optimizer as checkpoint `path` (or the newest in that folder) holds them, and its state;
    every file is verified first."""
    folder = resolve(path)
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as error:
        raise RecordError(f"{manifest_path}: not a readable checkpoint manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"),
                                                                                             dict):
        raise RecordError(f"{manifest_path}: not a kiln checkpoint manifest of format {FORMAT}")
    for name in _RECORDS:
        file = folder / name
        try:
            digest = _sha256(file)
        except OSError as error:
            raise RecordError(f"{file}: cannot be read ({error.strerror})") from None
        if digest != manifest["files"].get(name):
            raise RecordError(f"{file}: damaged (its SHA-256 differs from the one {MANIFEST} recorded)")
    loaded = model.try_load_file(folder / "model.bpk")
    return loaded, optimizer.load_record(ModuleRecord.load(folder / "optimizer.bpk")), manifest
