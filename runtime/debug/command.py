"""Running a user's check command on a module: the `.kir` text in a temporary file, its path appended to the
shell command; exit status 0 is success. `kiln opt --bisect` and `kiln reduce --test CMD` share it."""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from pathlib import Path

from kiln.ir import Graph, print_graph


def command_succeeds(command: str, graph: Graph) -> bool:
    with tempfile.TemporaryDirectory(prefix="kiln-check-") as folder:
        path = Path(folder) / "candidate.kir"
        path.write_text(print_graph(graph))
        return subprocess.run(f"{command} {shlex.quote(str(path))}", shell=True, capture_output=True).returncode == 0
