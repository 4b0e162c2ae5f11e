"""The pass, one direction: canonicalize -> find -> classify -> rewrite -> report.

``run(gm, config)`` rewrites a copy of the graph and swaps it in only when every stage
succeeded; any failure leaves the user's graph untouched, with one warning and the
reason in the report. The user's model must never break.
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings

import torch.fx as fx

from normfuse.config import FuseConfig
from normfuse.passes.canonical import canonicalize, node_dtype
from normfuse.passes.classify import SiteState, classify
from normfuse.passes.find import (GraphIndex, find_input_add, find_norms, find_output_add, is_norm_module_class,
                                  module_class, module_info, source_of)
from normfuse.passes import rewrite
from normfuse.reporting import FusionReport, Site

__all__ = ["run", "analyze", "copy_graph_module", "STAGES", "PassFailure"]

log = logging.getLogger("normfuse")

STAGES = ("canonicalize", "find", "classify", "rewrite", "verify")

# Tests inject a failure into a stage by name, to prove the fallback.
_FAULT_INJECTION: dict[str, Exception] = {}


class PassFailure(Exception):
    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"{stage}: {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


# the stage running now, so that a failure names the stage it happened in
_CURRENT_STAGE = ["canonicalize"]


def _stage(name: str):
    _CURRENT_STAGE[0] = name
    fault = _FAULT_INJECTION.get(name)
    if fault is not None:
        raise fault


def _site_record(index: GraphIndex, st: SiteState, number: int) -> Site:
    m = st.match
    fqn, cls = module_info(m.output) if m.output.meta.get("nn_module_stack") else module_info(m.anchor or m.output)
    # a norm call made by a torch norm module (nn.LayerNorm, nn.RMSNorm) is reported as "module"
    form = "module" if m.form in ("functional", "call_module") and is_norm_module_class(module_class(
        m.output)) else m.form
    # a norm moved by the Pre-Norm conversion (normfuse/passes/prenorm.py) is a pre-norm,
    # also the first one of a stream, which no add feeds
    converted = bool(m.output.meta.get("normfuse_converted"))
    return Site(
        id=f"g0.s{number}", kind=m.kind, form=form, placement="pre" if converted else st.placement,
        converted=converted,
        input_is_add=st.input_is_add, output_feeds_add=st.output_feeds_add,
        hidden_size=m.hidden_size, dtype=str(node_dtype(m.input)) if node_dtype(m.input) else None,
        eps=m.eps, fqn=fqn, source=source_of(m.output) or source_of(m.anchor or m.output),
        weight_offset=m.weight_offset,
        residual_scale=st.in_add.residual_scale if st.in_add is not None else 1.0,
        norm_round_dtype=str(m.norm_round_dtype) if m.norm_round_dtype else None,
        out_dtype=str(m.out_dtype) if m.out_dtype else None, module_type=cls)


def analyze(graph: fx.Graph) -> tuple[GraphIndex, list[SiteState]]:
    """Canonicalize, find and classify, without changing the graph."""
    _stage("canonicalize")
    index = GraphIndex(graph, canonicalize(graph))
    _stage("find")
    states = []
    for m in find_norms(index):
        st = SiteState(match=m, in_add=find_input_add(index, m))
        out = find_output_add(index, m)
        if out is not None:
            st.out_add, st.out_chain = out
        states.append(st)
    _stage("classify")
    classify(index, states)
    return index, states


def _copy_graph(gm: fx.GraphModule) -> fx.Graph:
    """A copy of gm's graph; nodes keep their meta and the attributes dynamo set on them."""
    graph = fx.Graph(owning_module=gm, tracer_cls=getattr(gm.graph, "_tracer_cls", None))
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    value_map: dict[fx.Node, fx.Node] = {}
    output = graph.graph_copy(gm.graph, value_map)
    graph.output(output)
    for old, new in value_map.items():
        for key, value in vars(old).items():  # e.g. placeholders' _dynamo_source
            if key.startswith("_dynamo") and not hasattr(new, key):
                setattr(new, key, value)
    return graph


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over a copy of ``gm``'s graph (node names, meta and dynamo's node
    attributes kept), sharing its submodules: the untouched graph to run or compare with."""
    return fx.GraphModule(gm, _copy_graph(gm), class_name=type(gm).__name__)


def _already_fused(graph: fx.Graph) -> int:
    return sum(1 for n in graph.nodes if n.op == "call_function" and n.target in rewrite.FUSED_TARGETS)


def run(gm: fx.GraphModule, config: FuseConfig | None = None, *, apply: bool = True) -> FusionReport:
    """Find, classify and (when ``apply``) rewrite every site of ``gm`` in place."""
    config = config or FuseConfig()
    report = FusionReport(graphs=1)
    _CURRENT_STAGE[0] = "canonicalize"
    # The pass allocates many small objects next to dynamo's large heap: with the cyclic
    # collector running, each collection rescans that heap and the pass stops being
    # linear in the graph size (128-layer llama: 1.1 s with it, 0.55 s without).
    collecting = gc.isenabled()
    gc.disable()
    try:
        report.sites = _run(gm, config, report, apply)
    except Exception as error:  # noqa: BLE001 - the user's model must never break
        failure = error if isinstance(error, PassFailure) else PassFailure(_CURRENT_STAGE[0], error)
        message = (f"normfuse left this graph unchanged: the pass failed in stage {failure}. "
                   "Please report it with the model that triggers it.")
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        report.warnings.append(message)
        log.debug("normfuse pass failure", exc_info=True)
    finally:
        if collecting:
            gc.enable()
    return report


def _run(gm: fx.GraphModule, config: FuseConfig, report: FusionReport, apply: bool) -> list[Site]:
    # work on a copy: the user's graph is swapped only when everything succeeded
    graph = _copy_graph(gm)
    fused_calls = _already_fused(graph)
    if fused_calls:
        report.notes.append(f"graph already optimized ({fused_calls} fused op calls): left as is")
    try:
        index, states = analyze(graph)
    except PassFailure:
        raise
    except Exception as error:
        raise PassFailure(_CURRENT_STAGE[0], error) from error
    sites = [_site_record(index, st, i) for i, st in enumerate(states)]
    _stage("rewrite")
    claimed: set = set()
    reserved = {st.in_add.node for st in states if st.in_add is not None and st.in_add.reason is None}
    for st, site in zip(states, sites):
        if config.filter_fn is not None and not config.filter_fn(site):
            site.reason = "excluded by filter_fn"
            continue
        p, reason = rewrite.plan(index, st, claimed, reserved, config.fuse_output_add)
        if p is None:
            site.reason = reason
            continue
        if p.op == "norm" and not config.standalone:
            site.reason = "standalone norms not rewritten (standalone=False)"
            continue
        site.add_reason = rewrite.add_reason(st, p, claimed, reserved, config.fuse_output_add)
        # an add folded into one kernel is not folded into another, in analysis mode too
        for node in (st.in_add.node if p.op == "add_norm" else None, p.post_add):
            if node is not None:
                claimed.add(node)
        if not apply:
            site.reason = "not applied (analysis only)"
            site.op = p.op
            continue
        rewrite.apply(index, p)
        site.fused, site.op = True, p.op
        site.fused_add = p.op in ("add_norm", "norm_add")
        site.residual_scale = p.residual_scale
        site.sum_dtype = str(p.sum_dtype) if p.sum_dtype is not None else None
        if p.op == "add_norm" and not site.input_is_add:
            site.input_is_add = True
    # a site that shares its add with an earlier fused site reads that site's sum
    for st, site in zip(states, sites):
        if not site.fused and site.reason is None:
            site.reason = "not rewritten"
    for node in list(graph.nodes):  # parameters read only by a norm that is gone now
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    if apply:
        _stage("verify")
        graph.lint()
        gm.graph = graph
        gm.recompile()
    return sites
