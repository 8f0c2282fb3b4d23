"""Crash reproducers: the IR a crashing pass was given, with a `// RUN:` line running that pass alone, as one
`.kir` file written atomically (MLIR's `--mlir-pass-pipeline-crash-reproducer`)."""

from __future__ import annotations

import hashlib
import os
import shlex
import tempfile
from pathlib import Path

from kiln.ir import Graph, print_graph
from kiln.passes import PassCrash, PassManager
from kiln.runtime.atomic import atomic_file

DIR_ENV = "KILN_REPRODUCER_DIR"


def reproducer_text(crash: PassCrash) -> str:
    """The reproducer: a RUN line, the error it reproduces, then the IR before the failing pass, data included."""
    return (f"// RUN: kiln opt %s -p {shlex.quote(crash.pipeline)}\n"
            f"// reproduces: {' '.join(str(crash).split())}\n\n{print_graph(crash.graph)}")


def write_reproducer(crash: PassCrash, directory: str | os.PathLike[str] | None = None) -> Path:
    """Write the reproducer into `directory` (default: $KILN_REPRODUCER_DIR, else the temporary folder), named by
    the crashing pass and a digest of the text, so the same crash rewrites the same file; returns its path."""
    text = reproducer_text(crash)
    folder = Path(directory or os.environ.get(DIR_ENV) or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in crash.pipeline)[:40]
    path = folder / f"kiln-crash-{name}-{hashlib.blake2b(text.encode(), digest_size=6).hexdigest()}.kir"
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))
    return path


def run_with_reproducer(manager: PassManager, graph: Graph) -> Graph:
    """`manager.run(graph)`; when $KILN_REPRODUCER_DIR is set, a pass crash first leaves a reproducer there and
    names it in the PassCrash raised (how `kiln.compile` runs its passes)."""
    try:
        return manager.run(graph)
    except PassCrash as crash:
        if not os.environ.get(DIR_ENV):
            raise
        path = write_reproducer(crash)
        crash.args = (f"{crash}; reproducer written to {path}",)
        raise
