"""Post-Norm -> Pre-Norm: turn every ``y = norm(x + F(x))`` block into ``y = x + F(norm(x))``.

This rewrite changes the model's function on purpose (Xiong et al. 2020: a Pre-Norm
stack keeps the residual path free of norm Jacobians, so deep stacks train without
learning-rate warm-up). Three parts, three modules:

- ``prepare_module(model)`` (normfuse/passes/prenorm_model.py; called by ``optimize(model, prenorm=True)`` before capture)
  registers one **final norm** per residual stream on the model, initialized to identity
  (weight 1, bias 0), so it trains, saves and loads like any parameter. The first call
  removes those of streams it leaves as they were (a Pre-Norm model gets no new parameter).
- ``convert_graph(gm, config, model)`` (here; run by ``NormFusionPass`` before fusing)
  rewrites the captured graph.
- ``check_structure(graph_modules)`` (``normfuse/verify/structure.py``) checks the promise on the rewritten graphs: from the
  first converted block's input to the final norm, the residual stream passes through
  adds only.

Parameter mapping: the norm that followed sublayer ``k`` (``norm_k(x + F_k(x))``) becomes
the pre-norm of the same sublayer ``k`` (``x + F_k(norm_k(x))``): BERT's
``attention.output.LayerNorm`` normalizes the attention's input, ``output.LayerNorm`` the
feed-forward's input. The stream after the last converted block of each stream goes
through the new final norm (``<parent of the block list>.normfuse_final_norm``) unless
the stream already ends in a norm. DeepNorm ``norm(a*x + F(x))`` is converted with the
scale ``a`` dropped (``x + F(norm(x))``): on an un-normalized stream ``a`` would compound
to ``a**(2L)``. Embedding norms (``norm(tok + pos)``) are not blocks and stay.

Streams are converted whole: a block that cannot be converted (the branch cannot be
told from the stream, or reads values from outside) leaves its whole stream as it was,
with the reason in the report's notes and warnings.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from normfuse.config import FuseConfig
from normfuse.passes.analysis import analyze
from normfuse.passes.canonical import node_dtype, node_shape, same_shape, tensor_meta
from normfuse.passes.find import is_pass_through
from normfuse.passes.graph import GraphIndex, dependency_graph, module_paths
from normfuse.passes.prenorm_model import (FINALS_ATTR, drop_unused_finals, final_norm_like, final_norms,
                                           prepare_module, register_final)
from normfuse.passes.provenance import site_record
from normfuse.reporting import FusionReport
from normfuse.vocabulary import CONVERTED_META, FINAL_META, FINAL_NORM_NAME, GRAPH_META, POST_FAMILY

__all__ = ["prepare_module", "convert_graph", "final_norms"]


CANDIDATES = POST_FAMILY  # the placements a stream is converted from


# --------------------------------------------------------------------------- planning

@dataclass
class _Block:
    """One Post-Norm site and how it will be converted."""

    number: int
    state: Any                                  # the site's SiteAnalysis
    fqn: str | None
    reason: str | None = None
    x: fx.Node | None = None                 # the stream operand of the residual add
    scaled: fx.Node | None = None            # DeepNorm: the ``a * x`` node
    alpha: float = 1.0
    branch_users: list[fx.Node] = field(default_factory=list)  # branch nodes that read x
    region: list[fx.Node] = field(default_factory=list)        # add -> norm output, copied onto x
    pred: "_Block | None" = None
    succ: list["_Block"] = field(default_factory=list)


def _is_tensor_valued(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value is None or isinstance(value, torch.Tensor) or isinstance(value, (tuple, list))


def _plan(index: GraphIndex, g: nx.DiGraph, b: _Block) -> str | None:
    """Fill in how ``b`` converts; returns why it cannot (None when it can)."""
    state, m = b.state, b.state.match
    add = state.in_add
    if add is None:
        return "no residual add feeds the norm"
    if add.permute is not None:
        return "a permute sits between the residual add and the norm (a channel norm)"
    c = index.canon(add.node)
    a, o = c["input"], c["other"]
    if not isinstance(a, fx.Node) or not isinstance(o, fx.Node):
        return "the residual add has a constant operand"
    if c["alpha"] != 1:
        return f"torch.add with alpha={c['alpha']}: the branch is scaled inside the add"
    if not same_shape(node_shape(a), node_shape(o)):
        return f"the residual add broadcasts ({node_shape(a)} + {node_shape(o)})"
    if add.scaled is not None and add.residual_scale != 1.0:  # DeepNorm: norm(alpha * x + F(x))
        b.scaled = (a, o)[add.scaled]
        b.x, branch, b.alpha = add.operands[add.scaled], (o, a)[add.scaled], add.residual_scale
        if not nx.has_path(g, b.x, branch):
            return "DeepNorm add: the scaled operand is not what the branch reads, so the stream is unclear"
    elif nx.has_path(g, a, o):
        b.x, branch = a, o
    elif nx.has_path(g, o, a):
        b.x, branch = o, a
    else:
        return ("neither operand of the residual add descends from the other: the stream cannot be told "
                "from the branch")
    if node_dtype(b.x) != node_dtype(add.node) or not same_shape(node_shape(b.x), node_shape(add.node)):
        return (f"the residual add changes the stream ({node_dtype(b.x)} {node_shape(b.x)} -> "
                f"{node_dtype(add.node)} {node_shape(add.node)})")
    inside = (nx.descendants(g, b.x) & nx.ancestors(g, branch)) | {branch}
    for n in inside:
        for u in n.users:
            # a graph output may read the branch's intermediates (a decoder's key/value cache):
            # after the conversion they are computed from norm(x), as in a Pre-Norm model; the
            # branch's result itself escaping means the branch is not only a residual branch
            cache = u.op == "output" and n is not branch
            if u not in inside and u is not add.node and (b.scaled is None or u is not b.scaled) \
                    and not cache and _is_tensor_valued(u):
                return (f"the residual branch cannot be identified: {u.name} reads {n.name} from inside "
                        "the branch")
    b.branch_users = [u for u in b.x.users if u in inside]
    if not b.branch_users:
        return "the branch does not read the stream value directly"
    region = (nx.descendants(g, add.node) & nx.ancestors(g, m.output)) | {m.output}
    for n in region - {m.output}:
        outside = [u for u in n.users if u not in region]
        if outside:
            return f"the norm's intermediate {n.name} is also read by {outside[0].name}"
    if node_dtype(m.input) != node_dtype(m.output) or not same_shape(node_shape(m.input), node_shape(m.output)):
        return (f"the norm maps {node_dtype(m.input)} {node_shape(m.input)} to {node_dtype(m.output)} "
                f"{node_shape(m.output)}; the stream would change type")
    b.region = sorted(region, key=index.order.__getitem__)
    return None


def _upstream_block(index: GraphIndex, node: Any, n: int | None, by_output: dict) -> "_Block | None":
    """The block whose output ``node`` is, seen through pass-through nodes."""
    while isinstance(node, fx.Node):
        if node in by_output:
            return by_output[node]
        if not is_pass_through(index, node, n):
            return None
        node = index.canon(node)["input"]
    return None


def _streams(index: GraphIndex, blocks: list[_Block]) -> list[list[_Block]]:
    """Group blocks into streams: block j follows i when an operand of j's add is i's output."""
    by_output = {b.state.match.output: b for b in blocks}
    for b in blocks:
        add = b.state.in_add
        if add is None:
            continue
        # the add's operands as the graph adds them, and with exact upcasts / scaling stripped
        for operand in (*add.node.all_input_nodes, *add.operands):
            prev = _upstream_block(index, operand, b.state.match.hidden_size, by_output)
            if prev is not None and prev is not b and b.pred is None:
                b.pred = prev
                prev.succ.append(b)
    streams = []
    for b in blocks:
        if b.pred is None:
            stream, frontier = [], [b]
            while frontier:
                cur = frontier.pop()
                stream.append(cur)
                frontier += cur.succ
            streams.append(sorted(stream, key=lambda s: s.number))
    return streams


def _ends_in_norm(index: GraphIndex, end: _Block, norm_nodes: set) -> bool:
    """Whether everything that reads the stream after ``end`` is a norm (through pass-throughs)."""
    frontier, seen = [end.state.match.output], set()
    n = end.state.match.hidden_size
    while frontier:
        node = frontier.pop()
        for u in node.users:
            if u in seen:
                continue
            seen.add(u)
            if u in norm_nodes:
                continue
            if is_pass_through(index, u, n):
                frontier.append(u)
            else:
                return False
    return bool(seen)


# --------------------------------------------------------------------------- rewriting

def _convert(graph: fx.Graph, b: _Block, replaced: dict) -> None:
    def resolve(node):
        while node in replaced:
            node = replaced[node]
        return node

    m, add = b.state.match, b.state.in_add
    x = resolve(b.x)
    users = set(b.branch_users)
    first = next(n for n in graph.nodes if n in users)
    env = {add.node: x}
    with graph.inserting_before(first):
        for n in b.region:
            new = graph.node_copy(n, lambda a: env.get(a, a))
            new.meta = dict(n.meta)
            new.meta[CONVERTED_META] = b.fqn or f"site{b.number}"
            env[n] = new
    for u in b.branch_users:
        u.replace_input_with(x, env[m.output])
    if b.scaled is not None:  # DeepNorm: the stream is no longer scaled
        add.node.replace_input_with(b.scaled, x)
    m.output.replace_all_uses_with(m.input)
    replaced[m.output] = m.input
    for n in reversed([*b.region, *([b.scaled] if b.scaled is not None else [])]):
        if not n.users and n is not m.input:
            graph.erase_node(n)


def _insert_final(graph: fx.Graph, owner: nn.Module, gm: fx.GraphModule, value: fx.Node, fqn: str,
                  module: nn.Module, in_dynamo: bool) -> fx.Node:
    """``norm(value)`` with the final norm's parameters, read by everything that read ``value``."""
    attr = fqn.replace(".", "__") if owner is not gm else fqn
    if owner is not gm:
        gm.add_module(attr, module)
    kind = "layer_norm" if isinstance(module, nn.LayerNorm) else "rms_norm"
    n = module.weight.shape[0]
    path = f"L['self'].{fqn}" if in_dynamo else fqn
    stack = {FINAL_NORM_NAME: (path, type(module))}
    params = []
    with graph.inserting_after(value):
        for pname in (("weight", "bias") if kind == "layer_norm" else ("weight",)):
            p = getattr(module, pname, None)
            if p is None:
                params.append(None)
                continue
            node = graph.get_attr(f"{attr}.{pname}")
            node.meta["val"] = torch.empty_like(p, device="meta")
            params.append(node)
    last = [p for p in params if p is not None][-1]
    with graph.inserting_after(last):
        if kind == "layer_norm":
            call = graph.call_function(F.layer_norm, (value, (n,), params[0], params[1], module.eps))
        else:
            call = graph.call_function(F.rms_norm, (value, (n,), params[0], module.eps))
    for key in ("example_value", "val", "tensor_meta"):
        if key in value.meta:
            call.meta[key] = value.meta[key]
    call.meta["nn_module_stack"] = stack
    call.meta[FINAL_META] = fqn
    value.replace_all_uses_with(call, delete_user_cb=lambda u: u is not call)
    return call


