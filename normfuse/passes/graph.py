"""The graph every stage reads: node order and the canonical view, with cheap ancestor queries."""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any

import networkx as nx
import torch.fx as fx

from normfuse.passes.canonical import Canon, common_subexpressions

__all__ = ["GraphIndex", "dependency_graph", "copy_graph", "copy_graph_module", "copy_meta", "module_paths"]


class GraphIndex:
    """Graph order and the canonical view, with cheap ancestor queries."""

    def __init__(self, graph: fx.Graph, view: dict[fx.Node, Canon]):
        self.graph = graph
        self.view = view
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        # outputs of the norms found so far: walks up from a norm's input stop there, so a
        # norm that reads another norm's output never reaches into it (its "+ bias" is no
        # residual add, its internal values are not this norm's input)
        self.norm_outputs: set[fx.Node] = set()
        # duplicated pure expressions -> the first node computing the same value
        self.rep: dict[fx.Node, fx.Node] = common_subexpressions(graph, view)

    def freeze(self) -> None:
        """End of the analysis: from now on the index is read only (a write raises)."""
        self.view, self.order, self.rep = (MappingProxyType(m) for m in (self.view, self.order, self.rep))
        self.norm_outputs = frozenset(self.norm_outputs)

    def same(self, a: Any, b: Any) -> bool:
        """Whether two arguments are one value: the same node, or structurally equal pure nodes."""
        return a is b or (isinstance(a, fx.Node) and isinstance(b, fx.Node)
                          and self.rep.get(a, a) is self.rep.get(b, b))

    def duplicates(self, node: Any) -> list[fx.Node]:
        """The duplicated nodes ``node`` is computed through (itself included when it is one):
        what a match that read ``node`` as an equal earlier value also covers."""
        found, stack = [], [node]
        while stack:
            n = stack.pop()
            if isinstance(n, fx.Node) and n in self.rep and n not in found:
                found.append(n)
                stack.extend(n.all_input_nodes)
        return found

    def canon(self, node: Any) -> Canon | None:
        return self.view.get(node) if isinstance(node, fx.Node) else None

    def prim(self, node: Any) -> str | None:
        c = self.canon(node)
        return c.prim if c else None

    def ancestors(self, node: fx.Node) -> set[fx.Node]:
        seen, stack = set(), [node]
        while stack:
            for p in stack.pop().all_input_nodes:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        return seen

    def is_ancestor(self, a: fx.Node, b: fx.Node) -> bool:
        """Whether ``a`` is an ancestor of ``b``; the search stops below a's position."""
        if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
            return False
        lo = self.order[a]
        seen, stack = set(), [b]
        while stack:
            n = stack.pop()
            for p in n.all_input_nodes:
                if p is a:
                    return True
                if p not in seen and self.order[p] > lo:
                    seen.add(p)
                    stack.append(p)
        return False


def dependency_graph(graph: fx.Graph) -> nx.DiGraph:
    """The graph's data flow as a networkx DiGraph (an edge from each input to its user)."""
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for inp in node.all_input_nodes:
            g.add_edge(inp, node)
    return g


def copy_graph(gm: fx.GraphModule | fx.Graph) -> fx.Graph:
    """A copy of gm's graph (or of a graph); nodes keep their names, their meta and the attributes
    dynamo set on them."""
    source = gm if isinstance(gm, fx.Graph) else gm.graph
    graph = fx.Graph(owning_module=source.owning_module, tracer_cls=getattr(source, "_tracer_cls", None))
    graph._codegen = copy.deepcopy(source._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(source, value_map)
    graph.output(output)
    for old, new in value_map.items():
        for key, value in vars(old).items():  # e.g. placeholders' _dynamo_source
            if key.startswith("_dynamo") and not hasattr(new, key):
                setattr(new, key, value)
    return graph


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node names, meta and dynamo's node
    attributes kept) and of its nested subgraphs, sharing parameters and other submodules:
    the untouched graph to run or compare with. (The pass rewrites nested subgraphs in
    place, so a copy that shared them would change with it.)"""
    copied = fx.GraphModule(gm, copy_graph(gm), class_name=type(gm).__name__)
    for name, child in gm.named_children():
        if isinstance(child, fx.GraphModule):
            setattr(copied, name, copy_graph_module(child))
    return copied


def module_paths(node: fx.Node) -> tuple[str, ...]:
    """The paths of the modules around a node as the graph recorded them (``nn_module_stack``), outermost first."""
    return tuple(str(path) for path, _ in (node.meta.get("nn_module_stack") or {}).values())


def copy_meta(dst: fx.Node, src: fx.Node) -> None:
    """A node inserted in place of ``src`` takes its value's metadata and its source location."""
    for key in ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]
