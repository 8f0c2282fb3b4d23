"""The IR verifier: every invariant the rest of kiln relies on, each failure naming where it is."""

from __future__ import annotations

from collections.abc import Callable

from . import init as initializers
from . import registry
from .errors import KilnError, VerifyError
from .graph import Function, Graph, Op, ParamNode, ReparamNode, SymRef, Value, untied_id_claims
from .location import located
from .param_id import ParamId

DEQUANTIZE = "dequantize"  # the one derivation another derivation may take as an operand


def verify(graph: Graph) -> Graph:
    """Raise VerifyError at the first broken invariant; return the graph unchanged otherwise."""
    _verify_symbols(graph)
    for fn in graph.functions.values():
        verify_function(graph, fn)
    return graph


def _verify_symbols(graph: Graph) -> None:
    seen: set[str] = set()
    for node in graph.nodes():
        if node.name in seen:
            raise VerifyError(f"@{node.name}: symbol declared more than once")
        seen.add(node.name)
    for p in graph.params.values():
        _verify_param(p)
    for first, p in untied_id_claims(graph.params.values()):
        raise VerifyError(f"param @{p.name}: ParamId {ParamId(p.id)} is also @{first.name}'s, but the two differ "
                          f"({first.type} and {p.type}); only one tied parameter may appear at two paths")
    for r in graph.reparams.values():
        where = f"reparam @{r.name}"
        for o in r.operands:
            _verify_reparam_operand(graph, r, o)
        try:
            attrs, (result,) = registry.infer(r.kind, [graph.symbol(o).type for o in r.operands], r.attrs)
        except (KilnError, ValueError) as e:
            raise VerifyError(f"{where}: {e}") from None
        if result != r.type:
            raise VerifyError(f"{where}: derivation gives {result} but the node is declared {r.type}")


def _verify_reparam_operand(graph: Graph, r: ReparamNode, o: str) -> None:
    """An operand is a parameter, or a dequantize of parameters (a quantized base, as QLoRA has)."""
    where = f"reparam @{r.name}: operand @{o}"
    if o in graph.params:
        return
    source = graph.reparams.get(o)
    if source is None:
        raise VerifyError(f"{where} is not a parameter")
    if o == r.name or r.name in source.operands:
        raise VerifyError(f"{where} derives from @{r.name} itself (a cycle)")
    if source.kind != DEQUANTIZE or any(s not in graph.params for s in source.operands):
        raise VerifyError(f"{where} is a derived parameter (nested reparameterization); only a dequantize of "
                          "stored parameters may be an operand")


def _verify_param(p: ParamNode) -> None:
    where = f"param @{p.name}"
    if not p.type.is_static:
        raise VerifyError(f"{where}: parameters need a static type, got {p.type}")
    if not 0 <= p.id < 2**64:
        raise VerifyError(f"{where}: ParamId {p.id} is not a u64")
    if p.init is not None:
        try:
            initializers.check(p.init)
        except KilnError as e:
            raise VerifyError(f"{where}: {e}") from None
    if p.layout is not None:
        try:
            p.layout.check(p.type.shape)
        except KilnError as e:
            raise VerifyError(f"{where}: {e}") from None
    if p.data is not None and (tuple(p.data.shape) != p.type.shape or p.data.dtype != p.type.dtype.numpy):
        raise VerifyError(f"{where}: data of shape {p.data.shape} and dtype {p.data.dtype} is not a {p.type}")
    if p.grad and not p.type.dtype.is_float:
        raise VerifyError(f"{where}: only floating parameters can require gradients ({p.type.dtype.value})")
    if p.grad and p.buffer:
        raise VerifyError(f"{where}: a buffer (running state) never requires gradients")


def verify_function(graph: Graph, fn: Function) -> None:
    defined: set[int] = set()
    names: set[str] = set()

    def define(v: Value, where: str) -> None:
        if id(v) in defined:
            raise VerifyError(f"{where}: %{v.name} is defined twice")
        if v.name in names:
            raise VerifyError(f"{where}: the name %{v.name} is used for two values")
        defined.add(id(v))
        names.add(v.name)

    def check_operand(o: object, where: str) -> None:
        if isinstance(o, SymRef):
            node = graph.symbol(o.name)
            if node is None:
                raise VerifyError(f"{where}: @{o.name} does not exist")
            if node.type != o.type:
                raise VerifyError(f"{where}: @{o.name} is used as {o.type} but declared {node.type}")
        elif isinstance(o, Value):
            if id(o) not in defined:
                raise VerifyError(f"{where}: %{o.name} is used before it is defined")
        else:
            raise VerifyError(f"{where}: operand {o!r} is neither a value nor a symbol")

    for a in fn.args:
        define(a, f"@{fn.name} arguments")
    for i, op in enumerate(fn.ops):
        try:
            _verify_op(op, f"@{fn.name} op #{i} ({', '.join('%' + r.name for r in op.results)} = {op.kind})",
                       check_operand, define)
        except VerifyError as e:
            raise located(op.loc, e) from None
    for r in fn.results:
        check_operand(r, f"@{fn.name} return")


def _verify_op(op: Op, where: str, check_operand: Callable[[object, str], None],
               define: Callable[[Value, str], None]) -> None:
    for o in op.operands:
        check_operand(o, where)
    try:
        attrs, types = registry.infer(op.kind, [o.type for o in op.operands], op.attrs)
    except (KilnError, ValueError) as e:
        raise VerifyError(f"{where}: {e}") from None
    if tuple(r.type for r in op.results) != types:
        raise VerifyError(f"{where}: results are typed ({', '.join(str(r.type) for r in op.results)}) "
                          f"but the op infers ({', '.join(map(str, types))})")
    for r in op.results:
        if r.owner is not op:
            raise VerifyError(f"{where}: result %{r.name} belongs to another op")
        define(r, where)
