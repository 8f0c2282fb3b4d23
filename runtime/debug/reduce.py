"""Test-case reduction (`mlir-reduce`, `llvm-reduce`): shrink a module's `.kir` text while a test still finds it
interesting. Candidates, tried in a fixed order until none is accepted: drop a function, replace an op's result
by a zero constant, bypass an op by one of its operands, drop a parameter, flag or derivation. Each candidate is
parsed (so only well-formed, verified modules are tested), cleared of dead ops, and kept when shorter and still
interesting. Also: an op's result becomes a new argument of its function, a dimension size becomes 1 everywhere."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from kiln.ir import Graph, KilnError, parse, print_graph, prune
from kiln.passes import PassCrash, PassManager
from kiln.passes.equivalence import first_difference

from .command import command_succeeds

Test = Callable[[Graph], bool]

_OP = re.compile(r"^    %(?P<name>\S+) = (?P<kind>[a-z_0-9]+)(?P<operands>[^{:]*)(?:\{.*\})? "
                 r": (?P<type>tensor<[^>]*>)$")
_STATIC = re.compile(r"tensor<(?:\d+x)*(?P<dtype>[a-z]+\d*)>")
_NODE = re.compile(r"^  (param|flag|reparam) @")
_DIM = re.compile(r"(?<=[<x])(\d+)(?=x)")


def size(graph: Graph) -> tuple[int, int, int]:
    """(functions, ops, parameter/flag/derivation nodes): what the size report names."""
    return (len(graph.functions), sum(len(f.ops) for f in graph.functions.values()),
            len(graph.params) + len(graph.flags) + len(graph.reparams))


def _zero(dtype: str) -> str:
    return "false" if dtype == "bool" else "0.0" if dtype[0] in "fb" else "0"


def _candidates(lines: list[str]) -> Iterator[list[str]]:
    """Every one-step reduction of the module's lines, biggest first."""
    for i, line in enumerate(lines):  # drop a function
        if line.startswith("  func @"):
            end = lines.index("  }", i)
            yield lines[:i] + lines[end + 1:]
    for i in reversed(range(len(lines))):
        m = _OP.match(lines[i])
        if m is None:
            continue
        head = max(j for j in range(i) if lines[j].startswith("  func @"))
        new_arg = f"{', ' if '(%' in lines[head] else ''}%{m['name']}: {m['type']}"
        signature = lines[head].replace(") -> (", f"{new_arg}) -> (", 1)
        yield [*lines[:head], signature, *lines[head + 1:i], *lines[i + 1:]]  # the result becomes an argument
        static = _STATIC.fullmatch(m["type"])
        if static and m["kind"] != "constant":  # the result becomes a zero constant
            yield [*lines[:i], f"    %{m['name']} = constant {{value = dense<{m['type']}, "
                               f"{_zero(static['dtype'])}>}} : {m['type']}", *lines[i + 1:]]
        for operand in dict.fromkeys(re.findall(r"%[^\s,]+", m["operands"])):  # the op bypassed
            use = re.compile(rf"%{re.escape(m['name'])}(?![\w.$\-])")
            yield lines[:i] + [use.sub(operand, line) for line in lines[i + 1:]]
    for i, line in enumerate(lines):  # drop a node
        if _NODE.match(line):
            yield lines[:i] + lines[i + 1:]
    text = "\n".join(lines)
    for dim in sorted({int(d) for d in _DIM.findall(text)} - {0, 1}, reverse=True):  # shrink a size everywhere
        yield re.sub(rf"(?<=[<x]){dim}(?=x)", "1", text).split("\n")


def _well_formed(lines: list[str]) -> Graph | None:
    try:
        graph = parse("\n".join(lines) + "\n", "<candidate>")
    except KilnError:
        return None
    return graph.replace(functions={name: prune(fn) for name, fn in graph.functions.items()})


def _weight(text: str) -> tuple[int, int]:
    """What reduction lowers: the text's length, then the sum of its dimension sizes (4 -> 1 keeps the length)."""
    return len(text), sum(int(d) for d in _DIM.findall(text))


def reduce(graph: Graph, interesting: Test, progress: Callable[[str], None] = lambda line: None) -> Graph:
    """The smallest module the candidates reach on which `interesting` holds; deterministic."""
    if not interesting(graph):
        raise KilnError("the test does not find the input interesting: nothing to reduce")
    text = print_graph(graph)
    rounds = 0
    changed = True
    while changed:
        changed, rounds = False, rounds + 1
        for lines in _candidates(text.splitlines()):
            candidate = _well_formed(lines)
            if candidate is None:
                continue
            candidate_text = print_graph(candidate)
            if _weight(candidate_text) < _weight(text) and interesting(candidate):
                graph, text, changed = candidate, candidate_text, True
                functions, ops, nodes = size(graph)
                progress(f"round {rounds}: {functions} functions, {ops} ops, {nodes} nodes, {len(text)} bytes")
                break
    return graph


def builtin_test(spec: str) -> Test:
    """`equivalence:PIPELINE` (PIPELINE changes a value of some function), `crash:PIPELINE` (a pass of it
    crashes), `compile:TARGET` (building through TVM fails), or a shell command given the `.kir` file as its last
    argument (exit status 0: interesting)."""
    kind, _, arg = spec.partition(":")
    if kind == "equivalence":
        return lambda g: _changes_a_value(g, arg)
    if kind == "crash":
        first: list[str] = []  # the input's crash: candidates must crash the same way
        return lambda g: _crashes(g, arg, first)
    if kind == "compile":
        return lambda g: _fails_to_compile(g, arg)
    return lambda g: command_succeeds(spec, g)


def _changes_a_value(graph: Graph, pipeline: str) -> bool:
    try:
        after = PassManager.parse(pipeline).run(graph)
        return any(fn.name in after.functions and first_difference(fn, graph, after) is not None
                   for fn in graph.functions.values())
    except (KilnError, PassCrash):
        return False  # a candidate the pipeline or the interpreter refuses shows no miscompile


def _crashes(graph: Graph, pipeline: str, first: list[str]) -> bool:
    try:
        PassManager.parse(pipeline).run(graph)
    except PassCrash as crash:
        signature = f"{crash.label}: {type(crash.cause).__name__}"
        first[:] = first or [signature]
        return first == [signature]
    except KilnError:
        return False
    return False


def _fails_to_compile(graph: Graph, target: str) -> bool:
    from kiln.runtime.tvm.compile import compile_graph  # TVM loads only for this test

    try:
        compile_graph(graph, target=target or "llvm", cache=False)
    except Exception:  # noqa: BLE001 - any failure of the build is what this test looks for
        return True
    return False
