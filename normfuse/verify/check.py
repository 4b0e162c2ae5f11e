"""Did the rewrite keep the model? ``normfuse.check`` and ``normfuse check TARGET``.

    res = normfuse.check(model, *example_args, **example_kwargs)
    res.ok                  # every output, gradient and rewritten site passed
    res.outputs             # per output / gradient: error vs fp64, the original's error, the bound
    res.sites               # per rewritten site: numeric check vs its original subgraph, symbolic proof
    res.first_divergence    # the first failing site in graph order (id, fqn, source) or None

Three runs on the same inputs: the original model, the optimized one and an fp64 copy of
the original (``numeric.Fp64Mode`` widens the casts in its code). Each output and each
gradient (floating inputs, every parameter) passes when
``err(optimized, fp64) <= m * err(original, fp64) + atol`` (``normfuse.tolerances``).
Each rewritten site is then held to the subgraph it replaced (``numeric.check_site``,
``symbolic.prove_site``), on the values that reached it in a run of the original graph,
so a failure names the site instead of a far-away output.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.capture import record_graphs
from normfuse.errors import InvalidModelError, NormfuseError
from normfuse.preparation import prepare
from normfuse.reporting import FusionReport, Site
from normfuse.verify.numeric import (Fp64Mode, OutputCheck, SiteNumeric, check_site, compare,
                                     failed_output, flatten, fp64_copy, model_copy, perturb_vectors, run_graph,
                                     tensors_with_history, to_fp64)
from normfuse.verify.sites import pair_sites
from normfuse.verify.symbolic import SymbolicResult, prove_site

__all__ = ["check", "CheckResult", "SiteCheck", "register_cli", "check_graph_on_first_call"]


@dataclass
class SiteCheck:
    """One rewritten site: its numeric check against the original subgraph and its proof."""

    id: str
    fqn: str | None
    source: str | None
    op: str | None
    placement: str
    kind: str
    numeric: SiteNumeric
    symbolic: SymbolicResult
    graph: int = 0
    number: int = 0

    @property
    def compared(self) -> bool:
        """Whether the site was compared with its original subgraph (a converted or widened site
        is not, by design: it is neither passed nor failed)."""
        return self.numeric.compared

    @property
    def passed(self) -> bool:
        return self.compared and self.numeric.passed and self.symbolic.status != "refuted"

    @property
    def failed(self) -> bool:
        return (self.compared and not self.numeric.passed) or self.symbolic.status == "refuted"

    @property
    def reason(self) -> str | None:
        if self.passed:
            return None
        if not self.failed:
            return f"not compared: by design ({self.numeric.reason})"
        parts = [] if self.numeric.passed or not self.compared else [self.numeric.reason]
        if self.symbolic.status == "refuted":
            parts.append(f"symbolic: refuted ({self.symbolic.detail})")
        return "; ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "fqn": self.fqn, "source": self.source, "op": self.op, "placement": self.placement,
                "kind": self.kind, "passed": self.passed, "failed": self.failed, "compared": self.compared,
                "reason": self.reason, "numeric": self.numeric.to_dict(), "symbolic": self.symbolic.to_dict()}

    def __str__(self) -> str:
        return f"{self.id} {self.fqn or '?'} ({self.source or 'no source line'})"


def _site_result(site: SiteCheck) -> str:
    if site.failed:
        return f"FAIL: {site.reason}"
    if not site.passed:
        return site.reason  # not compared: by design (...)
    # a folded dropout draws another mask than eager's: equal once that mask is replayed
    return "ok (equal given the mask)" if site.numeric.given_mask else "ok"


@dataclass
class CheckResult:
    """What ``normfuse.check`` found; ``print(res)`` gives the tables, ``res.to_dict()`` the data."""

    ok: bool
    outputs: list[OutputCheck] = field(default_factory=list)
    sites: list[SiteCheck] = field(default_factory=list)
    first_divergence: SiteCheck | None = None
    by_design: bool = False             # Post-Norm -> Pre-Norm conversion: the function changes on purpose
    structure_ok: bool | None = None    # the residual stream promise of that conversion
    notes: list[str] = field(default_factory=list)
    # fused sites with no site check, and why (the headline says so whenever there are any)
    unverified: int = 0
    unverified_why: list[str] = field(default_factory=list)
    report: FusionReport | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        ratios = [o.ratio for o in self.outputs if o.ratio != float("inf")]
        statuses = [s.symbolic.status for s in self.sites]
        return {
            "ok": self.ok, "outputs": len(self.outputs), "outputs_failed": sum(not o.passed for o in self.outputs),
            "max_error_ratio": max(ratios, default=0.0),
            "sites": len(self.sites), "sites_failed": sum(s.failed for s in self.sites),
            "sites_passed": sum(s.passed for s in self.sites),
            "sites_not_compared": sum(not s.compared and not s.failed for s in self.sites),
            "proved": statuses.count("proved"), "refuted": statuses.count("refuted"),
            "unsupported": statuses.count("unsupported"), "sites_unverified": self.unverified,
            "max_site_ulp": max((o.ulp_max for s in self.sites for o in s.numeric.outputs), default=0.0),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "outputs": [o.to_dict() for o in self.outputs],
                "sites": [s.to_dict() for s in self.sites],
                "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
                "by_design": self.by_design, "structure_ok": self.structure_ok, "notes": list(self.notes),
                "unverified_why": list(self.unverified_why)}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), default=_json_default, **kwargs)

    def __str__(self) -> str:
        s = self.summary()
        verdict = "EQUIVALENT" if self.ok else "NOT EQUIVALENT"
        if self.by_design:
            verdict = f"CHANGED BY DESIGN (Post-Norm -> Pre-Norm), structure {'kept' if self.structure_ok else 'NOT kept' if self.structure_ok is False else 'not checked'}"
        lines = [f"normfuse check: {verdict}: {s['outputs'] - s['outputs_failed']}/{s['outputs']} outputs and "
                 f"gradients pass, {s['sites_passed']}/{s['sites']} sites pass"
                 + (f" ({s['sites_not_compared']} not compared: by design)" if s['sites_not_compared'] else "") + " "
                 f"({s['proved']} proved, {s['refuted']} refuted, {s['unsupported']} unsupported); "
                 f"largest error ratio {s['max_error_ratio']:.3g}"]
        if self.unverified:
            lines[0] += (f"; {self.unverified} of {self.unverified + s['sites']} fused sites not verified: "
                         + "; ".join(self.unverified_why or ["unknown"]))
        lines.append("")
        lines.append(f"  {'output':48s} {'dtype':15s} {'err':>9s} {'err orig':>9s} {'ratio':>6s} {'bound':>9s} "
                     f"{'ulp':>5s} {'diff%':>6s}  pass")
        forward = [o for o in self.outputs if not o.name.startswith("grad:")]
        grads = sorted((o for o in self.outputs if o.name.startswith("grad:")),
                       key=lambda o: (o.passed, -o.ratio))
        shown = forward + grads[:8]
        for o in shown:
            lines.append(f"  {o.name[:48]:48s} {o.dtype:15s} {o.max_abs:9.2e} {o.err_original:9.2e} "
                         f"{o.ratio:6.2f} {o.tolerance:9.2e} {o.ulp_max:5.0f} {100 * o.mismatch:6.2f}  "
                         f"{'ok' if o.passed else 'FAIL: ' + str(o.reason)}")
        if len(grads) > 8:
            rest = grads[8:]
            lines.append(f"  ... {len(rest)} more gradients, {sum(o.passed for o in rest)} pass")
        if self.sites:
            lines.append("")
            lines.append(f"  {'site':8s} {'fqn':40s} {'op':9s} {'ulp':>4s} {'diff%':>6s} {'symbolic':12s} result")
            for site in self.sites:
                outs = site.numeric.outputs
                ulp = max((o.ulp_max for o in outs), default=0.0)
                diff = max((o.mismatch for o in outs), default=0.0)
                sym = site.symbolic.status
                numbers = f"{ulp:4.0f} {100 * diff:6.2f}" if site.compared else f"{'-':>4s} {'-':>6s}"
                lines.append(f"  {site.id:8s} {(site.fqn or '?')[:40]:40s} {site.op or '?':9s} {numbers} "
                             f"{sym:12s} {_site_result(site)}")
        if self.first_divergence is not None:
            lines.append("")
            lines.append(f"first divergence: {self.first_divergence}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _json_default(value: Any) -> Any:
    return str(value)  # dtypes, tuples of SymInts, ...


# --------------------------------------------------------------------------- runs

def _inputs_with_grad(args: tuple, kwargs: dict, backward: bool) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    """Fresh copies of the floating inputs (requiring grad when ``backward``) and their names."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def fresh(name, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().clone().requires_grad_(backward)
            leaves.append((name, value))
        return value

    new_args = tuple(fresh(f"input[{i}]", a) for i, a in enumerate(args))
    new_kwargs = {k: fresh(f"input.{k}", v) for k, v in kwargs.items()}
    return new_args, new_kwargs, leaves


