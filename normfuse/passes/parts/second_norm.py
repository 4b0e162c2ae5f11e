"""A second norm of the same value, a fusion part: two norms, one call (parallel blocks).

GPT-J, GPT-NeoX (``use_parallel_residual``), Phi and timm's parallel ViT blocks normalize one
value twice, with two weights: ``attn(ln_1(h)) + mlp(ln_2(h)) + h``. Both norms share the row
statistics; the call computes the second as ``weight1`` / ``bias1`` and returns it as ``y1``
(``normfuse.kernels.reference``: "y1 = the same normalized n with weight1 / bias1").

``SECOND_NORM`` is the part: a norm or add_norm call (not permuted, with no step that changes
y) takes another norm reading the very value its norm reads, with the same modes, whose site
no call took yet (``pair_norms``). The plan then computes both sites (``Plan.sites``: the lead,
then this one); when the second norm's parameters come too late for the call, it is left to a
call of its own.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from normfuse.passes.canonical import node_dtype
from normfuse.passes.graph import copy_meta
from normfuse.passes.parts.base import CallPiece, FusionPart, PlanContext

__all__ = ["SECOND_NORM"]


def _same_modes(a, b) -> bool:
    """Two norms one kernel can compute from one set of row statistics (weights may differ)."""
    m, n = a.match, b.match
    return (m.kind, m.eps, m.weight_offset, m.norm_round_dtype, m.out_dtype, m.hidden_size) == (
        n.kind, n.eps, n.weight_offset, n.norm_round_dtype, n.out_dtype, n.hidden_size) and m.group is n.group is None


def _partner(ctx: PlanContext, site):
    """Another norm reading the very value this one reads, with the same modes; both need a
    weight, since the kernel's second output exists when it has one."""
    index, m = ctx.analysis.index, site.match
    if m.weight is None:
        return None
    for number in site.group:
        other = ctx.analysis.sites[number]
        o = other.match
        if other is site or number in ctx.unavailable or o.weight is None or ctx.norm_refusal(other) is not None:
            continue
        if index.order[o.output] < index.order[m.output] or not index.same(o.input, m.input):
            continue
        if (site.in_add is None) != (other.in_add is None) or (
                site.in_add is not None and site.in_add.node is not other.in_add.node):
            continue
        if _same_modes(site, other) and node_dtype(o.weight) is not None:
            return other
    return None


class _SecondNorm(FusionPart):
    name = "second_norm"
    exclusive = False
    roles = {"weight1": "wb", "bias1": "bb"}
    operand_name = "the second norm's parameters"

    def offer(self, ctx: PlanContext, site, found, plan):
        if not ctx.config.pair_norms or plan.op not in ("add_norm", "norm") or plan.permute is not None \
                or plan.exclusive:
            return None, None
        partner = _partner(ctx, site)
        if partner is None:
            return None, None
        plan.sites = (site.number, partner.number)
        return partner, None

    def may_drop(self, partner) -> bool:
        return True  # each norm its own call

    def drop(self, plan, partner) -> None:
        plan.sites = plan.sites[:1]

    def reads(self, partner) -> tuple[fx.Node, ...]:
        return tuple(t for t in (partner.match.weight, partner.match.bias) if isinstance(t, fx.Node))

    def nodes(self, partner) -> tuple[fx.Node, ...]:
        return tuple(partner.match.nodes)

    def spans(self, partner) -> tuple[fx.Node, ...]:
        return (*partner.match.nodes, partner.match.output)

    def call(self, partner, rewriting) -> CallPiece:
        return CallPiece({"weight1": partner.match.weight, "bias1": partner.match.bias})

    def added_outputs(self, partner) -> tuple[fx.Node, ...]:
        return (partner.match.output,)

    def outputs(self, partner, rewriting, call: fx.Node, kernel_shape: tuple, where: dict[str, int]):
        y1 = rewriting.graph.call_function(operator.getitem, (call, where["y1"]))
        copy_meta(y1, partner.match.output)
        rewriting.replace(partner.match.output, y1)
        return [y1], [(where["y1"], partner.match.output)]

    def uses(self, options: dict) -> bool:
        return options.get("weight1") is not None

    def symbolic(self, options: dict, rows: dict, s: list, norm, ops) -> dict[str, list]:
        return {"y": norm(s), "y1": norm(s, rows["weight1"], rows.get("bias1")), "s": s}


SECOND_NORM = _SecondNorm()
