"""The record of each fused call: what the rewrite replaced, handed to the checker.

The rewrite (``rewrite.apply``) knows, for every call it inserts, which original nodes the
call stands for, which original node each output replaced, and which original value each node
it inserted holds (a permuted operand, a per-row view of a scale, an output reshaped back).
It writes that down here, by node name (the pass rewrites a copy of the graph that keeps
every name of the original, and fx never gives a name twice), and leaves the records on the
rewritten graph module (``records_of``). The checker (``normfuse/verify/``) reads the call's
arguments as the graph has them and maps each to the original value it holds through the
records: it never analyses a graph again, and a call that reads the wrong value is caught.

``record_call`` builds one record from the plan and the analysis the rewrite worked from;
``CallRecord`` and ``records_of`` are all the checker needs, with ``fused_op_name``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.add_norm import add_norm, fused_add_norm, norm_add
from normfuse.kernels.qk_rope import qk_norm_rope
from normfuse.passes.find import live_dropout_p
from normfuse.passes.fusions.add_norm import output_names
from normfuse.passes.order import STEPS, taken_steps
from normfuse.passes.parts import folded_nodes

__all__ = ["CallRecord", "record_call", "records_of", "attach_records", "GraphSplits", "splits_of", "fused_op_name", "is_fused_call", "runnable_target", "output_names",
           "ARG_ROLES", "OPTION_ROLES"]

# the roles of a fused call's tensor arguments: positional (the checker passes them in this
# order), then the keyword options the fusion parts put into a call (read by name)
ARG_ROLES = ("x", "residual", "weight", "bias")
OPTION_ROLES = tuple(role for step in STEPS for role in step.roles)

_RECORDS = "normfuse_calls"  # the rewritten graph module's meta key holding its records
_SPLITS = "normfuse_splits"  # ... and what the pass split before it planned (GraphSplits)


@dataclass(frozen=True)
class GraphSplits:
    """What the pass rewrote in its copy of a graph before finding sites, by node names: the cats
    whose RoPE it split per piece (passes/rope_over_cat.py), the norms it split per slice of
    their rows, as (output, input), and the cats of norm outputs a rotated piece was stored into
    (passes/norm_over_slices.py). The checker replays them in this order on its copy of the
    original (the same steps give the same node names)."""

    cats: tuple[str, ...] = ()
    norms: tuple[tuple[str, str], ...] = ()
    stores: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.cats or self.norms or self.stores)


@dataclass(frozen=True)
class CallRecord:
    """One fused call of a rewritten graph and the original subgraph it stands for."""

    call: str                                  # the call's node name in the rewritten graph
    op: str                                    # "add_norm" | "norm_add" | "norm" | "qk_norm_rope"
    sites: tuple[int, ...]                     # the sites it computes (their numbers): the lead, then a paired norm
    nodes: tuple[str, ...]                     # the original nodes it stands for, in graph order
    outputs: tuple[tuple[int, str], ...]       # (call output index, original node it replaced)
    holds: tuple[tuple[str, str], ...] = ()    # (node the rewrite inserted, original node whose value it holds)
    eps: float | None = None                   # the eps of the original norm
    layout: tuple[int, ...] | None = None      # the call reads x and residual permuted by these dims
    permuted_back: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (output index, dims the rewrite permutes it by)
    folded: tuple[str, ...] = ()               # original nodes ahead of the add the call computes (parts' folded)
    dropout: str | None = None                 # the folded live dropout, whose mask the kernel draws


def attach_records(gm: fx.GraphModule, records: list[CallRecord], splits: GraphSplits = GraphSplits()) -> None:
    """Leave the records on ``gm``, with what the pass split before it planned (GraphSplits): the
    checker splits its copy of the original alike."""
    gm.meta[_RECORDS] = tuple(records)
    gm.meta[_SPLITS] = splits


def splits_of(gm: fx.GraphModule) -> GraphSplits:
    """What the pass split in the original graph before it planned (attach_records)."""
    return getattr(gm, "meta", {}).get(_SPLITS, GraphSplits())


def records_of(gm: fx.GraphModule) -> tuple[CallRecord, ...] | None:
    """The records of the calls the rewrite put into ``gm`` (None: the pass did not rewrite it)."""
    return getattr(gm, "meta", {}).get(_RECORDS)


# What a rewritten graph calls: the functional API's flat entry (graphs that run eagerly or go
# through AOTAutograd, which traces it into the custom ops; graphs rewritten by 0.1 call
# add_norm itself) or, in graphs Inductor already lowered to ATen (custom post-grad passes),
# the custom ops themselves.
_FUNCTIONS = {fused_add_norm: "add_norm", add_norm: "add_norm", norm_add: "norm_add", qk_norm_rope: "qk_norm_rope"}


@functools.cache
def _op_overloads() -> dict:
    return {torch.ops.normfuse.add_norm_fwd.default: "add_norm", torch.ops.normfuse.norm_add_fwd.default: "norm_add",
            torch.ops.normfuse.qk_norm_rope_fwd.default: "qk_norm_rope"}


def fused_op_name(node: fx.Node) -> str | None:
    """"add_norm", "norm_add", "norm" or "qk_norm_rope" for a call of a fused op; None for any other node."""
    if node.op != "call_function":
        return None
    family = _FUNCTIONS.get(node.target) or _op_overloads().get(node.target)
    if family == "add_norm" and node.args[1] is None:
        return "norm"
    return family


def runnable_target(target):
    """What runs a fused call's target outside its graph (the checker's numeric run): a graph
    rewritten by 0.1 calls add_norm with the flat keywords, which fused_add_norm takes without
    add_norm's deprecation warning."""
    return fused_add_norm if target is add_norm else target


