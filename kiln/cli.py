"""The `kiln` command line: `kiln opt` runs pass pipelines over `.kir` files, `kiln dot` draws them, `kiln compile`
builds them through TVM into a shared library, `kiln tune` auto-tunes their kernels, `kiln inspect` lists the
tensors of a burnpack (`.bpk`), safetensors or torch.save record, `kiln convert` converts records between those
formats and ONNX initializers, `kiln export-onnx` writes a function as an ONNX model, `kiln import-onnx` writes an
ONNX model as a `.kir` module (or its initializers as a burnpack record) and `kiln run` runs a model
(`kiln/cli_run.py`).

Exit codes: 0 success; 1 bad input (parse, verify, shape or pass error, printed as one line with its
location); 2 bad usage; 3 a file that cannot be read or written; 4 a pass crashed (a bug in kiln: `kiln opt`
leaves a reproducer and names it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import math
import os
import sys
import warnings
from collections.abc import Iterator, Sequence

from kiln import cli_calibrate, cli_run
from kiln.ir import Graph, KilnError, ParamGroupWarning, RecordError, parse, parse_file, print_graph, to_dot
from kiln.passes import PassCrash, PassManager, get_pass, parse_pipeline, pass_names
from kiln.passes.listing import describe, list_passes
from kiln.runtime.atomic import atomic_file
from kiln.runtime.progress import log, stage
from kiln.runtime.records.burnpack import TensorEntry
from kiln.runtime.records.burnpack_io import BurnpackFile
from kiln.runtime.records.qfloat import QFloatScheme
from kiln.runtime.records.record import ModuleRecord

EXIT_OK, EXIT_INPUT, EXIT_USAGE, EXIT_IO, EXIT_CRASH = 0, 1, 2, 3, 4


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


def _names(text: str | None) -> tuple[str, ...]:
    """A comma-separated option value (`--print-ir-before=cse,dce`) as its names."""
    return tuple(n.strip() for n in (text or "").split(",") if n.strip())


def cmd_opt(args: argparse.Namespace) -> int:
    if args.list_passes:
        write_text(None, list_passes())
        return EXIT_OK
    if args.help_pass:
        names = [p.name for p in parse_pipeline(args.pipeline)] or pass_names()
        write_text(None, "".join(describe(get_pass(name)) for name in dict.fromkeys(names)))
        return EXIT_OK
    if args.input is None:  # optional only for the listings above
        args.usage_error("the following arguments are required: input")
    graph = read_graph(args.input)
    if args.bisect is not None:
        return _bisect(args, graph)
    manager = PassManager.parse(
        args.pipeline, verify_each=args.verify_each, print_before_all=args.print_ir_before_all,
        print_after_all=args.print_ir_after_all, print_after_change=args.print_ir_after_change,
        print_before=_names(args.print_ir_before), print_after=_names(args.print_ir_after),
        print_function=args.print_function, print_module_scope=args.print_module_scope,
        print_locations=args.print_locations,
        timing=args.timing, statistics=args.statistics, bisect_limit=args.bisect_limit,
        check_equivalence=args.check_equivalence, strict=args.strict)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ParamGroupWarning)
        try:
            result = manager.run(graph)
        except PassCrash as crash:
            from kiln.runtime.debug.reproducer import write_reproducer

            path = write_reproducer(crash, args.reproducer_dir)
            print(f"kiln opt: error: {crash}; reproducer written to {path}", file=sys.stderr)
            return EXIT_CRASH
    for warning in caught:  # one line each, like errors
        print(f"kiln opt: warning: {warning.message}", file=sys.stderr)
    write_text(args.output, print_graph(result, locations=args.print_locations))
    return EXIT_OK


def _bisect(args: argparse.Namespace, graph: Graph) -> int:
    """`--bisect CMD`: report the first pass application and rewrite after which CMD fails; write the IR there."""
    from kiln.runtime.debug.bisect import bisect
    from kiln.runtime.debug.command import command_succeeds

    culprit = bisect(graph, args.pipeline, lambda g: command_succeeds(args.bisect, g),
                     lambda line: print(f"kiln opt: {line}", file=sys.stderr))
    print(f"kiln opt: first failing pass application: {culprit.application}", file=sys.stderr)
    if culprit.event != culprit.application:
        print(f"kiln opt: first failing rewrite: {culprit.event}", file=sys.stderr)
    print(f"kiln opt: reproduce with --bisect-limit {culprit.number}", file=sys.stderr)
    write_text(args.output, print_graph(culprit.graph))
    return EXIT_OK


def cmd_reduce(args: argparse.Namespace) -> int:
    """Shrink a .kir module while the test keeps finding it interesting; report each step and the sizes."""
    from kiln.runtime.debug.reduce import builtin_test, reduce, size

    graph = read_graph(args.input)
    small = reduce(graph, builtin_test(args.test), lambda line: print(f"kiln reduce: {line}", file=sys.stderr))
    (f0, o0, n0), (f1, o1, n1) = size(graph), size(small)
    print(f"kiln reduce: {f0} functions, {o0} ops, {n0} nodes, {len(print_graph(graph))} bytes -> {f1} functions, "
          f"{o1} ops, {n1} nodes, {len(print_graph(small))} bytes", file=sys.stderr)
    write_text(args.output, print_graph(small))
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
                            functions=args.function, precision=args.precision, max_batch=args.max_batch)
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
    pack from standard input. A safetensors or torch.save file is listed from its record (no ParamIds)."""
    if _FORMATS.get(_suffix(args.input)) in ("safetensors", "pytorch"):  # anything else reads as a burnpack
        return _inspect_foreign(args)
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


