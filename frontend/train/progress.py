"""The Learner's progress display: on a terminal, a bar redrawn in place with the step's metrics and an ETA; on
anything else (a log file, a pipe) one plain line per epoch, never a redraw."""

from __future__ import annotations

import time
from typing import TextIO

from kiln.runtime.progress import is_terminal


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes:d}:{secs:02d}"


class ProgressBar:
    """`title [#####.....] done/total text ETA m:ss` while an epoch runs; `close` leaves the summary line."""

    def __init__(self, title: str, total: int | None, stream: TextIO, width: int = 24):
        self.title, self.total, self.stream, self.width = title, total, stream, width
        self.tty = is_terminal(stream)
        self.start = time.monotonic()
        self.first: int | None = None  # the first step this process ran: a resumed epoch's ETA counts from it

    def update(self, done: int, text: str) -> None:
        if not self.tty:
            return
        if self.first is None:
            self.first, self.start = done - 1, time.monotonic()
        ran, elapsed = done - self.first, time.monotonic() - self.start
        if self.total:
            filled = self.width * done // self.total
            eta = elapsed / ran * (self.total - done)
            line = f"{self.title} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {text} " \
                   f"ETA {_clock(eta)}"
        else:
            line = f"{self.title} {done} {text}"
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()

    def close(self, text: str) -> None:
        line = f"{self.title} {text} ({time.monotonic() - self.start:.1f}s)"
        self.stream.write(f"\r{line}\x1b[K\n" if self.tty else line + "\n")
        self.stream.flush()
