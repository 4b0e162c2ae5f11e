"""The add after the norm, a fusion: ``x + norm(f)`` as one ``norm_add`` call.

Res-post and sandwich blocks (Swin v2, OLMo 2, Gemma 2's post-norms) add the norm's output into
the stream: ``out = residual + norm(f)``. The call ``norm_add(f, residual, w, b, ...)`` returns
``out`` (and y while anything else reads it): the stream is read and written once, y never
(``normfuse.kernels.reference``: "Norm-then-add").

``NORM_ADD`` is the fusion: a plain norm's call (no add before the norm, not permuted) becomes
a ``norm_add`` call when the add after it is the stream's residual add, nothing sits between
them, and no add_norm call claims that add (``fuse_output_add``).
"""

from __future__ import annotations

import operator

import torch.fx as fx

from normfuse.kernels.specs import NORM_ADD_OUTPUTS
from normfuse.passes.canonical import node_dtype, node_shape, real_users, same_shape
from normfuse.passes.classify import stream_operand
from normfuse.passes.graph import copy_meta
from normfuse.passes.fusions.base import Fusion
from normfuse.passes.step import BuiltCall, PlanContext
from normfuse.vocabulary import Placement

__all__ = ["NORM_ADD"]


class _NormAdd(Fusion):
    name = "add_after_norm"
    ops = ("norm_add",)
    exclusive = True  # y goes into the add in the same call

    def offer(self, ctx: PlanContext, site, found, plan):
        out, m = site.output_add, site.match
        if plan.op != "norm" or plan.permute is not None or site.in_add is not None or out is None \
                or not ctx.config.fuse_output_add or out.reason is not None or out.node in ctx.claimed \
                or out.node in ctx.reserved or site.placement not in (Placement.RES_POST, Placement.SANDWICH) \
                or site.output_chain:
            return None, None  # why not: the report's add_reason (planning._add_reason)
        stream = stream_operand(ctx.analysis.index, out)
        ops = out.node.all_input_nodes
        if stream is None or out.scaled not in (None, stream) \
                or not same_shape(node_shape(ops[stream]), node_shape(m.output)):
            return None, None
        plan.op, plan.x, plan.residual = "norm_add", m.input, out.operands[stream]
        plan.output_add, plan.residual_scale, plan.sum_dtype = out.node, out.residual_scale, None
        return out, None

    def spans(self, out) -> tuple[fx.Node, ...]:
        return (out.node,)

    def build(self, out, plan, rewriting, modes: dict) -> BuiltCall:
        m = rewriting.analysis.sites[plan.lead].match
        graph, post = rewriting.graph, out.node
        y_used = any(u is not post for u in real_users(m.output))
        add_dtype = plan.residual_dtype if plan.widens else node_dtype(post)
        x, residual = rewriting.resolve(plan.x), rewriting.resolve(plan.residual)
        call = rewriting.fused_call("norm_add", (x, residual, m.weight, m.bias),
                                    dict(modes, add_dtype=add_dtype, return_norm=y_used))
        where = {name: i for i, name in enumerate(NORM_ADD_OUTPUTS)}  # norm_add returns (out, y)
        result = graph.call_function(operator.getitem, (call, where["out"]))
        copy_meta(result, post)
        built = BuiltCall(call, [call, result], [(where["out"], post)], [post])
        if y_used:
            y = graph.call_function(operator.getitem, (call, where["y"]))
            copy_meta(y, m.output)
            built.inserted.append(y)
            built.stands_for.append((where["y"], m.output))
        rewriting.replace(post, result)
        if y_used:
            rewriting.replace(m.output, y)
        return built


    # ---------------------------------------------------------------- checker
    def formula(self, options: dict, rows: dict, normalize, ops) -> list:
        """(out, y): out = residual_scale * residual + y, y = norm(x)."""
        scale = ops.rational(float(options.get("residual_scale", 1.0)))
        y = normalize(rows["x"])
        return [ops.elementwise(lambda rv, yv: scale * rv + yv, rows["residual"], y), y]

    def stream_sum(self, call: fx.Node) -> tuple[int, tuple | None]:
        operands = (call.args[1], call.args[0]) if call.kwargs.get("residual_scale", 1.0) == 1.0 else None
        return NORM_ADD_OUTPUTS.index("out"), operands


NORM_ADD = _NormAdd()