def _legalize(graph: fx.Graph) -> None:
    """Reorder nodes topologically, keeping the current order wherever it is already valid."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    sorted_nodes = list(nx.lexicographical_topological_sort(dependency_graph(graph), key=order.__getitem__))
    prev = None
    for node in sorted_nodes:
        if prev is not None and prev.next is not node:
            prev.append(node)
        prev = node


# --------------------------------------------------------------------------- the graph pass

def _module_kind(module: nn.Module) -> str:
    return "layer_norm" if isinstance(module, nn.LayerNorm) else "rms_norm"


def _final_for(stream: list[_Block], model: nn.Module | None, gm: fx.GraphModule, report: FusionReport,
               used: set) -> tuple[str, nn.Module] | str:
    """The final norm of a stream: (fqn, module), or the reason none fits."""
    owner = model if model is not None else gm
    mapping = getattr(owner, FINALS_ATTR, None)
    if mapping is None and model is not None:
        mapping = prepare_module(model)
        report.warnings.append(
            "Pre-Norm: the final norm(s) were registered at the first call (optimize(prenorm=True) registers "
            "them before); build the optimizer after this first forward so that it sees them.")
    mapping = dict(mapping or {})
    last = stream[-1].state.match
    fqn = stream[0].fqn or ""
    lists = sorted((lst for lst in mapping if lst == "" or fqn.startswith(lst + ".")), key=len, reverse=True)
    if not lists and len(mapping) == 1 and not any(s.fqn for s in stream):
        lists = list(mapping)
    if lists and mapping[lists[0]] not in used:
        final = mapping[lists[0]]
        module = owner.get_submodule(final)
    else:  # no block list holds this stream: a final norm of its own, registered now
        like = tensor_meta(last.weight) if last.weight is not None else tensor_meta(last.input)
        template = torch.empty(0, dtype=like.dtype, device=like.device if like.device.type != "meta" else "cpu")
        module = final_norm_like(None, last.kind, last.hidden_size, last.eps, template)
        final = register_final(owner, "", FINAL_NORM_NAME, module)
        if model is not None:
            report.warnings.append(
                f"Pre-Norm: final norm {final} registered at the first call (no block list of the model holds "
                f"{fqn or 'this stream'}); build the optimizer after this first forward so that it sees it.")
    if _module_kind(module) != last.kind or module.weight.shape[0] != last.hidden_size:
        return (f"final norm {final} is a {_module_kind(module)} of size {module.weight.shape[0]}, but the "
                f"stream's norms are {last.kind} of size {last.hidden_size}")
    return final, module


def convert_graph(gm: fx.GraphModule, config: FuseConfig | None = None, model: nn.Module | None = None
                  ) -> FusionReport:
    """Convert every Post-Norm stream of ``gm`` to Pre-Norm, in place; returns what it did.

    The returned report holds no sites (the fusion pass that runs next on the same graph
    reports every norm, converted ones with ``converted=True``); its notes list the
    converted streams and their final norms, its warnings the streams left Post-Norm and why.
    On any internal failure the graph is left untouched, with a warning.
    """
    config = config or FuseConfig()
    report = FusionReport(graphs=0)
    before = set(gm._modules)
    try:
        _convert_graph(gm, config, model, report)
    except Exception as error:  # noqa: BLE001 - the user's model must never break
        for attr in set(gm._modules) - before:  # final norms added to the graph module
            delattr(gm, attr)
        message = (f"normfuse left this graph Post-Norm: the Pre-Norm conversion failed "
                   f"({type(error).__name__}: {error}). Please report it with the model that triggers it.")
        report.warnings.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
    return report


def _convert_graph(gm: fx.GraphModule, config: FuseConfig, model: nn.Module | None, report: FusionReport
                   ) -> None:
    graph = fx.Graph(owning_module=gm, tracer_cls=getattr(gm.graph, "_tracer_cls", None))
    graph.output(graph.graph_copy(gm.graph, {}))
    analysis = analyze(graph)
    index, states = analysis.index, analysis.sites
    blocks = []
    for i, state in enumerate(states):
        if state.placement not in CANDIDATES:
            continue
        site = site_record(analysis, state)
        b = _Block(number=i, state=state, fqn=site.fqn)
        if config.filter_fn is not None and not config.filter_fn(site):
            b.reason = "excluded by filter_fn"
        blocks.append(b)
    site_fqns = [site_record(analysis, state).fqn for state in states]
    if not blocks:
        report.notes.append("Pre-Norm: no Post-Norm block in this graph; nothing converted")
        if model is not None:
            drop_unused_finals(model, site_fqns, set(), report)
        return
    g = dependency_graph(graph)
    for b in blocks:
        if b.reason is None:
            b.reason = _plan(index, g, b)
    norm_nodes = {n for state in states if state.placement not in CANDIDATES for n in state.match.nodes}
    in_dynamo = any("L['self']" in path for n in graph.nodes for path in module_paths(n))
    todo, finals, used = [], [], set()
    for stream in _streams(index, blocks):
        name = stream[0].fqn or f"site {stream[0].number}"
        bad = [b for b in stream if b.reason is not None]
        ends = [b for b in stream if not b.succ]
        why = None
        if bad:
            why = f"{bad[0].fqn or 'site %d' % bad[0].number}: {bad[0].reason}"
        elif len(ends) != 1:
            why = f"the stream forks into {len(ends)} ends ({', '.join(e.fqn or '?' for e in ends)})"
        final = None
        if why is None and not _ends_in_norm(index, ends[0], norm_nodes):
            final = _final_for(stream, model, gm, report, used)
            if isinstance(final, str):
                why, final = final, None
        if why is not None:
            message = f"Pre-Norm: stream starting at {name} ({len(stream)} Post-Norm sites) left as it was: {why}"
            report.warnings.append(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            continue
        todo += stream
        if final is not None:
            used.add(final[0])
            finals.append((ends[0], *final))
        alphas = sorted({b.alpha for b in stream if b.scaled is not None})
        report.notes.append(
            f"Pre-Norm: converted {len(stream)} Post-Norm sites from {name} to {stream[-1].fqn or 'the end'}; "
            + (f"final norm {final[0]}" if final else "the stream already ends in a norm")
            + (f"; DeepNorm residual scale {alphas} dropped" if alphas else ""))
    if model is not None:
        drop_unused_finals(model, site_fqns, used, report)
    if not todo:
        return
    replaced: dict = {}
    for b in sorted(todo, key=lambda b: index.order[b.state.match.output]):
        _convert(graph, b, replaced)
    streams_meta = []
    owner = model if model is not None else gm
    for end, fqn, module in finals:
        value = replaced.get(end.state.match.output, end.state.match.input)
        _insert_final(graph, owner, gm, value, fqn, module, in_dynamo)
    for stream in _streams_of(todo):
        end = stream[-1]
        final = next((f for e, f, _ in finals if e is end), None)
        streams_meta.append({"blocks": [b.fqn or f"site{b.number}" for b in stream], "final": final})
    _legalize(graph)
    graph.lint()
    gm.graph = graph
    gm.recompile()
    gm.meta.setdefault(GRAPH_META, {"streams": []})["streams"] += streams_meta


def _streams_of(blocks: list[_Block]) -> list[list[_Block]]:
    heads = [b for b in blocks if b.pred is None]
    out = []
    for h in heads:
        stream, cur = [h], h
        while cur.succ:
            cur = cur.succ[0]
            stream.append(cur)
        out.append(stream)
    return out


