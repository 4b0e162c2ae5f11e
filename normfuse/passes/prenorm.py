"""Post-Norm -> Pre-Norm: turn every ``y = norm(x + F(x))`` block into ``y = x + F(norm(x))``.

This rewrite changes the model's function on purpose (Xiong et al. 2020: a Pre-Norm
stack keeps the residual path free of norm Jacobians, so deep stacks train without
learning-rate warm-up). Three entry points:

- ``prepare_module(model)`` (called by ``optimize(model, prenorm=True)`` before capture)
  registers one **final norm** per residual stream on the model, initialized to identity
  (weight 1, bias 0), so it trains, saves and loads like any parameter. The first call
  removes those of streams it leaves as they were (a Pre-Norm model gets no new parameter).
- ``convert_graph(gm, config, model)`` (called by the backend before the fusion pass)
  rewrites the captured graph.
- ``check_structure(graph_modules)`` checks the promise on the rewritten graphs: from the
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

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from normfuse.config import FuseConfig
from normfuse.passes.canonical import canonical, node_dtype, node_shape, same_shape, tensor_meta
from normfuse.passes.find import GraphIndex, is_pass_through, module_info
from normfuse.reporting import FusionReport
from normfuse.vocabulary import CONVERTED_META, FINAL_META, GRAPH_META

__all__ = ["prepare_module", "convert_graph", "check_structure", "final_norms", "FINAL_NORM_NAME",
           "CONVERTED_META", "FINAL_META"]

FINAL_NORM_NAME = "normfuse_final_norm"
_MODULE_ATTR = "_normfuse_prenorm_final"  # model attribute: {block list fqn: final norm fqn}
_KEPT_ATTR = "_normfuse_prenorm_kept"     # model attribute: final norms a converted stream uses

CANDIDATES = ("post", "deepnorm")


# --------------------------------------------------------------------------- the model side

def _is_norm_module(m: nn.Module) -> bool:
    if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
        return True
    if isinstance(m, (nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)):
        return False
    w = getattr(m, "weight", None)
    return type(m).__name__.endswith("Norm") and isinstance(w, nn.Parameter) and w.ndim == 1


def _block_lists(model: nn.Module) -> list[str]:
    """Outermost ModuleLists/Sequentials of >= 2 modules of one class that contain norms."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if any(name == f or name.startswith(f + ".") for f in found if f):
            continue
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2 \
                and len({type(c) for c in mod}) == 1 and any(_is_norm_module(m) for m in mod[0].modules()):
            found.append(name)
    return found


