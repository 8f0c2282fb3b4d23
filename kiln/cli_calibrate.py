"""`kiln calibrate [--show]`: print the CPU model kiln's schedules are sized for, and time a few contraction tiles
on this machine to store the fastest for later builds (`--show`: the model and its stored calibration only)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    cal = sub.add_parser("calibrate", help="time a few matmul/conv tiles on this CPU and keep the fastest for builds")
    cal.add_argument("--show", action="store_true", help="print the CPU model and its stored calibration; time nothing")
    cal.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Print the model, then (unless --show) each candidate's seconds, the winner and where it is stored."""
    from kiln.runtime.tvm.calibrate import calibrate  # TVM loads only for this command
    from kiln.runtime.tvm.calibration import calibration_path, stored_tile
    from kiln.runtime.tvm.cpu import cpu_model
    from kiln.runtime.tvm.target import cpu_target

    target = cpu_target()
    model = cpu_model(target)
    print(f"cpu: {model.describe()}")
    if not args.show:
        _, seconds = calibrate(target)
        for tile, s in seconds.items():
            print(f"  {tile}: {s * 1e3:.3f} ms")
    print(f"calibration: {stored_tile(model) or 'none (the model decides)'} ({calibration_path(model)})")
    return 0
