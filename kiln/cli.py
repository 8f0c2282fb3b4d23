"""The `kiln` command line: `kiln opt` runs pass pipelines over `.kir` files, `kiln dot` draws them, `kiln compile`
builds them through TVM into a shared library, `kiln tune` auto-tunes their kernels, `kiln inspect` lists the
tensors of a burnpack (`.bpk`) record, `kiln export-onnx` writes a function as an ONNX model, `kiln import-onnx`
writes an ONNX model as a `.kir` module (or its initializers as a burnpack record) and `kiln run` runs a model
(`kiln/cli_run.py`).

Exit codes: 0 success; 1 bad input (parse, verify, shape or pass error, printed as one line with its
location); 2 bad usage; 3 a file that cannot be read or written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from kiln import cli_run
from kiln.ir import Graph, KilnError, ParamGroupWarning, RecordError, parse, parse_file, print_graph, to_dot
from kiln.passes import PassManager, pass_names
from kiln.runtime.atomic import atomic_file
from kiln.runtime.progress import log, stage
from kiln.runtime.records.burnpack import TensorEntry
from kiln.runtime.records.burnpack_io import BurnpackFile
from kiln.runtime.records.qfloat import QFloatScheme

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_IO = 0, 1, 2, 3


def read_graph(path: str) -> Graph:
    """A `.kir` file, or standard input for `-`."""
    return parse(sys.stdin.read(), "<stdin>") if path == "-" else parse_file(path)


def write_text(path: str | None, text: str) -> None:
    """Write to stdout, or atomically to `path`."""
    if path in (None, "-"):
        sys.stdout.write(text)
        return
    with atomic_file(path) as f:
        f.write(text.encode("utf-8"))


def cmd_opt(args: argparse.Namespace) -> int:
    graph = read_graph(args.input)
    manager = PassManager.parse(
        args.pipeline, verify_each=args.verify_each, print_before_all=args.print_ir_before_all,
        print_after_all=args.print_ir_after_all, print_after_change=args.print_ir_after_change,
        timing=args.timing, check_equivalence=args.check_equivalence, strict=args.strict)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ParamGroupWarning)
        result = manager.run(graph)
    for warning in caught:  # one line each, like errors
        print(f"kiln opt: warning: {warning.message}", file=sys.stderr)
    write_text(args.output, print_graph(result))
    return EXIT_OK


def cmd_dot(args: argparse.Namespace) -> int:
    graph = read_graph(args.input)
    if args.function not in graph.functions:
        raise KilnError(f"{args.input}: module @{graph.name} has no function @{args.function}")
    write_text(args.output, to_dot(graph, args.function))
    return EXIT_OK


@contextlib.contextmanager
def _stages_on_stderr(on: bool) -> Iterator[None]:
    """While on, print the `kiln.compile` logger's INFO records (each stage with its seconds) on stderr."""
    if not on:
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kiln: %(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a .kir module through TVM, in valid state unless `--train-state` (as `kiln export-onnx` exports),
    and write the shared library with its sidecar."""
    from kiln.runtime.tvm.compile import compile_graph  # TVM loads only for this command

    with _stages_on_stderr(args.verbose):
        graph = read_graph(args.input)
        if not args.train_state:
            with stage("passes: valid"):
                graph = PassManager.parse("valid").run(graph)
        exe = compile_graph(graph, target=args.target, params=args.params, fast_math=not args.no_fast_math,
                            functions=args.function)
        with stage(f"writing {args.output}"):
            exe.export_library(args.output)
    return EXIT_OK


def cmd_tune(args: argparse.Namespace) -> int:
    """Tune a .kir module's kernels with MetaSchedule; later builds of it (kiln compile, kiln.compile) use them."""
    from kiln.runtime.tvm.tune import tune_graph  # TVM and MetaSchedule load only for this command

    if args.trials < 1:
        raise KilnError(f"--trials must be at least 1, not {args.trials}")
    path = tune_graph(read_graph(args.input), target=args.target, trials=args.trials,
                      trials_per_task=args.trials_per_task, progress=not args.quiet,
                      fast_math=not args.no_fast_math, params=args.params)
    print(path)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    """Names, dtypes, shapes, ParamIds and sizes of a burnpack's tensors in file order, with totals; `-` reads the
    pack from standard input."""
    try:
        if args.input == "-":
            data = sys.stdin.buffer.read()
            pack, file_bytes = BurnpackFile.from_bytes(data, "<stdin>"), len(data)
        else:
            pack, file_bytes = BurnpackFile.open(args.input), os.path.getsize(args.input)
    except RecordError as e:
        if isinstance(e.__cause__, OSError):
            raise e.__cause__ from None  # a file that cannot be read exits 3, not 1
        raise
    with pack:
        entries = sorted(pack.entries.values(), key=lambda e: e.data_offsets)
        tensors = [{"name": e.name, "dtype": str(e.dtype), "shape": list(e.shape),
                    "param_id": None if e.param_id is None else str(e.param_id),
                    "bytes": e.data_offsets[1] - e.data_offsets[0], **_qfloat_fields(e)} for e in entries]
        totals = {"tensors": len(entries), "elements": sum(e.numel for e in entries),
                  "bytes": sum(t["bytes"] for t in tensors), "file_bytes": file_bytes}
        report = {"file": args.input, "version": pack.version, "tensors": tensors, "totals": totals,
                  "metadata": pack.metadata, "scalars": pack.scalars}
    write_text(None, json.dumps(report, indent=2) + "\n" if args.json else _inspect_text(report))
    return EXIT_OK


def _qfloat_fields(entry: TensorEntry) -> dict:
    """A QFloat tensor's scheme (kiln's reading of it, or the unknown map) and its stored bits per element."""
    if entry.dtype.kind != "QFloat":
        return {}
    try:
        scheme = str(QFloatScheme.from_burn(entry.dtype.scheme_value))
    except RecordError:
        scheme = f"unknown scheme {entry.dtype.scheme_value!r}"
    stored = entry.data_offsets[1] - entry.data_offsets[0]
    return {"scheme": scheme, "bits_per_param": round(8 * stored / max(entry.numel, 1), 4)}


def _inspect_text(report: dict) -> str:
    """The inspect report as an aligned table (ids in Burn's form, as `id:` group terms take them)."""
    rows = [("NAME", "DTYPE", "SHAPE", "PARAM_ID", "BYTES")]
    rows += [(t["name"], f"QFloat({t['scheme']}, {t['bits_per_param']:.2f} bits/param)" if "scheme" in t
              else t["dtype"], str(t["shape"]), "-" if t["param_id"] is None else t["param_id"],
              f"{t['bytes']:,}") for t in report["tensors"]]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join([*(cell.ljust(w) for cell, w in zip(row, widths)), row[4].rjust(12)]) for row in rows]
    lines += [f"metadata {key} = {value}" for key, value in report["metadata"].items()]
    lines += [f"scalar {key} = {value}" for key, value in report["scalars"].items()]
    totals = report["totals"]
    lines.append(f"{totals['tensors']:,} tensors, {totals['elements']:,} elements, {totals['bytes']:,} bytes of "
                 f"tensor data, {totals['file_bytes']:,} bytes on disk")
    return "\n".join(lines) + "\n"