def _named_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name.removeprefix("_orig_mod."), p) for name, p in model.named_parameters() if p.requires_grad]


def _run(model: nn.Module, args: tuple, kwargs: dict, backward: bool, seed: int,
         fp64: bool = False) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """Forward (and backward) of one model: (outputs by name, gradients by name).

    The backward pulls a fixed random cotangent (drawn in fp64 from ``seed``, then cast to
    each output's dtype) through every floating output."""
    args, kwargs, leaves = _inputs_with_grad(args, kwargs, backward)
    # the fp64 mode covers backward too: checkpointed regions recompute their forward there
    with torch.set_grad_enabled(backward), (Fp64Mode() if fp64 else contextlib.nullcontext()):
        return _forward_backward(model, args, kwargs, leaves, backward, seed, fp64)


def _forward_backward(model: nn.Module, args: tuple, kwargs: dict, leaves: list, backward: bool, seed: int,
                      fp64: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    out = model(*args, **kwargs)
    outputs = dict(flatten(out))
    grads: dict[str, torch.Tensor | None] = {}
    if backward:
        cotangents = _cotangents(outputs, seed)
        differentiable = [(k, v) for k, v in outputs.items() if v.requires_grad and v.is_floating_point()]
        wrt = leaves + _named_parameters(model)
        if differentiable and wrt:
            grad = Fp64Mode.grad if fp64 else functools.partial(torch.autograd.grad, allow_unused=True)
            got = grad([v for _, v in differentiable], [t for _, t in wrt],
                       [cotangents[k].to(v.dtype) for k, v in differentiable])
            grads = {f"grad:{name}": g for (name, _), g in zip(wrt, got)}
    return {k: v.detach() for k, v in outputs.items()}, grads


def _cotangents(outputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device)
            for k, v in outputs.items() if v.is_floating_point()}


