"""A tuning database on disk: checked before a build uses it, and rewritten so that a killed `kiln tune` leaves the
previous or the new complete database (issue 15).

MetaSchedule's JSONDatabase is two JSON-lines files it appends to while it tunes: workloads (`[hash, module]`) and
records (`[workload index, [trace, run seconds, target, argument info]]`). A run works on a staging copy and then
installs the files one by one in an order every reader tolerates: the workloads first (a staged file only extends
the previous one, so the previous records still index the same workloads), then the done mark, which holds the
digests of the new and of the previous records, then the records; a records file changed or cut at a line boundary
matches neither.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from kiln.ir import KilnError
from kiln.runtime.atomic import atomic_file, install, staging_folder

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
DONE_FILE = "kiln_tuned.json"  # written last by a finished run: its budget, what pruning kept, the records' digest
FILES = (WORKLOAD_FILE, DONE_FILE, RECORD_FILE)  # the order a rewrite installs them in

_log = logging.getLogger(__name__)


class DamagedDatabase(KilnError):
    """A tuning database whose files are not what a finished kiln tuning run wrote; it is never applied."""


def records_digest(path: Path) -> str:
    """The digest of a database's records file, kept in its done mark."""
    return hashlib.blake2b((path / RECORD_FILE).read_bytes(), digest_size=16).hexdigest()


def _lines(path: Path, name: str) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON) of each non-blank line of one database file, which must be a regular file whose
    last line is finished."""
    file = path / name
    mode = file.lstat().st_mode
    if not stat.S_ISREG(mode):
        raise DamagedDatabase(f"tuning database {path}: {name} is not a regular file")
    data = file.read_bytes()
    if data and not data.endswith(b"\n"):
        raise DamagedDatabase(f"tuning database {path}: {name} is truncated (its last line is unfinished)")
    for number, line in enumerate(data.splitlines(), 1):
        if line.strip():
            try:
                yield number, json.loads(line)
            except (ValueError, RecursionError) as e:
                raise DamagedDatabase(f"tuning database {path}: {name} line {number} is not JSON ({e})") from None


def check_database(path: Path) -> None:
    """Raise `DamagedDatabase` naming the file and line unless the database at `path` is whole: every line a
    workload or a record of the expected shape, every record indexing a workload, and the records matching the done
    mark's digest where a mark has one."""
    workloads = 0
    for number, line in _lines(path, WORKLOAD_FILE):
        if not (isinstance(line, list) and len(line) == 2 and all(isinstance(v, str) for v in line)):
            raise DamagedDatabase(f"tuning database {path}: {WORKLOAD_FILE} line {number} is not a workload")
        workloads += 1
    for number, line in _lines(path, RECORD_FILE):
        if not (isinstance(line, list) and len(line) == 2 and type(line[0]) is int and isinstance(line[1], list)
                and len(line[1]) >= 2):
            raise DamagedDatabase(f"tuning database {path}: {RECORD_FILE} line {number} is not a tuning record")
        if not 0 <= line[0] < workloads:
            raise DamagedDatabase(f"tuning database {path}: {RECORD_FILE} line {number} names workload {line[0]}, "
                                  f"but {WORKLOAD_FILE} has {workloads}")
    if not (path / DONE_FILE).exists():
        return
    try:
        mark = json.loads((path / DONE_FILE).read_bytes())
    except (ValueError, RecursionError):
        mark = None
    if not isinstance(mark, dict):
        raise DamagedDatabase(f"tuning database {path}: {DONE_FILE} is not a JSON object")
    digests = mark.get("records")  # absent in a mark without records, and in marks kiln wrote before it had them
    if digests is not None and (not isinstance(digests, list) or records_digest(path) not in digests):
        raise DamagedDatabase(f"tuning database {path}: {RECORD_FILE} is not the one its finished run wrote "
                              f"({DONE_FILE} holds another digest)")


def damage(path: Path) -> DamagedDatabase | None:
    """The reason the database at `path` must not be used, or None when it is whole."""
    try:
        check_database(path)
    except DamagedDatabase as e:
        return e
    except OSError as e:
        return DamagedDatabase(f"tuning database {path}: cannot be read ({e.strerror or e})")
    return None


def mark_done(path: Path, summary: dict[str, int], replaces: str | None = None) -> None:
    """Write `DONE_FILE`, the mark of a finished run, with the digest of its records and of the records they
    `replaces` (valid until the new ones are installed), atomically: an interrupted write leaves the run unmarked."""
    digests = [records_digest(path)] if (path / RECORD_FILE).is_file() else []
    digests += [replaces] if replaces else []
    mark = {**summary, "records": digests} if digests else summary
    with atomic_file(path / DONE_FILE) as f:
        f.write(json.dumps(mark).encode("utf-8"))


@contextlib.contextmanager
def rewrite_database(path: Path) -> Iterator[Path]:
    """A staging folder holding a copy of the database at `path` (none when there is none, or when it is damaged:
    then its files are removed, with a warning, and the run rebuilds it), installed over `path` file by file when the
    block finishes; a killed or failed run leaves `path` as it was, and its staging folder is removed by the next."""
    path.mkdir(parents=True, exist_ok=True)
    reason = damage(path) if (path / WORKLOAD_FILE).exists() or (path / RECORD_FILE).exists() else None
    if reason is not None:
        _log.warning("%s; rebuilding it", reason)
        for name in reversed(FILES):  # the records go before the workloads they index
            (path / name).unlink(missing_ok=True)
    previous = records_digest(path) if (path / RECORD_FILE).is_file() else None
    with staging_folder(path) as stage:
        for name in FILES:
            if (path / name).is_file():
                shutil.copyfile(path / name, stage / name)
        yield stage
        if (stage / DONE_FILE).is_file():
            summary = json.loads((stage / DONE_FILE).read_bytes())
            mark_done(stage, {k: v for k, v in summary.items() if k != "records"}, replaces=previous)
        for name in FILES:
            if (stage / name).is_file():
                install(stage / name, path / name)
        if (stage / "logs").is_dir():  # MetaSchedule's own log of the run, kept beside the database
            shutil.rmtree(path / "logs", ignore_errors=True)
            (stage / "logs").rename(path / "logs")
