"""Check rewritten graphs against the originals they came from, site by site.

Each rewritten site is held to the subgraph it replaced (``numeric.check_site``,
``symbolic.prove_site``), on the values that reached it in a run of the original graph,
so a failure names the site instead of a far-away output. ``check_sites`` pairs a model's
rewritten graphs (its report's graph runs) with its original ones (``capture.record_graphs``);
``check_graph_on_first_call`` is the check behind ``FuseConfig(check=True)``, inside the
backend, on one graph and its first call's inputs.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from normfuse.reporting import FusionReport, Site
from normfuse.verify.numeric import OutputCheck, SiteNumeric, check_site, compare, failed_output, flatten, run_graph
from normfuse.verify.result import CheckResult, SiteCheck
from normfuse.verify.sites import as_the_pass_read, pair_sites
from normfuse.verify.symbolic import SymbolicResult, prove_site, representatives

__all__ = ["check_sites", "check_graph_sites", "compare_all", "result_of", "unpaired_graphs",
           "check_graph_on_first_call"]


def _placeholders(gm: fx.GraphModule) -> list[str]:
    """The graph's input names, without its symbolic sizes: dynamo captures a frame it already
    saw at another size with dynamic shapes, so the same graph may take ``s0`` or not."""
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"
            and not isinstance(n.meta.get("example_value", n.meta.get("val")), torch.SymInt)]


def unpaired_graphs(report: FusionReport, originals: list[tuple[fx.GraphModule, list[Any]]]) -> list[int]:
    """Rewritten graphs with fused sites that no original graph pairs with (by input names)."""
    names = [_placeholders(gm) for gm, _ in originals]
    nested = {r.graph for r in report.regions}  # paired through the graph that calls them
    fused_graphs = {g for s in report.fused for g in (s.graph, _top_graph(report, s.graph)) if g not in nested}
    return [g for g, gm in enumerate(report.graph_modules) if g in fused_graphs and _placeholders(gm) not in names]


def _top_graph(report: FusionReport, g: int) -> int:
    """The captured graph that (through nested regions) holds graph ``g``."""
    parents = {r.graph: r.parent for r in report.regions if r.graph is not None}
    while g in parents:
        g = parents[g]
    return g


def check_sites(report: FusionReport, originals: list[tuple[fx.GraphModule, list[Any]]],
                unverified_why: list[str]) -> list[SiteCheck]:
    """Numeric and symbolic check of every fused site of ``report`` against ``originals``
    (the untouched captures with their inputs), matched to the rewritten graphs by inputs;
    why a graph's sites went unchecked is appended to ``unverified_why``."""
    checks: list[SiteCheck] = []
    used: set[int] = set()
    nested = {r.graph for r in report.regions}
    for g, rewritten in enumerate(report.graph_modules):
        tree = _graph_tree(report, g)
        sites = [s for s in report.sites if s.graph in tree]
        if g in nested or not any(s.fused for s in sites):
            continue
        same = [i for i, (gm, _) in enumerate(originals) if _placeholders(gm) == _placeholders(rewritten)]
        match = next((i for i in same if i not in used), same[0] if same else None)
        if match is None:
            unverified_why.append(f"graph {g} ({sum(s.fused for s in sites)} fused sites): none of the "
                                  f"{len(originals)} captured original graphs has the same inputs (was the "
                                  "optimized model run on other inputs?)")
            continue
        used.add(match)
        checks += _check_tree(report, g, *originals[match], rewritten)
    return sorted(checks, key=lambda c: (c.graph, c.number))


def _graph_tree(report: FusionReport, g: int) -> set[int]:
    """Graph ``g`` and every nested subgraph under it."""
    tree = {g}
    for region in report.regions:
        if region.parent == g and region.graph is not None:
            tree |= _graph_tree(report, region.graph)
    return tree