# --------------------------------------------------------------------------- sites

def _placeholders(gm: fx.GraphModule) -> list[str]:
    """The graph's input names, without its symbolic sizes: dynamo captures a frame it already
    saw at another size with dynamic shapes, so the same graph may take ``s0`` or not."""
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"
            and not isinstance(n.meta.get("example_value", n.meta.get("val")), torch.SymInt)]


def _unpaired(report: FusionReport, originals: list[tuple[fx.GraphModule, list[Any]]]) -> list[int]:
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
    for pair in pair_sites(original, rewritten, sites):
        s = pair.site
        numeric = check_site(original, pair, env) if not (s.converted or s.residual_dtype) else SiteNumeric.not_compared(
            "converted from Post-Norm to Pre-Norm: no original subgraph to compare with" if s.converted
            else f"residual stream kept in {s.residual_dtype}: the sum differs from the original's")
        symbolic = prove_site(pair)
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


# --------------------------------------------------------------------------- the API

def _progress(callback: Callable[[str], None] | None, message: str) -> None:
    if callback is not None:
        callback(message)


def check(model: nn.Module, *example_args: Any, optimized: nn.Module | None = None, backward: bool = True,
          seed: int = 0, progress: Callable[[str], None] | None = None, **example_kwargs: Any) -> CheckResult:
    """Check that ``optimized`` (default: ``normfuse.optimize`` of a deep copy of ``model``) computes
    what ``model`` computes, output by output, gradient by gradient and site by site.

    example_args / example_kwargs: the inputs; made for transformers models and
    ``zoo.ToyTransformer`` when none are given. backward: also compare the gradients of
    floating inputs and of every parameter. progress: called with a line per stage.
    ``model`` itself is never changed.
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"check takes the original torch.nn.Module, got {type(model).__name__}.")
    if optimized is not None and not isinstance(optimized, nn.Module):
        raise InvalidModelError(f"optimized must be an nn.Module optimized by normfuse, got "
                                f"{type(optimized).__name__}.")
    import normfuse

    args, kwargs = example_args, example_kwargs
    if not args and not kwargs:
        from normfuse.targets import make_inputs
        try:
            args, kwargs = make_inputs(model)
        except NormfuseError as error:
            raise InvalidModelError(f"no example inputs given and none can be made: {error} Pass them: "
                                    "normfuse.check(model, *args, **kwargs).") from error
    notes: list[str] = []
    if model.training:
        notes.append("the model is in training mode: dropout makes runs differ; call model.eval() first")
    cached = tensors_with_history(model)
    if optimized is None:
        _progress(progress, "optimizing a deep copy")
        optimized = normfuse.optimize(model_copy(model))
    model64 = fp64_copy(model)  # before the first run: the copies start from the model's state as given
    regrouped = _regrouped_copy(model, optimized)
    # capture first too, so that the original's graphs come from the state the copies start
    # from (a model filling a cache on its first call traces another graph once it is filled).
    # Sites of a regrouped stream are held to the regrouped model's graphs, which have the
    # same cut between blocks; the regrouping itself is compared with the original below.
    _progress(progress, "capturing the original graph to localize")
    originals = record_graphs(regrouped or model, args, kwargs, backward)
    _progress(progress, "running the original, the optimized model and the fp64 reference")
    rng = _rng_states()
    out_orig, grad_orig = _run(model, args, kwargs, backward, seed)
    regrouping_ok = True
    if regrouped is not None:
        with _replaying(rng):  # the same dropout masks as the original's run
            got = _run(regrouped, args, kwargs, backward, seed)
        regrouping_ok, note = _regrouping(regrouped, got, (out_orig, grad_orig))
        notes.append(note)
    out_new, grad_new = _run(optimized, args, kwargs, backward, seed)
    out_ref, grad_ref = _run(model64, to_fp64(args), to_fp64(kwargs), backward, seed, fp64=True)
    report = normfuse.report(optimized)
    notes += [f"pass: {w}" for w in report.warnings]
    if not report.fused:
        notes.append("the pass rewrote no site: the optimized model runs the original graph")
    if cached:
        # the copies hold these detached: a gradient that reaches a parameter only through
        # them exists in the original alone, and is not a difference the rewrite made
        only_original = sorted(k for k, g in grad_orig.items() if g is not None and grad_new.get(k) is None
                               and grad_ref.get(k) is None)
        for k in only_original:
            del grad_orig[k]
        notes.append(f"the model holds tensors with autograd history ({', '.join(list(cached)[:3])}: a cache built "
                     "from parameters?); the optimized and fp64 copies hold them detached, so gradients through them "
                     f"are not compared ({', '.join(only_original) or 'none'})")
    outputs = _compare_all({**out_orig, **grad_orig}, {**out_new, **grad_new}, {**out_ref, **grad_ref})

    if _unpaired(report, originals):  # e.g. ``optimized`` compiled with torch.compile(backend="normfuse")
        originals += record_graphs(model, args, kwargs, backward, like_optimize=False)
    unverified_why: list[str] = []
    if not originals:
        unverified_why.append("dynamo captured no graph of the original model (recompile limit reached? call "
                              "torch._dynamo.reset())")
    _progress(progress, f"checking {len(report.fused)} rewritten sites (numeric and symbolic)")
    sites = check_sites(report, originals, unverified_why) if originals else []
    return _result(outputs, sites, report, notes, unverified_why, regrouping_ok)


def _regrouped_copy(model: nn.Module, optimized: nn.Module) -> nn.Module | None:
    """A copy of ``model`` with the streams that ``optimized`` carries across blocks regrouped
    the same way (normfuse.passes.boundary), or None when it carries none."""
    from normfuse.passes.cross_block import crosses_checkpoints, rewritten_streams

    if not rewritten_streams(optimized):
        return None
    regrouped = model_copy(model)
    prepare(regrouped, cross_checkpoints=crosses_checkpoints(optimized))
    return regrouped


def _rng_states() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []


@contextlib.contextmanager
def _replaying(states: tuple):
    """Run with the random states ``states``, then go on from the states before."""
    cpu, cuda = states
    with torch.random.fork_rng(devices=range(len(cuda))):
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        yield


def _regrouping(regrouped: nn.Module, got: tuple[dict, dict], want: tuple[dict, dict]) -> tuple[bool, str]:
    """The regrouping moves adds across block boundaries and changes no operand: its outputs
    and gradients must equal the original's bit for bit. (Whether they do, and the note.)"""
    from normfuse.passes.cross_block import rewritten_streams

    streams = ", ".join(fqn or type(regrouped).__name__ for fqn in rewritten_streams(regrouped))
    (out, grad), (out_want, grad_want) = got, want
    values, wanted = {**out, **grad}, {**out_want, **grad_want}
    differ = [name for name in wanted if not _same(values.get(name), wanted[name])]
    if differ:
        return False, (f"cross-block: the regrouped model differs from the original ({streams}) in "
                       f"{len(differ)} values: {', '.join(differ[:4])}")
    return True, (f"cross-block: the residual pairs carried across the blocks of {streams}: the regrouped model "
                  f"equals the original bit for bit in all {len(wanted)} outputs and gradients")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a is None and b is None


