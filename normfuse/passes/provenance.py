"""Where a site came from: its module path and class, its source line, and the report's record of it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch.fx as fx

from normfuse.passes.canonical import node_dtype
from normfuse.passes.order import STEPS
from normfuse.reporting import Site
from normfuse.vocabulary import CONVERTED_META, COPY_FILE, TORCH_NORMS, Placement

if TYPE_CHECKING:
    from normfuse.passes.analysis import Analysis, SiteAnalysis
    from normfuse.passes.planning import Planning

__all__ = ["module_info", "module_class", "source_of", "site_record", "site_records", "elementwise_norm_note"]

_FQN_PREFIX = re.compile(r"^L\[[^\]]*\](\[[^\]]*\])*\.?")


def module_info(node: fx.Node) -> tuple[str | None, str | None]:
    """(fqn, class name) of the innermost module a node came from, if the graph recorded it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, cls = list(stack.values())[-1]
    fqn = _FQN_PREFIX.sub("", str(path)).replace("._modules", "").replace(".__dict__", "")
    fqn = re.sub(r"\[(\d+)\]", r".\1", fqn).replace("['", ".").replace("']", "").strip(".")
    fqn = ".".join(part for part in fqn.split(".") if part not in ("__dict__", "_modules"))
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return fqn or None, name


def module_class(node: fx.Node) -> type | None:
    """The class of the innermost module a node came from (call_module: that module)."""
    if node.op == "call_module" and node.graph.owning_module is not None:
        return type(node.graph.owning_module.get_submodule(node.target))
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    cls = list(stack.values())[-1][1]
    return cls if isinstance(cls, type) else None




def source_of(node: fx.Node) -> str | None:
    """'file:line' of the innermost frame of the node's stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return None
    path, line = frames[-1]
    prefix, _, suffix = COPY_FILE.partition("{path}")
    if path.startswith(prefix) and path.endswith(suffix):  # an edited copy of a function (boundary.py)
        path = path[len(prefix):len(path) - len(suffix)]
    return f"{path}:{line}"


def site_record(analysis: Analysis, site: SiteAnalysis) -> Site:
    """The report's record of what was found at one site (before any decision about it)."""
    m = site.match
    fqn, cls = module_info(m.output) if m.output.meta.get("nn_module_stack") else module_info(m.anchor or m.output)
    if m.anchor is not None:
        # the match may end past the norm module (a cast its caller applies, taken into the tail):
        # the statistic is computed inside it, so a deeper module of the anchor names the norm
        inner, inner_cls = module_info(m.anchor)
        if inner and (fqn is None or inner.startswith(fqn + ".") or not fqn):
            fqn, cls = inner, inner_cls
    # a norm call made by a torch norm module (nn.LayerNorm, nn.RMSNorm) is reported as "module"
    cls_of_call = module_class(m.anchor or m.output)  # the call itself: its weight may come after it
    form = "module" if m.form in ("functional", "module") and isinstance(cls_of_call, type) \
        and issubclass(cls_of_call, TORCH_NORMS) else m.form
    # a norm moved by the Pre-Norm conversion (normfuse/passes/prenorm.py) is a pre-norm,
    # also the first one of a stream, which no add feeds
    converted = bool(m.output.meta.get(CONVERTED_META))
    record = Site(
        number=site.number, kind=m.kind, form=form,
        placement=Placement.PRE if converted else site.placement, converted=converted,
        input_is_add=site.input_is_add, output_feeds_add=site.output_feeds_add,
        hidden_size=m.hidden_size, dtype=str(node_dtype(m.input)) if node_dtype(m.input) else None,
        eps=m.eps, fqn=fqn, source=source_of(m.output) or source_of(m.anchor or m.output),
        weight_offset=m.weight_offset,
        residual_scale=site.in_add.residual_scale if site.in_add is not None else 1.0,
        norm_round_dtype=str(m.norm_round_dtype) if m.norm_round_dtype else None,
        out_dtype=str(m.out_dtype) if m.out_dtype else None, module_type=cls,
        norm_group=m.group)
    for step in STEPS:  # what each step found here (fused or not is decided later)
        if step.name in site.parts:
            step.report(record, site.parts[step.name], fused=False, reason=None)
    return record


def site_records(analysis: Analysis, planning: Planning | None = None, applied: bool = True) -> list[Site]:
    """The report's record of every site of one graph: what was found, and what the plans made
    of it (``applied``: the plans were applied; else the graph was only analysed, the audit)."""
    sites = [site_record(analysis, s) for s in analysis.sites]
    if planning is None:
        return sites
    for number, plan in enumerate(planning.plans):
        for k, member in enumerate(sites[n] for n in plan.sites):
            member.call_number, member.op = number, plan.op
            member.add_reason = planning.decisions[member.number].add_reason
            if not applied:
                member.reason = "not applied (analysis only)"
                continue
            member.fused = True
            member.fused_add = plan.fused_add
            member.residual_scale = plan.residual_scale
            member.sum_dtype = str(plan.sum_dtype) if plan.sum_dtype is not None else None
            member.input_is_add = member.input_is_add or plan.op == "add_norm"
            member.residual_dtype = str(plan.residual_dtype) if plan.residual_dtype is not None else None
            if k == 0:
                member.recomputed_linears = len(plan.recompute)
    for record, site, decision in zip(sites, analysis.sites, planning.decisions):
        plan = planning.plans[decision.plan] if decision.plan is not None else None
        # what the call takes over of each part is the lead's (a second norm shares its call)
        taken = plan.taken if plan is not None and plan.lead == site.number else {}
        for step in STEPS:
            if step.name in taken:
                step.report(record, taken[step.name], fused=True, reason=None)
            elif step.name in site.parts:
                reason = decision.part_reasons.get(step.name) or decision.reason or "not rewritten"
                step.report(record, site.parts[step.name], fused=False, reason=reason)
    for site, decision in zip(sites, planning.decisions):
        if decision.plan is None:
            site.reason = decision.reason or "not rewritten"
    return sites


def elementwise_norm_note(analysis: Analysis) -> str | None:
    """The report's line on a graph's DynamicTanh / Derf (find.find_elementwise_norms), or None."""
    nodes = analysis.elementwise_norms
    if not nodes:
        return None
    where = sorted({module_info(n)[0] or n.name for n in nodes})
    shown = ", ".join(where[:4]) + (f" and {len(where) - 4} more" if len(where) > 4 else "")
    return (f"{len(nodes)} elementwise norm replacement(s) (DynamicTanh / Derf: tanh or erf of alpha * x, times w, "
            f"plus b) at {shown}: not norm sites; with no row statistic, the add before one and the function are "
            "one elementwise pass, which Inductor fuses (backend='normfuse_inductor'): a row kernel saves nothing")
