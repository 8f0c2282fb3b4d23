"""The Learner's metrics log files: JSON lines (one object per step and epoch) or CSV (one row each, under a header
of the columns the metrics give). Each record is written whole in one write and flushed, so a killed run leaves
complete lines only; a run resumed from a checkpoint cuts the file back to the checkpoint's offset and appends."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

LogFormat = Literal["jsonl", "csv"]
_SUFFIXES: dict[str, LogFormat] = {".csv": "csv"}  # any other suffix is JSON lines


def pick_format(path: str | os.PathLike[str], chosen: LogFormat | None) -> LogFormat:
    """The format a log is written in: `chosen`, else by the file's suffix (`.csv`; otherwise JSON lines)."""
    if chosen is not None and chosen not in ("jsonl", "csv"):
        raise ValueError(f"log_format must be 'jsonl' or 'csv', got {chosen!r}")
    return chosen or _SUFFIXES.get(Path(path).suffix.lower(), "jsonl")


def columns(metric_names: Sequence[str], splits: Sequence[str] = ("train", "valid")) -> list[str]:
    """A CSV log's header: the record's counters, each metric per step, then per epoch for every split."""
    return ["event", "epoch", "step", *metric_names, *(f"{s}_{m}" for s in splits for m in metric_names)]


class MetricsLog:
    """An open log at byte `offset` (what came after it is dropped); `write` returns the offset after a record."""

    def __init__(self, path: Path, fmt: LogFormat, header: Sequence[str], offset: int):
        self.fmt, self.header = fmt, list(header)
        self.file = open(path, "r+b" if path.exists() else "wb")
        self.file.truncate(offset)
        self.file.seek(offset)
        if fmt == "csv" and offset == 0:
            self._put(self._row(dict(zip(self.header, self.header))))

    def _row(self, record: dict[str, Any]) -> str:
        unknown = [k for k in record if k not in self.header]
        if unknown:
            raise ValueError(f"CSV metrics log: column {unknown[0]!r} is not in its header ({', '.join(self.header)})")
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerow([record.get(k, "") for k in self.header])
        return text.getvalue()

    def _put(self, line: str) -> int:
        self.file.write(line.encode())
        self.file.flush()
        return self.file.tell()

    def write(self, record: dict[str, Any]) -> int:
        return self._put(json.dumps(record) + "\n" if self.fmt == "jsonl" else self._row(record))

    def close(self) -> None:
        self.file.close()
