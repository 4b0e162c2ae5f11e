"""Rewrite: each safe site becomes one call of a fused op.

- add -> norm      : ``add_norm(x, residual, w, b, ...)``; the sum is an op output when
                     anything else still reads it.
- norm -> add      : ``norm_add(f, stream, w, b, ...)`` for ``x + norm(f)`` (res-post, sandwich).
- a norm alone     : ``add_norm(x, None, w, b, ...)``, one kernel instead of HF's ~8.

A site that fails a precondition is left exactly as it was, with a reason. Each add is
folded into at most one kernel (the first norm that claims it).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.add_norm import add_norm, norm_add
from normfuse.passes.canonical import is_check_only, node_dtype, node_shape, real_users, same_shape
from normfuse.passes.classify import SiteState, stream_operand
from normfuse.passes.find import GraphIndex, as_add

__all__ = ["plan", "apply", "FUSED_TARGETS", "Plan"]

# the targets rewritten graphs call; a graph that contains them was already optimized
FUSED_TARGETS = (add_norm, norm_add)

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Plan:
    """How one site will be rewritten: which op, on which operands, with which modes."""

    def __init__(self, site: SiteState, op: str, x: Any, residual: Any = None, post_add: fx.Node | None = None,
                 residual_scale: float = 1.0, sum_dtype: torch.dtype | None = None):
        self.site = site
        self.op = op                    # "add_norm" | "norm_add" | "norm"
        self.x = x
        self.residual = residual
        self.post_add = post_add        # the add folded after the norm (norm_add)
        self.residual_scale = residual_scale
        self.sum_dtype = sum_dtype


def _refusal(site: SiteState) -> str | None:
    """Why the norm itself cannot become a fused op (None when it can)."""
    m = site.match
    if m.reason:
        return m.reason
    if m.hidden_size is None:
        return "hidden size unknown (no shape metadata on the graph, or a symbolic last dim)"
    dt = node_dtype(m.input)
    if dt not in KERNEL_DTYPES:
        return f"input dtype {dt} is not one the kernels take ({', '.join(map(str, KERNEL_DTYPES))})"
    for t, name in ((m.weight, "weight"), (m.bias, "bias")):
        if t is not None and node_dtype(t) not in KERNEL_DTYPES:
            return f"{name} dtype {node_dtype(t)} is not one the kernels take"
    if m.out_dtype not in KERNEL_DTYPES:
        return f"output dtype {m.out_dtype} is not one the kernels take"
    # DTensor (tensor/sequence parallel) inputs: the rows must be whole (normfuse.kernels.sharding)
    from normfuse.kernels.sharding import refusal as dtensor_refusal
    return dtensor_refusal([n.meta.get("example_value", n.meta.get("val")) for n in (m.input, m.weight, m.bias)
                            if isinstance(n, fx.Node)])


def plan(index: GraphIndex, site: SiteState, claimed: set, reserved: set, fuse_output_add: bool
         ) -> tuple[Plan | None, str | None]:
    """Choose the op for one site; returns (plan, None) or (None, reason).

    ``claimed``: adds already folded into a kernel. ``reserved``: adds that some norm reads;
    those go to that norm (add -> norm) rather than to a norm -> add before it."""
    reason = _refusal(site)
    if reason:
        return None, reason
    m = site.match
    add = site.in_add
    if add is not None:  # refresh: an operand may be an earlier site's add, now replaced by its sum
        fresh = as_add(index, add.node, m.hidden_size)
        add.operands, add.scaled, add.residual_scale = fresh.operands, fresh.scaled, fresh.residual_scale
    out = site.out_add
    if out is not None and out.node.graph is index.graph:
        fresh = as_add(index, out.node, m.hidden_size)
        out.operands, out.scaled, out.residual_scale = fresh.operands, fresh.scaled, fresh.residual_scale
    reshaped = add is not None and not same_shape(node_shape(add.node), node_shape(m.output))
    static = all(isinstance(d, int) for d in (node_shape(m.output) or (None,)))
    if add is not None and add.reason is None and add.node not in claimed and (static or not reshaped):
        a, b = add.operands
        # s = x + scale * residual: the scaled operand (DeepNorm) is the residual
        if add.scaled is not None:
            x, residual = (b, a) if add.scaled == 0 else (a, b)
        else:
            stream = stream_operand(index, add)
            x, residual = (b, a) if stream == 0 else (a, b)
        return Plan(site, "add_norm", x, residual, residual_scale=add.residual_scale,
                    sum_dtype=node_dtype(add.node)), None
    if fuse_output_add and out is not None and out.node not in claimed and out.node not in reserved and add is None \
            and site.placement in ("res_post", "sandwich") and not site.out_chain:
        stream = stream_operand(index, out)
        ops = out.node.all_input_nodes
        if stream is not None and out.scaled in (None, stream) and same_shape(node_shape(ops[stream]),
                                                                               node_shape(m.output)):
            residual = out.operands[stream]
            return Plan(site, "norm_add", m.input, residual, post_add=out.node,
                        residual_scale=out.residual_scale), None
    return Plan(site, "norm", m.input, None, sum_dtype=node_dtype(m.input)), None


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    for key in ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _insertion_point(index: GraphIndex, p: Plan) -> fx.Node:
    """The first node that may read the op's outputs; all operands must come before it."""
    m = p.site.match
    candidates = list(m.nodes) + [m.output]
    if p.op == "add_norm":
        candidates += [p.site.in_add.node, *p.site.in_add.chain]
    if p.post_add is not None:
        candidates.append(p.post_add)
    first = min(candidates, key=index.order.__getitem__)
    for operand in (p.x, p.residual, m.weight, m.bias):
        if isinstance(operand, fx.Node) and index.order[operand] >= index.order[first]:
            if operand.op == "get_attr":  # get_attr has no inputs: safe to move up
                first.prepend(operand)
                index.order[operand] = index.order[first] - 0.5
            else:
                raise RuntimeError(f"operand {operand.name} is computed after the site starts")
    return first


