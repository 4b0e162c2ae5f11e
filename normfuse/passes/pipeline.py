"""The pass, one direction: analyze (canonicalize -> find -> classify) -> plan -> rewrite -> lint -> report.

``NormFusionPass(config)`` is the one object every way in goes through: ``optimize`` and
the dynamo backends call it on each captured graph, ``fuse_graph`` on any GraphModule,
``audit`` with ``apply=False``, and Inductor as a custom post-grad pass::

    torch._inductor.config.post_grad_custom_post_pass = normfuse.NormFusionPass()

(A graph Inductor serves from its FX-graph cache is not passed through the pass again, so
that pass object's report lists only the graphs it rewrote; ``uuid()`` keys the cache on
the pass's options and code.)

Per graph: ``analysis.analyze`` reads it (nothing writes to the analysis), ``planning.plan``
decides every fused call, ``rewrite.apply_plans`` applies them to a copy of the graph, which
is swapped in only when every stage succeeded, and ``provenance.site_records`` builds the
report from the analysis and the plans. Any failure leaves the user's graph untouched, with
one warning and, when the sites were already found, each listed with the failure as its
reason. The user's model must never break. Nested subgraphs of higher-order ops
(activation checkpointing, ``wrap``, ``invoke_subgraph``) are part of the model: the pass
descends into them, and a region it cannot enter is listed in the report with the reason.
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from normfuse.config import FuseConfig
from normfuse.kernels.qk_rope import KINDS as QK_KINDS
from normfuse.passes.analysis import Analysis, analyze
from normfuse.passes.dtensor_graph import hoist_from_local
from normfuse.passes.graph import copy_graph
from normfuse.passes.planning import Planning, plan
from normfuse.passes.provenance import elementwise_norm_note, site_record, site_records
from normfuse.passes.record import GraphSplits, attach_records, is_fused_call
from normfuse.passes.norm_over_slices import (past_no_op_casts, split_norm_over_slices, split_stores_into_cats,
                                              splittable)
from normfuse.passes.rope_over_cat import split_rope_over_cat
from normfuse.passes.rewrite import apply_plans
from normfuse.reporting import FusionReport, Region, Site

__all__ = ["NormFusionPass", "PassResult", "PassFailure", "STAGES", "ENTERED_REGIONS", "code_files"]

log = logging.getLogger("normfuse")

STAGES = ("canonicalize", "find", "classify", "plan", "rewrite", "lint")  # lint: graph.lint() of the rewritten graph

# Higher-order ops whose subgraph computes exactly what the region computes, so a rewritten
# subgraph keeps the region's meaning (checkpointing recomputes the same subgraph in
# backward). Other higher-order ops are listed in the report as regions not analyzed.
ENTERED_REGIONS = ("tag_activation_checkpoint", "wrap_activation_checkpoint", "wrap", "wrap_with_autocast",
                   "wrap_with_set_grad_enabled", "invoke_subgraph")


def code_files() -> tuple[str, ...]:
    """The files whose code decides what a rewritten graph computes: the pass, the ops its
    graphs call, and the words both read (Inductor's cache keys compiled graphs on them)."""
    package = Path(__file__).parent.parent
    files = [*package.glob("passes/**/*.py"), *package.glob("kernels/*.py"), package / "vocabulary.py"]
    return tuple(sorted(str(p) for p in files))


class PassFailure(Exception):
    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


def _steps_taken(site) -> set[str]:
    """What a site's call can take besides its norm: the steps found at it with no reason against them
    (a RoPE, the adaLN scale and shift, ...) and the add its norm reads."""
    taken = {name for name, found in site.parts.items() if getattr(found, "reason", None) is None}
    if site.in_add is not None and site.in_add.reason is None:
        taken.add("the add")
    return taken


@dataclass
class PassResult:
    """What one call of the pass did (``torch.fx.passes.infra``'s shape, plus the report)."""

    graph_module: fx.GraphModule
    report: FusionReport
    # per graph of this call, in the report's order: the analysis and the plans made from it
    # (the audit prices them); None for a graph the pass failed on
    analyses: list[tuple[Analysis, Planning] | None] = field(default_factory=list, repr=False)

    @property
    def modified(self) -> bool:
        return any(s.fused or s.converted for s in self.report.sites)


def _replace_contents(target: fx.Graph, source: fx.Graph) -> None:
    """Make ``target`` (a graph others hold, e.g. Inductor's) compute what ``source`` does."""
    for node in reversed(list(target.nodes)):
        node.users.clear()
        target.erase_node(node)
    output = target.graph_copy(source, {})
    target.output(output)


def _nested_regions(gm: fx.GraphModule) -> list[tuple[fx.Node, str, str]]:
    """(higher-order op call, attribute name of its subgraph, op name) for each subgraph
    ``gm`` passes to a higher-order op, in graph order."""
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
            continue
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "get_attr" and \
                    isinstance(getattr(gm, str(arg.target), None), fx.GraphModule):
                found.append((node, str(arg.target), node.target.name()))
    return found


# --------------------------------------------------------------------------- the pass

class NormFusionPass(CustomGraphPass):
    """Find, classify and rewrite every add -> norm site of a graph.

    ``pass_(gm) -> PassResult`` rewrites ``gm`` (a GraphModule) in place;
    ``pass_(graph)`` rewrites an ``fx.Graph`` in place (Inductor's custom-pass protocol).
    ``self.report`` gathers every graph this pass object has seen.

    model:  the ``nn.Module`` the graphs were captured from (the Pre-Norm conversion
            registers its final norms there).
    apply:  False analyzes only (the audit): sites are found, planned and reported, and
            the graph is left as it was.
    """

    def __init__(self, config: FuseConfig | None = None, *, model: torch.nn.Module | None = None,
                 apply: bool = True, report: FusionReport | None = None):
        self.config = config or FuseConfig()
        self.model = model
        self.apply = apply
        self.report = report if report is not None else FusionReport()
        self._current_stage = STAGES[0]
        self._as_op = False  # insert the custom ops themselves (graphs Inductor lowered to ATen)

    # --- Inductor's FX-graph cache keys compiled code on this (None: do not cache)
    def uuid(self) -> Any:
        if self.config.filter_fn is not None:
            return None  # a callable's behaviour cannot be hashed
        options = {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name != "filter_fn"}
        # the code is part of the key: an edited pass, or edited ops the rewritten graphs call,
        # must not reuse stale graphs
        return get_hash_for_files(code_files(), f"{sorted(options.items())} {self.apply}").hex()

    def __call__(self, target: fx.GraphModule | fx.Graph) -> PassResult:
        if isinstance(target, fx.GraphModule):
            return self.run(target)
        if isinstance(target, fx.Graph):
            gm = target.owning_module
            if not isinstance(gm, fx.GraphModule):
                raise TypeError("NormFusionPass needs the graph's owning GraphModule (its parameters and "
                                "subgraphs); call it with the GraphModule, or a graph that has one.")
            if self.config.check and not getattr(self, "_check_warned", False):
                self._check_warned = True
                warnings.warn("normfuse: check=True does not apply to Inductor's post-grad graphs (they run inside "
                              "Inductor's compiled code); check the model with normfuse.check(model, ...) instead.",
                              RuntimeWarning, stacklevel=2)
            holder = fx.GraphModule(gm, target)  # works on a copy of target, shares the submodules
            self._as_op = True
            try:
                result = self.run(holder)
            finally:
                self._as_op = False
            if result.modified:
                _replace_contents(target, holder.graph)
            return PassResult(gm, result.report)
        raise TypeError(f"NormFusionPass takes a torch.fx.GraphModule or Graph, got {type(target).__name__}.")

    def run(self, gm: fx.GraphModule) -> PassResult:
        """Rewrite ``gm`` and its nested subgraphs; the report of this call is added to
        ``self.report`` too."""
        report = FusionReport()
        if self.config.prenorm and self.apply:
            from normfuse.passes import prenorm
            report.extend(prenorm.convert_graph(gm, self.config, model=self.model))
        result = PassResult(gm, report)
        self._run_region(gm, result, parent=None, name=None)
        # self.report numbers graphs across calls; this call's report keeps its own numbers.
        # It holds no graph module: a pass object Inductor keeps must not keep every graph alive.
        self.report.extend(FusionReport(
            sites=[copy.copy(s) for s in report.sites], graphs=report.graphs, warnings=list(report.warnings),
            notes=list(report.notes), regions=[copy.copy(r) for r in report.regions]))
        return result

    def _run_region(self, gm: fx.GraphModule, result: PassResult, parent: int | None, name: str | None,
                    hop: str | None = None) -> None:
        report = result.report
        graph_report, analysis = self._fuse(gm)
        result.analyses.append(analysis)
        number = report.graphs
        if parent is not None:
            report.regions.append(Region(graph=number, parent=parent, name=name, op=hop, analyzed=True))
        report.extend(graph_report)
        for call, attr, op in _nested_regions(gm):
            sub = getattr(gm, attr)
            if op in ENTERED_REGIONS:
                self._run_region(sub, result, parent=number, name=attr, hop=op)
            else:
                report.regions.append(Region(
                    graph=None, parent=number, name=attr, op=op, analyzed=False,
                    reason=f"the subgraph of higher-order op {op} is not entered: the pass does not know that "
                           "a rewritten subgraph keeps that op's meaning"))

    # --- one graph
    def _stage(self, name: str) -> None:
        """Called as each stage starts (the failure names it; tests inject faults here)."""
        self._current_stage = name

    def _fuse(self, gm: fx.GraphModule) -> tuple[FusionReport, tuple | None]:
        """Find, classify and rewrite one graph (not its nested subgraphs), with the fallback;
        returns its report and its analysis (GraphIndex, site states; None after a failure)."""
        report = FusionReport(graphs=1)
        analysis = []
        self._current_stage = STAGES[0]
        # The pass allocates many small objects next to dynamo's large heap: with the cyclic
        # collector running, each collection rescans that heap and the pass stops being
        # linear in the graph size (128-layer llama: 1.1 s with it, 0.55 s without).
        collecting = gc.isenabled()
        gc.disable()
        try:
            report.sites = self._fuse_unsafe(gm, report, analysis)
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            failure = error if isinstance(error, PassFailure) else PassFailure(self._current_stage, error)
            message = (f"normfuse left this graph unchanged: the pass failed in stage {failure}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=3)
            report.warnings.append(message)
            log.debug("normfuse pass failure", exc_info=True)
            report.sites = self._sites_after_failure(gm, message)
            analysis.clear()
        finally:
            if collecting:
                gc.enable()
        if self.apply:  # graph_modules[g] is graph g (rewritten or, after a failure, as it was)
            report.graph_modules.append(gm)
        return report, (analysis[0] if analysis else None)

    def _splits_taken(self, graph: fx.Graph, found: Analysis, plain: dict[fx.Node, fx.Node]
                      ) -> tuple[tuple[str, str], ...]:
        """The norms to split per slice of their rows (passes/norm_over_slices.py), tried on a copy of
        the graph: those whose slices then take more steps the whole norm could not (a RoPE; a scale and
        shift, an add: HunyuanVideo I2V's first frame), counted over the slices, than the steps of the
        whole norm's call the slices lose (its add, when they read slices of the sum). ``plain``: the
        norms (output -> input) that may be split: where a slice is rotated, or two row slices or more
        read it. A split that takes nothing more costs a second norm call (and a cat where a store was)."""
        norms = splittable(plain, rotated=False)
        if not norms:  # (most graphs: no copy to make)
            return ()
        try:
            trial = copy_graph(graph)
            by_name = {n.name: n for n in trial.nodes}
            pieces: dict[str, tuple[str, list[str]]] = {}
            tried = split_norm_over_slices(trial, {by_name[y.name]: by_name[x.name] for y, x in norms.items()},
                                           rotated=False, pieces_of=pieces)
            if not tried:
                return ()
            whole = {site.match.output.name: _steps_taken(site) for site in found.sites}
            after = {}  # by the norm's output and by the no-op casts after it (a split ends at the last)
            for site in analyze(trial).sites:
                for node in {site.match.output, past_no_op_casts(site.match.output)}:
                    after[node.name] = _steps_taken(site)
        except Exception:  # noqa: BLE001 - a trial that fails splits nothing; the graph's other sites go on
            log.debug("normfuse: the trial split per slice failed; no norm is split", exc_info=True)
            return ()
        def pays(y: str) -> bool:
            before, made = whole.get(pieces[y][0], set()), [after.get(p, set()) for p in pieces[y][1]]
            gained = sum(len(steps - before) for steps in made)
            return gained > len(before - set.intersection(*made)) if made else False
        return tuple((y, x) for y, x in tried if pays(y))

    def _sites_after_failure(self, gm: fx.GraphModule, message: str) -> list[Site]:
        """The sites the pass would have rewritten, each with the failure as its reason."""
        try:
            sites = site_records(analyze(copy_graph(gm)))
        except Exception:  # noqa: BLE001 - the failure was in finding the sites: none to list
            log.debug("normfuse: sites not listed after a pass failure", exc_info=True)
            return []
        for site in sites:
            site.reason = message
        return sites

    def _fuse_unsafe(self, gm: fx.GraphModule, report: FusionReport, analysis: list) -> list[Site]:
        # work on a copy: the user's graph is swapped only when everything succeeded
        graph = copy_graph(gm)
        # sequence parallel: the add reaches its norm through DTensor.from_local; the wrap
        # moves onto the add's operands (same values), so the add feeds the norm
        hoist_from_local(graph)
        fused_calls = sum(1 for n in graph.nodes if is_fused_call(n))
        if fused_calls:
            report.notes.append(f"graph already optimized ({fused_calls} fused op calls): left as is")
        found = analyze(graph, self._stage)
        # (not in ATen post-grad graphs: no qk_norm_rope call is made there, and the splits write torch-level ops)
        splits = GraphSplits()
        if not self._as_op:
            rope = self.config.fuse_rope
            cats = split_rope_over_cat(graph, {s.match.output for s in found.sites}) if rope else ()
            plain = {s.match.output: s.match.input for s in found.sites
                     if s.match.group is None and s.match.layout is None and s.match.reason is None}
            qk = {s.match.output: s.match.input for s in found.sites  # the norms qk_norm_rope computes
                  if rope and s.match.kind in QK_KINDS and s.match.output in plain}
            taken = self._splits_taken(graph, found, plain)
            norms = split_norm_over_slices(graph, {}, only=taken) if taken else ()
            splits = GraphSplits(cats, norms, split_stores_into_cats(graph, set(qk)) if qk else ())
        if splits:
            found = analyze(graph, self._stage)  # each piece's norm now reads its own RoPE, add, scale and shift
        note = elementwise_norm_note(found)
        if note is not None:
            report.notes.append(note)
        self._stage("plan")
        config = self.config
        excluded = (lambda n: not config.filter_fn(site_record(found, found.sites[n]))) \
            if config.filter_fn is not None else (lambda n: False)
        planning = plan(found, config, self._as_op, excluded)
        analysis.append((found, planning))
        self._stage("rewrite")
        records = apply_plans(found, planning, self._as_op) if self.apply else []
        sites = site_records(found, planning, applied=self.apply)
        self._stage("lint")
        if self.apply:
            graph.lint()
            # lint walks the nodes forward; the generated code frees each value after its last use found
            # walking backward: a node moved with stale links would be freed before a call reads it
            if list(graph.nodes) != list(reversed(graph.nodes))[::-1]:
                raise RuntimeError("the rewritten graph's node list differs walked forward and backward")
            gm.graph = graph  # the setter recompiles the module's code
            attach_records(gm, records, splits)  # what each call replaced, for the checker (record.py)
        return sites
