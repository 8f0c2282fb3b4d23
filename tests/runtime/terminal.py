"""A fake terminal for output meant only for terminals (status lines, progress bars)."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager


class FakeTerminal(io.StringIO):
    """A captured stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@contextmanager
def stderr_terminal() -> Iterator[FakeTerminal]:
    """stderr replaced by a `FakeTerminal` inside the block (a fixture's patch would be undone by pytest's capture)."""
    tty, old = FakeTerminal(), sys.stderr
    sys.stderr = tty
    try:
        yield tty
    finally:
        sys.stderr = old
