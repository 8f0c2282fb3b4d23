"""The Learner's progress display: on a terminal, a tqdm bar redrawn in place with the step's metrics and an ETA;
on anything else (a log file, a pipe) one plain line per epoch, never a redraw."""

from __future__ import annotations

import time
from typing import Any, TextIO

from tqdm import tqdm

from kiln.runtime.progress import is_terminal


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes:d}:{secs:02d}"


class _Bar(tqdm):
    """tqdm with kiln's ETA (`m:ss` from the steps this process ran: a resumed epoch counts from its first)."""

    @property
    def format_dict(self) -> dict[str, Any]:
        d = super().format_dict
        ran, left = d["n"] - d["initial"], (d["total"] or 0) - d["n"]
        d["eta"] = _clock(d["elapsed"] / ran * left if ran > 0 else 0.0)
        return d


class ProgressBar:
    """`title [#####.....] done/total, text ETA m:ss` while an epoch runs; `close` leaves the summary line."""

    def __init__(self, title: str, total: int | None, stream: TextIO, width: int = 24):
        self.title, self.total, self.stream, self.width = title, total, stream, width
        self.tty = is_terminal(stream)
        self.start = time.monotonic()
        self.bar: _Bar | None = None  # made at the first update: a resumed epoch starts where it stopped

    def update(self, done: int, text: str) -> None:
        if not self.tty:
            return
        if self.bar is None:
            self.start = time.monotonic()
            form = (f"{{desc}} [{{bar:{self.width}}}] {{n_fmt}}/{{total_fmt}}{{postfix}} ETA {{eta}}" if self.total
                    else "{desc} {n_fmt}{postfix}")
            self.bar = _Bar(total=self.total, initial=done - 1, desc=self.title, file=self.stream, ascii=".#",
                            bar_format=form, mininterval=0, leave=False)
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self, text: str) -> None:
        if self.bar is not None:
            self.bar.close()
        line = f"{self.title} {text} ({time.monotonic() - self.start:.1f}s)"
        self.stream.write(f"\r{line}\x1b[K\n" if self.tty else line + "\n")
        self.stream.flush()