def _compare_all(orig: dict, new: dict, ref: dict) -> list[OutputCheck]:
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


def _result(outputs: list[OutputCheck], sites: list[SiteCheck], report: FusionReport,
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


# --------------------------------------------------------------------------- inside the backend

def check_graph_on_first_call(gm: fx.GraphModule, graph_report: FusionReport, example_inputs: list[Any],
                              original: fx.GraphModule | None = None) -> fx.GraphModule:
    """The check behind ``FuseConfig(check=True)``: run the rewritten graph, the original graph
    and its fp64 reference once on the first call's inputs, hold every graph output and every
    fused site to the rule, and warn (RuntimeWarning naming the first diverging site) when it
    fails. Returns the GraphModule to run (``gm`` itself)."""
    if original is None:
        message = ("normfuse check=True: the backend did not pass the original graph, so this graph was not "
                   "checked")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        graph_report.warnings.append(message)
        return gm
    if not any(isinstance(a, torch._subclasses.FakeTensor) for a in example_inputs):
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
    outputs = _compare_all(dict(flatten(orig_out)), dict(flatten(new_out)), dict(flatten(ref_out)))
    notes: list[str] = []
    # graph_report is this graph's own report: graph 0 is gm, the others its nested subgraphs
    sites = sorted(_check_tree(graph_report, 0, original, inputs, gm), key=lambda c: (c.graph, c.number))
    res = _result(outputs, sites, graph_report, notes)
    if not res.ok:
        where = f"; first diverging site: {res.first_divergence}" if res.first_divergence else ""
        bad = [o.name for o in outputs if not o.passed]
        message = (f"normfuse check: the rewritten graph does not keep the original's numbers"
                   f"{where}" + (f"; outputs failing: {', '.join(bad[:5])}" if bad else "") +
                   ". Exclude the site with FuseConfig(filter_fn=...) and report it.")
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        graph_report.warnings.append(message)


# --------------------------------------------------------------------------- command line

def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "check", help="check that fusing a model keeps its outputs, gradients and every site's math",
        description="Optimize a copy of the model, then compare it with the original and an fp64 reference "
                    "(forward and backward), localize each rewritten site and prove it symbolically. "
                    "Exit code 0 when equivalent, 1 when not, 2 when the target cannot be loaded.")
    p.add_argument("target", help="hf:<model_type> | path/to/config.json | file.py:factory | package.module:factory")
    p.add_argument("--dtype", default="fp32", help="parameter/activation dtype: fp32 (default), bf16, fp16")
    p.add_argument("--layers", type=int, default=None, help="layer count of a transformers config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field (hf/config.json) or pass a factory keyword; repeatable")
    p.add_argument("--full", action="store_true",
                   help="hf:<model_type>: the config's own sizes (default: shrunk to 2 layers, hidden 64)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=8)
    p.add_argument("--no-backward", action="store_true", help="compare the forward outputs only")
    p.add_argument("--keep-init", action="store_true",
                   help="check the model as built; by default its 1-D parameters (norm weights, biases) get "
                        "small noise first, since weights of exactly 1 hide rounding-order faults")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run_cli)