def _check_tree(report: FusionReport, g: int, original: fx.GraphModule, inputs: list[Any],
                rewritten: fx.GraphModule) -> list[SiteCheck]:
    """The sites of graph ``g`` and of its nested subgraphs (each run on the values that
    reached its higher-order op in the original graph)."""
    checks, env = check_graph_sites(original, inputs, rewritten, [s for s in report.sites if s.graph == g])
    for region in report.regions:
        if region.parent != g or region.graph is None or region.graph >= len(report.graph_modules):
            continue
        call = next((n for n in original.graph.nodes if n.op == "call_function" and any(
            isinstance(a, fx.Node) and a.op == "get_attr" and a.target == region.name for a in n.args)), None)
        if call is None:
            continue
        body = next(i for i, a in enumerate(call.args) if isinstance(a, fx.Node) and a.target == region.name)
        sub_inputs = [env[a] for a in call.args[body + 1:] if isinstance(a, fx.Node)]
        checks += _check_tree(report, region.graph, getattr(original, region.name), sub_inputs,
                              report.graph_modules[region.graph])
    return checks


def check_graph_sites(original: fx.GraphModule, inputs: list[Any], rewritten: fx.GraphModule,
                      sites: list[Site]) -> tuple[list[SiteCheck], dict]:
    """Every fused site of one rewritten graph, against the original graph run on ``inputs``;
    returns the checks and every original node's value."""
    _, env = run_graph(original, inputs)
    checks = []
    if any(s.converted for s in sites):
        # the Pre-Norm conversion changed this graph's structure: no original subgraph lines up
        # with a site of it (the conversion's promise is checked on the whole stream instead)
        for s in (s for s in sites if s.fused):
            why = ("converted from Post-Norm to Pre-Norm: no original subgraph to compare with" if s.converted else
                   "in a graph the Pre-Norm conversion changed (its stream or its final norm): no original "
                   "subgraph to compare with")
            checks.append(SiteCheck(s.id, s.fqn, s.source, s.op, s.placement, s.kind, SiteNumeric.not_compared(why),
                                    SymbolicResult("unsupported", detail="not attempted: " + why),
                                    graph=s.graph, number=s.number))
        return checks, env
    paired = as_the_pass_read(original, rewritten)
    paired_env = env if paired is original else run_graph(paired, inputs)[1]
    equal = representatives(paired.graph)  # once per graph, for every site's proof
    for pair in pair_sites(paired, rewritten, sites):
        s = pair.site
        numeric = check_site(paired, pair, paired_env) if not (s.converted or s.residual_dtype) else SiteNumeric.not_compared(
            "converted from Post-Norm to Pre-Norm: no original subgraph to compare with" if s.converted
            else f"residual stream kept in {s.residual_dtype}: the sum differs from the original's")
        symbolic = prove_site(pair, equal=equal)
        for member in (s, *pair.partners):  # sites one call computes share its checks
            checks.append(SiteCheck(member.id, member.fqn, member.source, member.op, member.placement, member.kind,
                                    numeric, symbolic, graph=member.graph, number=member.number))
    return checks, env


def _structure(report: FusionReport, notes: list[str]) -> bool | None:
    from normfuse.verify.structure import check_structure
    ok, message = check_structure(report.graph_modules)
    if message:
        notes.append(f"structure: {message}")
    return bool(ok)


def compare_all(orig: dict, new: dict, ref: dict) -> list[OutputCheck]:
    checks = []
    for name, base in orig.items():
        cand, reference = new.get(name), ref.get(name)
        if base is None and cand is None:
            continue
        if not isinstance(base, torch.Tensor) or not base.is_floating_point():
            if isinstance(base, torch.Tensor) and isinstance(cand, torch.Tensor) and not torch.equal(base, cand):
                checks.append(failed_output(name, "integer output differs", base))
            continue
        if cand is None or reference is None:
            checks.append(failed_output(name, "missing in the optimized model" if cand is None else "missing in fp64",
                                        base))
            continue
        checks.append(compare(name, cand, base, reference))
    return checks