def apply(index: GraphIndex, p: Plan) -> list[fx.Node]:
    """Insert the fused call and reroute users; returns the inserted nodes."""
    graph = index.graph
    m = p.site.match
    p.x, p.residual = index.resolve(p.x), index.resolve(p.residual)
    first = _insertion_point(index, p)
    modes = dict(kind=m.kind, eps=m.eps, weight_offset=m.weight_offset, residual_scale=p.residual_scale,
                 norm_round_dtype=m.norm_round_dtype, out_dtype=m.out_dtype)
    old_nodes = list(m.nodes)
    with graph.inserting_before(first):
        if p.op == "norm_add":
            post = p.post_add
            y_used = any(u is not post for u in real_users(m.output))
            call = graph.call_function(norm_add, (p.x, p.residual, m.weight, m.bias),
                                       dict(modes, add_dtype=node_dtype(post), return_norm=y_used))
            out = graph.call_function(operator.getitem, (call, 0))
            _copy_meta(out, post)
            inserted = [call, out]
            if y_used:
                y = graph.call_function(operator.getitem, (call, 1))
                _copy_meta(y, m.output)
                inserted.append(y)
            post.replace_all_uses_with(out)
            index.replaced[post] = out
            if y_used:
                m.output.replace_all_uses_with(y)
                index.replaced[m.output] = y
            old_nodes.append(post)
        else:
            add = p.site.in_add if p.op == "add_norm" else None
            s_used = add is not None and any(
                u not in set(add.chain) | set(m.nodes) for node in (add.node, *add.chain) for u in real_users(node))
            call = graph.call_function(add_norm, (p.x, p.residual, m.weight, m.bias),
                                       dict(modes, sum_dtype=p.sum_dtype, return_sum=s_used))
            y = graph.call_function(operator.getitem, (call, 0))
            _copy_meta(y, m.output)
            inserted = [call, y]
            result = y
            if add is not None and not same_shape(node_shape(add.node), node_shape(m.output)):
                # the add and the norm see the rows in different shapes (a view between them)
                result = graph.call_method("reshape", (y, *node_shape(m.output)))
                _copy_meta(result, m.output)
                inserted.append(result)
            m.output.replace_all_uses_with(result)
            index.replaced[m.output] = result
            if s_used:
                s = graph.call_function(operator.getitem, (call, 1))
                _copy_meta(s, add.node)
                inserted.append(s)
                add.node.replace_all_uses_with(s)
                index.replaced[add.node] = s
            if add is not None:
                old_nodes += [add.node, *add.chain]
                # the operands' scaling / upcasts that the kernel now does itself
                old_nodes += [n for n in add.node.all_input_nodes]
    for i, node in enumerate(inserted):  # keep graph order known for later ancestor queries
        index.order[node] = index.order[first] - 0.5 + i * 1e-3
        for user in node.users:  # their arguments changed: refresh their canonical view
            index.refresh(user)
    call.meta["stack_trace"] = m.output.meta.get("stack_trace")
    call.meta["nn_module_stack"] = m.output.meta.get("nn_module_stack")
    _erase_dead(graph, old_nodes, index)
    return inserted


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node], index: GraphIndex) -> None:
    """Erase the site's old nodes that nothing reads any more, last first."""
    # the site's own nodes are pure (arithmetic, casts, views, norm calls or norm modules)
    pending = sorted({n for n in nodes if isinstance(n, fx.Node) and n.op in ("call_function", "call_method",
                                                                             "call_module")},
                     key=lambda n: index.order.get(n, -1), reverse=True)
    for node in pending:
        if node.graph is not graph or real_users(node):
            continue
        for check in list(node.users):  # checks of a value that no longer exists
            graph.erase_node(check)
        graph.erase_node(node)