def _load(args):
    """(model, args, kwargs) of the target; ``hf:<type>`` is shrunk (zoo.TINY_HF) unless --full."""
    from normfuse import targets, zoo
    from normfuse.errors import TargetError, closest

    overrides = targets.parse_overrides(args.set)
    dtype = targets.parse_dtype(args.dtype)
    if not args.target.startswith("hf:") or args.full:
        return targets.load_target(args.target, layers=args.layers, overrides=overrides, dtype=dtype,
                                   batch=args.batch, seq=args.seq)
    model_type = args.target[3:].strip()
    targets._hf_config_for_type(model_type)  # the loader's message for an unknown type
    config = zoo.hf_config(model_type)
    for key in overrides:
        if not hasattr(config, key):
            raise TargetError(f"{type(config).__name__} has no field {key!r}.{closest(key, config.to_dict())} "
                              "--set only changes fields the config already has.")
    if args.layers is not None:
        overrides.update({f: args.layers for f in targets.LAYER_FIELDS if hasattr(config, f)})
    model = zoo.hf_model(model_type, dtype=dtype or torch.float32, **overrides)
    margs, mkwargs = targets.make_inputs(model, args.batch, args.seq)
    return model, margs, mkwargs


def _run_cli(args) -> int:
    from normfuse.errors import TargetError

    started = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)

    progress(f"loading {args.target}")
    try:
        model, margs, mkwargs = _load(args)
    except (TargetError, NormfuseError) as error:
        print(f"normfuse check: {error}", file=sys.stderr)
        return 2
    if not args.keep_init:
        perturb_vectors(model)
    res = check(model, *margs, backward=not args.no_backward, progress=progress, **mkwargs)
    progress("done")
    print(res.to_json(indent=2) if args.json else res)
    return 0 if res.ok else 1
