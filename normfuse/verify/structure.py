"""The structural promise of a Post-Norm -> Pre-Norm conversion: from the first converted
block's input to the final norm, the residual stream passes through adds only (fused
add+norm calls count as their add)."""

from __future__ import annotations

import operator
from typing import Any

import networkx as nx
import torch.fx as fx

from normfuse.passes.canonical import canonical, node_shape, same_shape
from normfuse.passes.graph import dependency_graph
from normfuse.passes.provenance import module_info
from normfuse.vocabulary import CONVERTED_META, FINAL_META, GRAPH_META

__all__ = ["check_structure"]

def _fusion(node: Any):
    """The fusion of a fused call (None for any other value)."""
    from normfuse.passes.fusions import fusion_of
    from normfuse.passes.record import fused_op_name
    return fusion_of(fused_op_name(node)) if isinstance(node, fx.Node) else None


def _sum_output(node: fx.Node) -> tuple[fx.Node, tuple | None] | None:
    """(the call, the operands of its add or None when scaled) when ``node`` is the output of a
    fused call that holds the stream's sum (``Fusion.stream_sum``)."""
    if node.op == "call_function" and node.target is operator.getitem and _fusion(node.args[0]) is not None:
        call = node.args[0]
        summed = _fusion(call).stream_sum(call)
        if summed is not None and summed[0] == node.args[1]:
            return call, summed[1]
    return None


def _value(node: fx.Node) -> fx.Node:
    """A fused call's sum output stands for the call itself when its norm reads that sum (the
    add happens inside it)."""
    found = _sum_output(node)
    if found is not None and _fusion(found[0]).stream_input(found[0]) is found[0]:
        return found[0]
    return node


def _add_operands(node: fx.Node) -> tuple[Any, Any] | None:
    """(a, b) when ``node`` is an unscaled add of two values: a plain add, or a fused call's add."""
    node = _value(node)
    fusion = _fusion(node)
    if fusion is not None:  # the call standing for its sum
        summed = fusion.stream_sum(node) if fusion.stream_input(node) is node else None
        return None if summed is None else summed[1]
    found = _sum_output(node)
    if found is not None:
        return found[1]
    c = canonical(node)
    if c is not None and c.prim == "add" and c["alpha"] == 1 and isinstance(c["input"], fx.Node) \
            and isinstance(c["other"], fx.Node):
        return c["input"], c["other"]
    return None


def _entry(nodes: list[fx.Node], order: dict) -> fx.Node | None:
    """The stream value a norm (fused or not) reads."""
    for n in nodes:
        fusion = _fusion(n)
        read = fusion.stream_input(n) if fusion is not None else None
        if read is not None:
            return read
    for n in nodes:
        c = canonical(n)
        if c is not None and c.prim in ("layer_norm", "rms_norm"):
            return c["input"]
    group = set(nodes)
    out_shape = node_shape(max(nodes, key=order.__getitem__))
    outside = sorted({i for n in nodes for i in n.all_input_nodes if i not in group
                      and same_shape(node_shape(i), out_shape)}, key=order.__getitem__)
    return outside[0] if outside else None


def _groups(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    groups: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        fqn = node.meta.get(FINAL_META) or node.meta.get(CONVERTED_META)
        if fqn is None and node.meta.get("nn_module_stack"):
            fqn = module_info(node)[0]
        if fqn is not None and node.op != "placeholder" and not (
                node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1):
            groups.setdefault(fqn, []).append(node)
    return groups


def check_structure(graph_modules) -> tuple[bool, str]:
    """On the rewritten graphs: from the first converted block's input to each final norm,
    does the residual stream pass through adds only? Returns (ok, explanation)."""
    seen, lines, ok, any_stream = set(), [], True, False
    for gm in graph_modules:
        if id(gm) in seen:
            continue
        seen.add(id(gm))
        info = getattr(gm, "meta", {}).get(GRAPH_META)
        if not info:
            continue
        graph = gm.graph
        g = dependency_graph(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups = _groups(graph)
        all_blocks = [f for s in info["streams"] for f in s["blocks"]]
        for stream in info["streams"]:
            any_stream = True
            missing = [f for f in stream["blocks"] + [stream["final"] or ""] if f and f not in groups]
            if missing:
                ok = False
                lines.append(f"{stream['blocks'][0]}: converted norm(s) {missing} not found in the graph")
                continue
            if stream["final"] is None:
                lines.append(f"{stream['blocks'][0]}: stream ends in the model's own norm; not checked")
                continue
            cur = _entry(groups[stream["final"]], order)
            adds, lost = 0, ""
            while cur is not None:
                ops = _add_operands(cur)
                if ops is None:
                    break
                a, b = ops
                # the stream is the operand the branch descends from; a fused op's sum stands
                # for the op, which also produced the branch's input
                nxt = a if nx.has_path(g, _value(a), b) else b if nx.has_path(g, _value(b), a) else None
                if nxt is None:
                    lost = f" (neither {a.name} nor {b.name} feeds the other)"
                    break
                adds += 1
                cur = nxt
            z = _value(cur)
            first = min(stream["blocks"], key=lambda f: min(order[n] for n in groups[f]))
            entry = _entry(groups[first], order)
            earlier = [f for f in all_blocks if any(nx.has_path(g, n, z) for n in groups[f] if n is not z)]
            if entry is None or _value(entry) is not z or earlier:
                ok = False
                where = f"{z.name} ({z.op} {getattr(z.target, '__name__', z.target)})"
                lines.append(f"{first} -> {stream['final']}: the stream is interrupted at {where}{lost}"
                             + (f", below converted {earlier[0]}" if earlier else ""))
                continue
            lines.append(f"{first} -> {stream['final']}: {len(stream['blocks'])} converted blocks, "
                         f"the stream passes through {adds} adds only")
    if not any_stream:
        return False, "no converted Pre-Norm stream in these graphs"
    return ok, "; ".join(lines)
