"""Recompute a fused norm's output for the linears that read it (``FuseConfig.recompute_norm_output``).

Runs after the rewrite. For each fused ``add_norm`` / plain-norm call whose output ``y``
is read by linears only (the canonical table's ``linear``: ``F.linear``, ``aten.linear``; directly
or through the one reshape the rewriter adds between the add's and the norm's shapes),
the linears become one ``norm_linears`` call (normfuse/kernels/norm_linear.py): the
same products, but ``y`` is not kept for their weight gradients; backward recomputes it
from the sum the site already keeps. A ``y`` read by anything else (an activation, a
graph output, an attention op) stays as it was: keeping it costs nothing extra then.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from normfuse.kernels.add_norm import add_norm
from normfuse.kernels.norm_linear import norm_linears
from normfuse.passes.canonical import canonical, real_users

__all__ = ["recompute_for_linears"]

_RESHAPES = ("reshape", "view")


def _output(call: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in call.users if u.target is operator.getitem and u.args[1] == index), None)


def _linear_operands(node: fx.Node, y: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """(weight, bias) when ``node`` is a linear whose input is ``y`` (and only that)."""
    c = canonical(node)
    if c is None or c.prim != "linear" or c["input"] is not y:
        return None
    weight, bias = c["weight"], c["bias"]
    if not isinstance(weight, fx.Node) or y in (weight, bias):
        return None
    return weight, bias


def _norm_output(call: fx.Node) -> fx.Node | None:
    """The value the linears read: y, or the reshape of y the rewriter inserted."""
    y = _output(call, 0)
    if y is None:
        return None
    users = real_users(y)
    if len(users) == 1 and users[0].op == "call_method" and users[0].target in _RESHAPES \
            and users[0].args[0] is y:
        return users[0]
    return y


def recompute_for_linears(graph: fx.Graph, calls: dict[fx.Node, object]) -> int:
    """Rewrite the linears after each of ``calls`` (fused call -> its report Site) whose output
    only linears read; sets ``site.recomputed_linears``; returns how many sites changed."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = 0
    for call, site in calls.items():
        if call.target is not add_norm or call.kwargs.get("sum_dtype") is None or "weight1" in call.kwargs:
            continue  # norm_add (its y is not the stream's), a graph calling the custom ops, two norms
        y = _norm_output(call)
        if y is None:
            continue
        linears = real_users(y)
        operands = [_linear_operands(u, y) for u in linears]
        if not linears or any(o is None for o in operands) or len(y.users) != len(linears):
            continue
        first = min(linears, key=order.__getitem__)
        if any(isinstance(p, fx.Node) and order.get(p, -1) > order[first] for o in operands for p in o):
            continue  # a weight computed after the first linear: leave these linears alone
        x, residual, weight, bias = call.args[:4]
        if residual is not None:  # the norm's input is the sum: make the call return it
            if not call.kwargs.get("return_sum"):
                call.kwargs = {**call.kwargs, "return_sum": True}
            inp = _output(call, 1)
            if inp is None:
                with graph.inserting_after(call):
                    inp = graph.call_function(operator.getitem, (call, 1))
        else:
            inp = x
        modes = {k: call.kwargs[k] for k in ("kind", "eps", "weight_offset", "sum_dtype", "norm_round_dtype",
                                             "out_dtype")}
        with graph.inserting_before(first):
            fused = graph.call_function(norm_linears, (y, inp, weight, bias, [o[0] for o in operands],
                                                       [o[1] for o in operands]), modes)
            fused.meta["stack_trace"] = first.meta.get("stack_trace")
            fused.meta["nn_module_stack"] = first.meta.get("nn_module_stack")
            for i, linear in enumerate(linears):
                out = graph.call_function(operator.getitem, (fused, i))
                out.meta.update(linear.meta)
                linear.replace_all_uses_with(out)
        for linear in linears:
            graph.erase_node(linear)
        site.recomputed_linears = len(linears)
        changed += 1
    return changed