def result_of(outputs: list[OutputCheck], sites: list[SiteCheck], report: FusionReport,
            notes: list[str], unverified_why: list[str] = (), regrouping_ok: bool = True) -> CheckResult:
    widened = any(s.residual_dtype for s in report.sites)
    by_design = widened or any(s.converted for s in report.sites)
    failing = [s for s in sites if s.failed]
    res = CheckResult(ok=False, outputs=outputs, sites=sites, first_divergence=failing[0] if failing else None,
                      by_design=by_design, notes=notes, report=report)
    checked = {s.id for s in sites}
    # a widened stream's sites are compared as a whole model, by design (see _widened_note)
    res.unverified = sum(s.id not in checked and not s.residual_dtype for s in report.fused)
    if res.unverified:
        res.unverified_why = list(unverified_why) or ["the rewritten graphs could not be paired with the original's"]
        notes += res.unverified_why
    if widened and not any(s.converted for s in report.sites):
        # a wider stream must not be less accurate than the original: the usual rule holds
        notes.append(_widened_note(report, outputs))
        res.ok = all(o.passed for o in outputs) and not failing and regrouping_ok
    elif by_design:
        res.structure_ok = _structure(report, notes)
        worst = max((o.ratio for o in outputs), default=0.0)
        notes.append(f"Post-Norm -> Pre-Norm changes the function by design: outputs deviate from the original "
                     f"by up to {worst:.3g}x the original's own error; the structure is what is checked")
        res.ok = res.structure_ok is True
    else:
        res.ok = all(o.passed for o in outputs) and not failing and regrouping_ok
    return res


def _widened_note(report: FusionReport, outputs: list[OutputCheck]) -> str:
    """The accuracy of a widened residual stream next to the original's (max |err| vs fp64)."""
    dtype = next(s.residual_dtype for s in report.sites if s.residual_dtype)
    rows = ", ".join(f"{o.name} {o.max_abs:.3g} vs {o.err_original:.3g}" for o in outputs[:4])
    return (f"residual stream kept in {dtype} by design: error against fp64, optimized vs original: {rows}"
            + (" ..." if len(outputs) > 4 else ""))


def check_graph_on_first_call(gm: fx.GraphModule, graph_report: FusionReport, example_inputs: list[Any],
                              original: fx.GraphModule | None = None, defer: bool = False) -> fx.GraphModule:
    """The check behind ``FuseConfig(check=True)``: run the rewritten graph, the original graph
    and its fp64 reference once on the first call's inputs, hold every graph output and every
    fused site to the rule, and warn (RuntimeWarning naming the first diverging site) when it
    fails. Returns the GraphModule to run (``gm`` itself). ``defer``: check at the first call
    even when real example inputs are at hand (``fuse_graph`` has none)."""
    if original is None:
        message = ("normfuse check=True: the backend did not pass the original graph, so this graph was not "
                   "checked")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        graph_report.warnings.append(message)
        return gm
    if not defer and not any(isinstance(a, torch._subclasses.FakeTensor) for a in example_inputs):
        _check_graph(gm, graph_report, example_inputs, original)
        return gm
    checked = [False]
    forward = gm.forward

    def first_call(*args):
        if not checked[0]:
            checked[0] = True
            _check_graph(gm, graph_report, list(args), original)
        return forward(*args)

    gm.forward = first_call  # the instance attribute wins over the class's forward
    return gm


def _check_graph(gm: fx.GraphModule, graph_report: FusionReport, inputs: list[Any],
                 original: fx.GraphModule) -> None:
    inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in inputs]
    new_out, _ = run_graph(gm, inputs)
    orig_out, _ = run_graph(original, inputs)
    ref_out, _ = run_graph(original, inputs, fp64=True)
    outputs = compare_all(dict(flatten(orig_out)), dict(flatten(new_out)), dict(flatten(ref_out)))
    notes: list[str] = []
    # graph_report is this graph's own report: graph 0 is gm, the others its nested subgraphs
    sites = sorted(_check_tree(graph_report, 0, original, inputs, gm), key=lambda c: (c.graph, c.number))
    res = result_of(outputs, sites, graph_report, notes)
    if not res.ok:
        where = f"; first diverging site: {res.first_divergence}" if res.first_divergence else ""
        bad = [o.name for o in outputs if not o.passed]
        message = (f"normfuse check: the rewritten graph does not keep the original's numbers"
                   f"{where}" + (f"; outputs failing: {', '.join(bad[:5])}" if bad else "") +
                   ". Exclude the site with FuseConfig(filter_fn=...) and report it.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        graph_report.warnings.append(message)