def cmd_export_onnx(args: argparse.Namespace) -> int:
    """Write a .kir module's function, in valid mode, as an ONNX model (parameters as initializers by path)."""
    from kiln.runtime.onnx.export import export_graph  # onnx loads only for this command

    export_graph(read_graph(args.input), args.output, function=args.function)
    return EXIT_OK


def cmd_import_onnx(args: argparse.Namespace) -> int:
    """Write an ONNX model as a `.kir` module (its parameters' data in `--record`'s burnpack instead, when given,
    and elided in the text), or, for `-o x.bpk`, its initializers with the ParamIds kiln stored on them."""
    if not args.output.endswith(".kir"):
        if args.record:
            raise KilnError("--record goes with a .kir output; a .bpk output is the record itself")
        from kiln.runtime.onnx.tensors import read_record  # onnx loads only for this command

        read_record(args.input).save(args.output)
        return EXIT_OK
    from kiln.frontend import import_onnx, trace

    module = import_onnx(args.input)
    fn = module.graph.functions["forward"]
    graph = trace(module, *(a.type for a in fn.args), names=[a.name for a in fn.args])
    if args.record:
        module.save_file(args.record)
    write_text(args.output, print_graph(graph, elide_data=bool(args.record)))
    return EXIT_OK


def cmd_cache(args: argparse.Namespace) -> int:
    """Report (info), trim to the size bound (prune) or empty (clear) the compile cache on disk."""
    from kiln.runtime.tvm import compile_cache  # TVM loads only for this command

    if args.action == "prune":
        gone = compile_cache.prune(args.max_bytes)
    elif args.action == "clear":
        gone = compile_cache.clear()
    else:
        gone = []
    entries = compile_cache.disk_entries()
    lines = [f"compile cache {compile_cache.cache_dir()}: {len(entries)} entries, "
             f"{sum(e.bytes for e in entries):,} bytes (bound {compile_cache.max_bytes():,} bytes, "
             f"${compile_cache.MAX_BYTES_ENV})"]
    if gone:
        lines.append(f"removed {len(gone)} entries, {sum(e.bytes for e in gone):,} bytes")
    write_text(None, "\n".join(lines) + "\n")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__.split("\n\n")[0],
                                     epilog="exit codes: 0 ok, 1 bad input, 2 bad usage, 3 file error")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("opt", help="run a pass pipeline over a .kir file")
    opt.add_argument("input", help="a .kir file, or - for standard input")
    opt.add_argument("-p", "--pipeline", default="", help=f"passes, e.g. canonicalize,cse ({', '.join(pass_names())})")
    opt.add_argument("-o", "--output", help="where to write the result (default: standard output)")
    opt.add_argument("--print-ir-before-all", action="store_true", help="dump the IR before each pass")
    opt.add_argument("--print-ir-after-all", action="store_true", help="dump the IR after each pass")
    opt.add_argument("--print-ir-after-change", action="store_true", help="dump the IR after passes that change it")
    opt.add_argument("--verify-each", action="store_true", help="verify the IR after each pass")
    opt.add_argument("--timing", action="store_true", help="report the time each pass takes")
    opt.add_argument("--check-equivalence", action="store_true",
                     help="interpret each function before and after each pass on random inputs and compare")
    opt.add_argument("--strict", action="store_true",
                     help="fail (exit 1) when a pass's group option matches no parameter or flag, instead of warning")
    opt.set_defaults(run=cmd_opt)
    dot = sub.add_parser("dot", help="write a function of a .kir file as Graphviz DOT")
    dot.add_argument("input", help="a .kir file, or - for standard input")
    dot.add_argument("-f", "--function", default="forward", help="the function to draw (default: forward)")
    dot.add_argument("-o", "--output", help="where to write the DOT text (default: standard output)")
    dot.set_defaults(run=cmd_dot)
    comp = sub.add_parser("compile", help="compile a .kir module through TVM to a shared library",
                          description="Compile a .kir module through TVM to a shared library. The module is put "
                                      "in valid state first (dropout off, batch norm on its running statistics), "
                                      "as export-onnx does; --train-state keeps the state the file gives it.")
    comp.add_argument("input", help="a .kir file, or - for standard input")
    comp.add_argument("-o", "--output", required=True,
                      help="the library to write (model.so); its sidecar goes to OUTPUT.kiln.json and, with "
                           "--params inputs, its weights to the burnpack OUTPUT.bpk")
    comp.add_argument("--target", choices=("llvm", "cuda"), default="llvm", help="code generator (default: llvm)")
    comp.add_argument("--params", choices=("bound", "inputs"), default="bound",
                      help="bake the parameters in as constants (default), or take them as inputs")
    comp.add_argument("-f", "--function", action="append", help="a function to compile (repeatable; default: all)")
    comp.add_argument("--no-fast-math", action="store_true", help="exact exp/erf/tanh/softmax instead of fast-math")
    comp.add_argument("--train-state", action="store_true",
                      help="keep the module's state as the file gives it (flags on: dropout drops and batch "
                           "norm uses batch statistics) instead of the default valid state")
    comp.add_argument("-v", "--verbose", action="store_true",
                      help="log each stage (passes, lowering, build, compile cache) with its seconds on stderr")
    comp.set_defaults(run=cmd_compile)
    tune = sub.add_parser("tune", help="auto-tune a .kir module's kernels (MetaSchedule); compile then uses them")
    tune.add_argument("input", help="a .kir file with static input shapes, or - for standard input")
    tune.add_argument("--trials", type=int, default=64, help="measured schedule candidates in all (default: 64)")
    tune.add_argument("--trials-per-task", type=int, help="the most per kernel (default: an even share)")
    tune.add_argument("--target", choices=("llvm",), default="llvm", help="code generator (default: llvm)")
    tune.add_argument("--params", choices=("bound", "inputs"), default="bound",
                      help="tune for builds with the parameters bound (default) or taken as inputs")
    tune.add_argument("--no-fast-math", action="store_true", help="tune for builds compiled with --no-fast-math")
    tune.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    tune.set_defaults(run=cmd_tune)
    inspect = sub.add_parser("inspect", help="list the tensors of a burnpack (.bpk) record")
    inspect.add_argument("input", help="a .bpk file, or - for standard input")
    inspect.add_argument("--json", action="store_true", help="print the listing as JSON")
    inspect.set_defaults(run=cmd_inspect)
    export_onnx = sub.add_parser("export-onnx", help="write a .kir module's function as an ONNX model")
    export_onnx.add_argument("input", help="a .kir file, or - for standard input")
    export_onnx.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    export_onnx.add_argument("-f", "--function", default="forward", help="the function to export (default: forward)")
    export_onnx.set_defaults(run=cmd_export_onnx)
    import_onnx = sub.add_parser("import-onnx", help="write an ONNX model as a .kir module, or its initializers "
                                                     "as a burnpack record (-o x.bpk)")
    import_onnx.add_argument("input", help="an .onnx file")
    import_onnx.add_argument("-o", "--output", required=True, help="the .kir or .bpk file to write")
    import_onnx.add_argument("--record", help="with a .kir output: write the parameters to this .bpk instead")
    import_onnx.set_defaults(run=cmd_import_onnx)
    cli_run.add_parser(sub)
    cache = sub.add_parser("cache", help="report, prune or clear the compile cache on disk")
    cache.add_argument("action", choices=("info", "prune", "clear"),
                       help="info: entries and bytes; prune: drop least recently used entries down to the bound; "
                            "clear: drop every entry")
    cache.add_argument("--max-bytes", type=int, help="the bound prune trims to (default: $KILN_CACHE_MAX_BYTES)")
    cache.set_defaults(run=cmd_cache)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KilnError as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except OSError as e:
        print(f"kiln {args.command}: error: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return EXIT_IO


if __name__ == "__main__":
    sys.exit(main())