def is_fused_call(node: fx.Node) -> bool:
    return fused_op_name(node) is not None


# --------------------------------------------------------------------------- building one record

def record_call(analysis: Any, p: Any, call: fx.Node, reads: set[fx.Node],
                outputs: list[tuple[int, fx.Node]], holds: dict[fx.Node, fx.Node],
                permuted_back: dict[int, tuple[int, ...]]) -> CallRecord:
    """The record of ``call``, the rewrite of plan ``p`` (a planning.Plan) on ``analysis`` (the
    analysis.Analysis it was planned on; not imported: the checker imports this module): ``reads`` the original values its
    arguments carry, ``outputs`` the call's output indices with the original nodes they
    replaced, ``holds`` each node the rewrite inserted with the original value it holds,
    ``permuted_back`` the outputs the rewrite permutes back to the original layout."""
    index = analysis.index
    lead = analysis.sites[p.lead]
    m = lead.match
    folded = folded_nodes(p.taken)
    nodes = list(m.nodes)
    for step, found in taken_steps(p.taken):
        nodes += step.nodes(found)
    if p.op == "add_norm":
        add = lead.in_add
        nodes += [add.node, *add.chain, *_operand_prep(index, add.node, set(add.operands) | reads)]
        for node in folded:
            nodes += [node, *_operand_prep(index, node, reads)]
    elif p.op == "norm_add":
        out = lead.output_add
        nodes += [out.node, *_operand_prep(index, out.node, set(out.operands) | {m.output} | reads)]
    nodes = _with_duplicates(index, sorted(set(nodes), key=index.order.__getitem__))
    dropout = next((n for n in folded if live_dropout_p(index.canon(n)) is not None), None)
    return CallRecord(
        call=call.name, op=p.op,
        sites=tuple(p.sites), nodes=tuple(n.name for n in nodes),
        outputs=tuple((k, node.name) for k, node in outputs),
        holds=tuple((new.name, old.name) for new, old in holds.items()), eps=m.eps, layout=p.permute,
        permuted_back=tuple(sorted(permuted_back.items())), folded=tuple(n.name for n in folded),
        dropout=dropout.name if dropout is not None else None)


def _operand_prep(index, add: fx.Node, operands: set) -> list[fx.Node]:
    """The casts / constant scaling between an add and the operands the kernel reads."""
    prep = []
    for arg in add.all_input_nodes:
        cur = arg
        while isinstance(cur, fx.Node) and cur not in operands:
            c = index.canon(cur)
            if c is None or c.prim not in ("cast", "mul"):
                break
            prep.append(cur)
            nxt = c["input"]
            if c.prim == "mul" and not isinstance(nxt, fx.Node):
                nxt = c["other"]
            cur = nxt
    return prep


def _with_duplicates(index, nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` and the duplicates they read of their own values (model code that writes
    ``x - mean`` twice): a duplicate computes inside the subgraph, it is not an input of it."""
    inside = set(nodes)
    grown = True
    while grown:
        grown = False
        for node in boundary(sorted(inside, key=index.order.__getitem__)):
            if index.rep.get(node) in inside:
                inside.add(node)
                grown = True
    return sorted(inside, key=index.order.__getitem__)


def boundary(nodes: list[fx.Node]) -> list[fx.Node]:
    """The values ``nodes`` read that are not among them, in first-read order."""
    inside = set(nodes)
    seen: list[fx.Node] = []
    for n in nodes:
        for p in n.all_input_nodes:
            if p not in inside and p not in seen:
                seen.append(p)
    return seen
