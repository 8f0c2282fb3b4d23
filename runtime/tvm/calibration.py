"""Stored calibrations: the contraction tile a timed run chose for one CPU model, where the model alone is not enough.

A calibration lives in `$KILN_CACHE_DIR/calibration/<cpu model key>-tvm<version>-v<compiler digest>.json` as
`{"cpu": "<describe()>", "contraction": {"mr": 4, "nr": 16, ...}}`, the `CPUMatmul` parameters that won
(`calibrate.py` measures them). A new TVM, any edit of the compiler's source (`source_digest.py`) or another CPU
finds no file and uses the model.
A file that is unreadable or not of that form is ignored (and logged), never an error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tvm

from kiln.runtime.atomic import atomic_file

from .compile_cache import cache_dir
from .cpu import CPUModel
from .source_digest import compiler_version

CALIBRATE_ENV = "KILN_CALIBRATE"  # "1": calibrate a CPU model on its first build (else only `kiln calibrate` does)
TILE_FIELDS = ("mr", "nr", "k_unroll", "accumulators")  # the CPUMatmul parameters a calibration may set

log = logging.getLogger("kiln.compile")


def calibration_path(model: CPUModel) -> Path:
    """Where the calibration of `model` is stored for this TVM and lowering version."""
    return Path(cache_dir()) / "calibration" / f"{model.key}-tvm{tvm.__version__}-v{compiler_version()}.json"


def stored_tile(model: CPUModel) -> dict[str, int] | None:
    """The calibrated CPUMatmul parameters of `model`, or None when none are stored (or the file is damaged)."""
    path = calibration_path(model)
    try:
        tile = json.loads(path.read_text())["contraction"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring calibration %s: %s", path, e)
        return None
    if not isinstance(tile, dict) or not tile or not all(
            k in TILE_FIELDS and isinstance(v, int) and not isinstance(v, bool) and v > 0 for k, v in tile.items()):
        log.warning("ignoring calibration %s: its contraction tile %r is not positive CPUMatmul sizes", path, tile)
        return None
    return tile


def store_tile(model: CPUModel, tile: dict[str, int]) -> Path:
    """Store the winning CPUMatmul parameters of `model` (atomically); returns the file."""
    path = calibration_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as f:
        f.write(json.dumps({"cpu": model.describe(), "contraction": tile}, indent=1).encode())
    return path
