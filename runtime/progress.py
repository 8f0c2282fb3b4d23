"""What long work tells the user: each stage timed on the `kiln.compile` logger, and a one-line status on stderr
while a stage runs over a second, only when stderr is a terminal (logs and pipes never get redraws)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

log = logging.getLogger("kiln.compile")

STATUS_DELAY = 1.0  # seconds a stage runs before its status line appears
STATUS_INTERVAL = 0.5  # seconds between redraws of the status line


def is_terminal(stream: TextIO) -> bool:
    """Whether `stream` is an interactive terminal (a closed or detached stream is not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class _Status:
    """`kiln: <what>... Ns` redrawn in place on `stream` from `delay` seconds on, erased when the stage ends."""

    def __init__(self, what: str, stream: TextIO, delay: float):
        self.what, self.stream, self.delay = what, stream, delay
        self.start = time.monotonic()
        self.shown = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._stop.wait(self.delay):
            return
        while True:
            self.stream.write(f"\rkiln: {self.what}... {time.monotonic() - self.start:.0f}s")
            self.stream.flush()
            self.shown = True
            if self._stop.wait(STATUS_INTERVAL):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self.shown:
            self.stream.write("\r\x1b[K")  # erase the status line; the log keeps the record
            self.stream.flush()


@contextmanager
def stage(what: str, delay: float = STATUS_DELAY) -> Iterator[None]:
    """Run a stage of long work: log `what` and its seconds at INFO on `kiln.compile` when it ends, and show a
    status line on stderr while it runs past `delay` seconds if stderr is a terminal."""
    stream = sys.stderr
    status = _Status(what, stream, delay) if is_terminal(stream) else None
    start = time.monotonic()
    try:
        yield
    finally:
        if status is not None:
            status.close()
    log.info("%s: %.2fs", what, time.monotonic() - start)