def _inspect_foreign(args: argparse.Namespace) -> int:
    """The inspect report of a safetensors or torch.save file: its tensors in data order, dtypes in kiln's names."""
    record = _read(args.input)
    tensors = [{"name": name, "dtype": e.dtype.value, "shape": list(e.shape), "param_id": None,
                "bytes": math.prod(e.shape) * e.dtype.numpy.itemsize} for name, e in record.items()]
    totals = {"tensors": len(tensors), "elements": sum(math.prod(t["shape"]) for t in tensors),
              "bytes": sum(t["bytes"] for t in tensors), "file_bytes": os.path.getsize(args.input)}
    report = {"file": args.input, "format": _format(args.input), "tensors": tensors, "totals": totals,
              "metadata": {}, "scalars": {}}
    write_text(None, json.dumps(report, indent=2) + "\n" if args.json else _inspect_text(report))
    return EXIT_OK


_FORMATS = {".bpk": "burnpack", ".safetensors": "safetensors", ".pt": "pytorch", ".pth": "pytorch",
            ".onnx": "onnx"}


def _suffix(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def _format(path: str) -> str:
    """A record file's format by extension (what `kiln convert` and `kiln inspect` take)."""
    suffix = _suffix(path)
    if suffix not in _FORMATS:
        raise RecordError(f"{path}: unknown record extension {suffix or '(none)'!r}; use one of "
                          f"{', '.join(_FORMATS)}")
    return _FORMATS[suffix]


def _read(path: str) -> ModuleRecord:
    """A record file of any format kiln reads, by extension; a file that cannot be opened is an OSError."""
    if not os.path.isfile(path):
        raise FileNotFoundError(errno.ENOENT, "no such file", path)
    kind = _format(path)
    if kind == "onnx":
        from kiln.runtime.onnx.tensors import read_record  # onnx loads only for ONNX files

        return read_record(path)
    return {"burnpack": ModuleRecord.load, "safetensors": ModuleRecord.from_safetensors,
            "pytorch": ModuleRecord.from_pytorch}[kind](path)


def cmd_convert(args: argparse.Namespace) -> int:
    """Write a record file in another format (by the extensions), atomically; ParamIds carry over where both
    formats store them (burnpack, ONNX initializers)."""
    record, kind = _read(args.input), _format(args.output)
    if kind == "onnx":
        from kiln.runtime.onnx.export import export_record  # onnx loads only for ONNX files

        export_record(record, args.output)
    elif kind == "safetensors":
        record.to_safetensors(args.output)
    elif kind == "burnpack":
        record.save(args.output)
    else:
        raise RecordError(f"{args.output}: kiln reads torch.save files but does not write them; write "
                          f".safetensors, which torch loads")
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


def _change_mode(text: str) -> str:
    if text != "diff":
        raise argparse.ArgumentTypeError(f"expected diff, not {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__.split("\n\n")[0],
                                     epilog="exit codes: 0 ok, 1 bad input, 2 bad usage, 3 file error, "
                                            "4 a pass crashed")
    sub = parser.add_subparsers(dest="command", required=True)
    opt = sub.add_parser("opt", help="run a pass pipeline over a .kir file")
    opt.add_argument("input", nargs="?", help="a .kir file, or - for standard input")
    opt.add_argument("-p", "--pipeline", default="", help=f"passes, e.g. canonicalize,cse ({', '.join(pass_names())})")
    opt.add_argument("-o", "--output", help="where to write the result (default: standard output)")
    opt.add_argument("--list-passes", action="store_true", help="list every pass with its description and options")
    opt.add_argument("--help-pass", action="store_true", help="describe the passes of -p (default: all) and exit")
    opt.add_argument("--print-ir-before-all", action="store_true", help="dump the IR before each pass")
    opt.add_argument("--print-ir-after-all", action="store_true", help="dump the IR after each pass")
    opt.add_argument("--print-ir-before", metavar="PASS[,PASS]", help="dump the IR before each run of these passes")
    opt.add_argument("--print-ir-after", metavar="PASS[,PASS]", help="dump the IR after each run of these passes")
    opt.add_argument("--print-ir-after-change", nargs="?", const=True, choices=(True, "diff"), type=_change_mode,
                     help="dump the IR after passes that change it; =diff: a unified diff against the IR before")
    opt.add_argument("--print-function", metavar="NAME", help="dumps show only this function")
    opt.add_argument("--print-module-scope", action="store_true",
                     help="with --print-function, dump the module's params, flags and derivations around it")
    opt.add_argument("--print-locations", action="store_true",
                     help="print each op's location (file:line:col, traced line and module path, ONNX node)")
    opt.add_argument("--statistics", action="store_true", help="report each pass's counters (ops removed...)")
    opt.add_argument("--bisect-limit", type=int, metavar="N",
                     help="run only the first N pass applications and rewrites; report the ones skipped")
    opt.add_argument("--bisect", metavar="CHECK_CMD",
                     help="find the first pass application and rewrite after which CHECK_CMD (given the IR's .kir "
                          "file as its last argument; exit 0 means good) fails; -o gets the IR after it")
    opt.add_argument("--reproducer-dir", metavar="DIR",
                     help="where a crashing pass leaves its reproducer (default: $KILN_REPRODUCER_DIR, else the "
                          "temporary folder)")
    opt.add_argument("--verify-each", action="store_true", help="verify the IR after each pass")
    opt.add_argument("--timing", action="store_true", help="report the time each pass takes")
    opt.add_argument("--check-equivalence", action="store_true",
                     help="interpret each function before and after each pass on random inputs and compare")
    opt.add_argument("--strict", action="store_true",
                     help="fail (exit 1) when a pass's group option matches no parameter or flag, instead of warning")
    opt.set_defaults(run=cmd_opt, usage_error=opt.error)
    red = sub.add_parser("reduce", help="shrink a .kir module while a test keeps finding it interesting")
    red.add_argument("input", help="a .kir file, or - for standard input")
    red.add_argument("--test", required=True, metavar="TEST",
                     help="equivalence:PIPELINE (PIPELINE changes a value), crash:PIPELINE (a pass crashes the same "
                          "way), compile:TARGET (the TVM build fails), or a shell command given the .kir file as "
                          "its last argument (exit 0: interesting)")
    red.add_argument("-o", "--output", help="where to write the reduced module (default: standard output)")
    red.set_defaults(run=cmd_reduce)
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
    comp.add_argument("--precision", default="f32",
                      help="f32 (default), bf16 (f32 on CPUs without bf16 dot products), bf16! (emulated bf16) or "
                           "int8 (Q8-quantized weights): docs/precision.md")
    comp.add_argument("--max-batch", type=int, default=None, metavar="N",
                      help="share memory between intermediates for a dynamic batch of at most N; the library then "
                           "refuses larger batches (default: no bound, any batch)")
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
    inspect = sub.add_parser("inspect", help="list the tensors of a burnpack (.bpk), safetensors or torch.save record")
    inspect.add_argument("input", help="a .bpk, .safetensors, .pt or .pth file, or - for a burnpack on standard input")
    inspect.add_argument("--json", action="store_true", help="print the listing as JSON")
    inspect.set_defaults(run=cmd_inspect)
    convert = sub.add_parser("convert", help="convert a record between burnpack (.bpk), safetensors, torch.save "
                             "(.pt/.pth, read only) and ONNX initializers (.onnx), by extension")
    convert.add_argument("input", help="the record to read")
    convert.add_argument("output", help="the record to write (atomically)")
    convert.set_defaults(run=cmd_convert)
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
    cli_calibrate.add_parser(sub)
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
