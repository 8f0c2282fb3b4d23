"""Views of a function as a networkx DiGraph and as Graphviz DOT text."""

from __future__ import annotations

import json

import networkx as nx

from .graph import Graph, SymRef, Value
from .printer import op_attrs_text


def to_networkx(graph: Graph, function: str = "forward") -> nx.DiGraph:
    """Nodes are args ("%x"), symbols ("@w") and ops ("#i"); edges carry the operand index and type."""
    fn = graph.functions[function]
    g = nx.DiGraph(name=f"{graph.name}.{function}")
    producer: dict[int, str] = {}
    for a in fn.args:
        producer[id(a)] = f"%{a.name}"
        g.add_node(f"%{a.name}", kind="arg", type=str(a.type))

    def source(o: Value | SymRef) -> str:
        if isinstance(o, SymRef):
            node = f"@{o.name}"
            if node not in g:
                g.add_node(node, kind="symbol", type=str(o.type))
            return node
        return producer[id(o)]

    for i, op in enumerate(fn.ops):
        node = f"#{i}"
        g.add_node(node, kind="op", op=op.kind, attrs=op_attrs_text(op.kind, op.attrs).strip(),
                   results=[r.name for r in op.results])
        for j, o in enumerate(op.operands):
            g.add_edge(source(o), node, index=j, type=str(o.type))
        for r in op.results:
            producer[id(r)] = node
    for j, r in enumerate(fn.results):
        g.add_node("return", kind="return")
        g.add_edge(source(r), "return", index=j, type=str(r.type))
    return g


def to_dot(graph: Graph, function: str = "forward") -> str:
    """DOT text for Graphviz: ops as boxes, arguments and symbols as ellipses, edges labelled by type."""
    g = to_networkx(graph, function)
    lines = [f"digraph {json.dumps(g.graph['name'])} {{", "  node [fontname=monospace];"]
    for node, data in g.nodes(data=True):
        if data["kind"] == "op":
            label = f"{data['op']}{data['attrs'] and ' ' + data['attrs']}"
            lines.append(f"  {json.dumps(node)} [shape=box, label={json.dumps(label)}];")
        else:
            lines.append(f"  {json.dumps(node)} [shape=ellipse, label={json.dumps(node)}];")
    for a, b, data in g.edges(data=True):
        lines.append(f"  {json.dumps(a)} -> {json.dumps(b)} [label={json.dumps(data['type'])}];")
    lines.append("}")
    return "\n".join(lines) + "\n"