def _eps_of(m: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(m, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _final_norm_like(template: nn.Module | None, kind: str | None = None, hidden: int | None = None,
                     eps: float | None = None, like: torch.Tensor | None = None) -> nn.Module:
    """A fresh norm of the model's kind, initialized to identity (weight 1, bias 0)."""
    if template is not None:
        w = template.weight
        hidden, like = w.shape[0], w
        eps = _eps_of(template) if _eps_of(template) is not None else eps
        if isinstance(template, nn.LayerNorm):
            kind = "layer_norm"
        elif isinstance(template, nn.RMSNorm) or "rms" in type(template).__name__.lower():
            kind = "rms_norm"
        else:
            kind = "layer_norm" if isinstance(getattr(template, "bias", None), nn.Parameter) else "rms_norm"
    factory = dict(device=like.device, dtype=like.dtype) if like is not None else {}
    if kind == "layer_norm":
        has_bias = template is None or getattr(template, "bias", None) is not None
        return nn.LayerNorm(hidden, eps=eps if eps is not None else 1e-5, bias=has_bias, **factory)
    return nn.RMSNorm(hidden, eps=eps, **factory)


def _register(model: nn.Module, parent_fqn: str, attr: str, module: nn.Module) -> str:
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    name, k = attr, 1
    while hasattr(parent, name):
        name, k = f"{attr}_{k}", k + 1
    parent.add_module(name, module)
    return f"{parent_fqn}.{name}" if parent_fqn else name


def prepare_module(model: nn.Module) -> dict[str, str]:
    """Register one identity-initialized final norm per block list of ``model``; returns
    ``{block list fqn: final norm fqn}``. Calling it again changes nothing.

    A block list is an outermost ``ModuleList``/``Sequential`` of >= 2 modules of one class
    that contain a norm (``encoder.layer`` in BERT; ``encoder.layers`` and ``decoder.layers``
    in BART, so an encoder-decoder gets two). Its final norm is registered next to it, as
    ``<parent>.normfuse_final_norm``, with the kind, size, eps and dtype of the last norm
    of the last block. A model with norms but no block list gets one at its root. It must
    exist before the first call so that an optimizer built right after ``optimize`` sees it;
    the first call removes it again when its stream is not converted.
    """
    done = getattr(model, _MODULE_ATTR, None)
    if done is not None:
        return done
    object.__setattr__(model, _KEPT_ATTR, set())
    model.register_load_state_dict_post_hook(_pending_finals_are_optional)
    mapping: dict[str, str] = {}
    lists = _block_lists(model)
    if not lists and any(_is_norm_module(m) for m in model.modules()):
        lists = [""]
    for fqn in lists:
        scope = model.get_submodule(fqn) if fqn else model
        last = scope[-1] if fqn else scope
        norms = [m for m in last.modules() if _is_norm_module(m)]
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        mapping[fqn] = _register(model, parent, FINAL_NORM_NAME, _final_norm_like(norms[-1]))
    object.__setattr__(model, _MODULE_ATTR, mapping)
    return mapping


def _pending_finals_are_optional(model: nn.Module, incompatible) -> None:
    """Before the first call a final norm is registered for every block list; the first call
    removes those of streams it did not convert. So a state_dict saved after that call may lack
    them: loading it into a freshly optimized twin is not missing anything."""
    mapping = getattr(model, _MODULE_ATTR, None) or {}
    kept = getattr(model, _KEPT_ATTR, set())
    pending = tuple(f"{fqn}." for fqn in mapping.values() if fqn not in kept)
    if pending:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(pending)]


def _drop_unused_finals(model: nn.Module, site_fqns: list[str], used: set, report: FusionReport) -> None:
    """Remove the final norms registered before the first call for block lists this graph holds
    but whose streams it did not convert: a final norm exists only for a converted stream."""
    mapping = getattr(model, _MODULE_ATTR, None)
    kept = getattr(model, _KEPT_ATTR, None)
    if mapping is None or kept is None:
        return
    kept |= used
    for lst, final in list(mapping.items()):
        here = any(f and (lst == "" or f.startswith(lst + ".")) for f in site_fqns)
        if final in kept or not here:
            continue
        parent, _, attr = final.rpartition(".")
        delattr(model.get_submodule(parent) if parent else model, attr)
        del mapping[lst]
        report.notes.append(f"Pre-Norm: final norm {final} removed: no stream of {lst or 'the model'} was converted")


def final_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The final norms registered on ``model``: ``{fqn: module}``."""
    mapping = getattr(model, _MODULE_ATTR, None) or getattr(getattr(model, "_orig_mod", None), _MODULE_ATTR, {})
    owner = getattr(model, "_orig_mod", model)
    return {fqn: owner.get_submodule(fqn) for fqn in mapping.values()}


# --------------------------------------------------------------------------- planning

@dataclass
class _Block:
    """One Post-Norm site and how it will be converted."""

    number: int
    st: Any                                  # SiteState
    fqn: str | None
    reason: str | None = None
    x: fx.Node | None = None                 # the stream operand of the residual add
    scaled: fx.Node | None = None            # DeepNorm: the ``a * x`` node
    alpha: float = 1.0
    branch_users: list[fx.Node] = field(default_factory=list)  # branch nodes that read x
    region: list[fx.Node] = field(default_factory=list)        # add -> norm output, copied onto x
    pred: "_Block | None" = None
    succ: list["_Block"] = field(default_factory=list)


def _graph_of(graph: fx.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph.nodes:
        g.add_node(node)
        for inp in node.all_input_nodes:
            g.add_edge(inp, node)
    return g


def _is_tensor_valued(node: fx.Node) -> bool:
    value = node.meta.get("example_value", node.meta.get("val"))
    return value is None or isinstance(value, torch.Tensor) or isinstance(value, (tuple, list))


def _plan(index: GraphIndex, g: nx.DiGraph, b: _Block) -> str | None:
    """Fill in how ``b`` converts; returns why it cannot (None when it can)."""
    st, m = b.st, b.st.match
    add = st.in_add
    if add is None:
        return "no residual add feeds the norm"
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
    by_output = {b.st.match.output: b for b in blocks}
    for b in blocks:
        add = b.st.in_add
        if add is None:
            continue
        # the add's operands as the graph adds them, and with exact upcasts / scaling stripped
        for operand in (*add.node.all_input_nodes, *add.operands):
            prev = _upstream_block(index, operand, b.st.match.hidden_size, by_output)
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
    frontier, seen = [end.st.match.output], set()
    n = end.st.match.hidden_size
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

    m, add = b.st.match, b.st.in_add
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
    sorted_nodes = list(nx.lexicographical_topological_sort(_graph_of(graph), key=order.__getitem__))
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
    mapping = getattr(owner, _MODULE_ATTR, None)
    if mapping is None and model is not None:
        mapping = prepare_module(model)
        report.warnings.append(
            "Pre-Norm: the final norm(s) were registered at the first call (optimize(prenorm=True) registers "
            "them before); build the optimizer after this first forward so that it sees them.")
    mapping = dict(mapping or {})
    last = stream[-1].st.match
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
        module = _final_norm_like(None, last.kind, last.hidden_size, last.eps, template)
        final = _register(owner, "", FINAL_NORM_NAME, module)
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
    from normfuse.passes import pipeline

    graph = fx.Graph(owning_module=gm, tracer_cls=getattr(gm.graph, "_tracer_cls", None))
    graph.output(graph.graph_copy(gm.graph, {}))
    index, states = pipeline.analyze(graph)
    blocks = []
    for i, st in enumerate(states):
        if st.placement not in CANDIDATES:
            continue
        site = pipeline.site_record(index, st, i)
        b = _Block(number=i, st=st, fqn=site.fqn)
        if config.filter_fn is not None and not config.filter_fn(site):
            b.reason = "excluded by filter_fn"
        blocks.append(b)
    site_fqns = [pipeline.site_record(index, st, i).fqn for i, st in enumerate(states)]
    if not blocks:
        report.notes.append("Pre-Norm: no Post-Norm block in this graph; nothing converted")
        if model is not None:
            _drop_unused_finals(model, site_fqns, set(), report)
        return
    g = _graph_of(graph)
    for b in blocks:
        if b.reason is None:
            b.reason = _plan(index, g, b)
    norm_nodes = {n for st in states if st.placement not in CANDIDATES for n in st.match.nodes}
    in_dynamo = any("L['self']" in str(v[0]) for n in graph.nodes
                    for v in (n.meta.get("nn_module_stack") or {}).values())
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
        _drop_unused_finals(model, site_fqns, used, report)
    if not todo:
        return
    replaced: dict = {}
    for b in sorted(todo, key=lambda b: index.order[b.st.match.output]):
        _convert(graph, b, replaced)
    streams_meta = []
    owner = model if model is not None else gm
    for end, fqn, module in finals:
        value = replaced.get(end.st.match.output, end.st.match.input)
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


# --------------------------------------------------------------------------- the structural check

def _is_fused(node: Any, family: str) -> bool:
    """A call of the fused op family "add_norm" (a plain norm included) or "norm_add"."""
    from normfuse.passes.rewrite import fused_op_name
    name = fused_op_name(node) if isinstance(node, fx.Node) else None
    return name is not None and (name == family or (family == "add_norm" and name == "norm"))


def _value(node: fx.Node) -> fx.Node:
    """A fused op's sum output stands for the op itself (the add happens inside it)."""
    if node.op == "call_function" and node.target is operator.getitem and _is_fused(node.args[0], "add_norm") \
            and node.args[1] == 1:
        return node.args[0]
    return node


def _add_operands(node: fx.Node) -> tuple[Any, Any] | None:
    """(a, b) when ``node`` is an unscaled add of two values: a plain add, or a fused op's add."""
    node = _value(node)
    if _is_fused(node, "add_norm"):
        if node.args[1] is None or node.kwargs.get("residual_scale", 1.0) != 1.0:
            return None
        return node.args[0], node.args[1]
    if node.op == "call_function" and node.target is operator.getitem and _is_fused(node.args[0], "norm_add") \
            and node.args[1] == 0:
        call = node.args[0]
        return (call.args[1], call.args[0]) if call.kwargs.get("residual_scale", 1.0) == 1.0 else None
    c = canonical(node)
    if c is not None and c.prim == "add" and c["alpha"] == 1 and isinstance(c["input"], fx.Node) \
            and isinstance(c["other"], fx.Node):
        return c["input"], c["other"]
    return None


def _entry(nodes: list[fx.Node], order: dict) -> fx.Node | None:
    """The stream value a norm (fused or not) reads."""
    for n in nodes:
        if _is_fused(n, "add_norm"):
            return n if n.args[1] is not None else n.args[0]
    for n in nodes:
        c = canonical(n)
        if c is not None and c.prim in ("layer_norm", "rms_norm"):
            return c["input"]
    group = set(nodes)
    out_shape = node_shape(max(nodes, key=order.__getitem__))
    outside = sorted({i for n in nodes for i in n.all_input_nodes if i not in group
                      and same_shape(node_shape(i), out_shape)}, key=order.__getitem__)
    return outside[0] if outside else None


def _groups(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    groups: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        fqn = node.meta.get(FINAL_META) or node.meta.get(CONVERTED_META)
        if fqn is None and node.meta.get("nn_module_stack"):
            fqn = module_info(node)[0]
        if fqn is not None and node.op != "placeholder" and not (
                node.op == "call_function" and node.target is operator.getitem and node.args[1] == 1):
            groups.setdefault(fqn, []).append(node)
    return groups


def check_structure(graph_modules) -> tuple[bool, str]:
    """On the rewritten graphs: from the first converted block's input to each final norm,
    does the residual stream pass through adds only? Returns (ok, explanation)."""
    seen, lines, ok, any_stream = set(), [], True, False
    for gm in graph_modules:
        if id(gm) in seen:
            continue
        seen.add(id(gm))
        info = getattr(gm, "meta", {}).get(GRAPH_META)
        if not info:
            continue
        graph = gm.graph
        g = _graph_of(graph)
        order = {n: i for i, n in enumerate(graph.nodes)}
        groups = _groups(graph)
        all_blocks = [f for s in info["streams"] for f in s["blocks"]]
        for stream in info["streams"]:
            any_stream = True
            missing = [f for f in stream["blocks"] + [stream["final"] or ""] if f and f not in groups]
            if missing:
                ok = False
                lines.append(f"{stream['blocks'][0]}: converted norm(s) {missing} not found in the graph")
                continue
            if stream["final"] is None:
                lines.append(f"{stream['blocks'][0]}: stream ends in the model's own norm; not checked")
                continue
            cur = _entry(groups[stream["final"]], order)
            adds, lost = 0, ""
            while cur is not None:
                ops = _add_operands(cur)
                if ops is None:
                    break
                a, b = ops
                # the stream is the operand the branch descends from; a fused op's sum stands
                # for the op, which also produced the branch's input
                nxt = a if nx.has_path(g, _value(a), b) else b if nx.has_path(g, _value(b), a) else None
                if nxt is None:
                    lost = f" (neither {a.name} nor {b.name} feeds the other)"
                    break
                adds += 1
                cur = nxt
            z = _value(cur)
            first = min(stream["blocks"], key=lambda f: min(order[n] for n in groups[f]))
            entry = _entry(groups[first], order)
            earlier = [f for f in all_blocks if any(nx.has_path(g, n, z) for n in groups[f] if n is not z)]
            if entry is None or _value(entry) is not z or earlier:
                ok = False
                where = f"{z.name} ({z.op} {getattr(z.target, '__name__', z.target)})"
                lines.append(f"{first} -> {stream['final']}: the stream is interrupted at {where}{lost}"
                             + (f", below converted {earlier[0]}" if earlier else ""))
                continue
            lines.append(f"{first} -> {stream['final']}: {len(stream['blocks'])} converted blocks, "
                         f"the stream passes through {adds} adds only")
    if not any_stream:
        return False, "no converted Pre-Norm stream in these graphs"
    return ok, "; ".join(lines)
