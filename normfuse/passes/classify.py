"""Classify: where each norm sits on the residual stream.

Which operand of a residual add is the stream is a graph question: in
``s = x + F(x)`` the stream ``x`` is an ancestor of the branch ``F(x)``.

| placement  | what the graph shows                                                   |
|------------|------------------------------------------------------------------------|
| pre        | the norm reads a sum that also continues the stream (GPT-2, LLaMA);    |
|            | also the final norm of a pre-norm stack                                |
| post       | the norm reads a sum nothing else reads, and its output is the stream  |
| res_post   | the norm's output is the branch of a residual add (``x + norm(F(x))``) |
| sandwich   | res_post whose add then feeds another norm (Gemma 2/3)                 |
| parallel   | two norms read the same value (GPT-NeoX, Falcon)                       |
| deepnorm   | post, with the stream scaled: ``norm(a*x + F(x))``                     |
| embedding  | a post-style norm of a sum with no stream and no norm upstream (BERT)  |
| standalone | a norm with no add on either side (first pre-norm, q/k norms)          |
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from normfuse.passes.canonical import real_users
from normfuse.passes.find import AddMatch, NormMatch, is_pass_through
from normfuse.passes.graph import GraphIndex

__all__ = ["SiteState", "classify", "stream_operand"]


@dataclass
class SiteState:
    """A norm on its way through the pipeline: the match, its adds, its placement."""

    match: NormMatch
    in_add: AddMatch | None = None
    output_add: AddMatch | None = None
    output_chain: list[fx.Node] = field(default_factory=list)
    placement: str = "standalone"
    group: list["SiteState"] = field(default_factory=list)  # states reading the same value
    # set by the rewrite's plan: what the kernel takes from the add's branch (a BranchFold),
    # and, for a norm computed by another norm's call (two norms of one value), that norm
    fold: Any = None
    lead: "SiteState | None" = None

    @property
    def input_is_add(self) -> bool:
        return self.in_add is not None

    @property
    def output_feeds_add(self) -> bool:
        return self.output_add is not None


def stream_operand(index: GraphIndex, add: AddMatch) -> int | None:
    """Index (0/1) of the add's operand that is the residual stream: the one the other descends from."""
    a, b = add.node.all_input_nodes[:2] if len(add.node.all_input_nodes) >= 2 else (None, None)
    if a is None:
        return None
    if index.is_ancestor(a, b):
        return 0
    if index.is_ancestor(b, a):
        return 1
    return None


def _root_value(index: GraphIndex, state: SiteState) -> fx.Node:
    """The value a norm reads, before pass-through nodes: its add, or its input."""
    if state.in_add is not None:
        return state.in_add.node
    node = state.match.input
    n = state.match.hidden_size
    while isinstance(node, fx.Node) and is_pass_through(index, node, n):
        node = index.canon(node)["input"]
    return node


def _sum_continues(state: SiteState) -> bool:
    """Whether the sum the norm reads is read by anything but the norm (the stream goes on)."""
    add = state.in_add
    inside = set(add.chain) | set(state.match.nodes)
    for node in (add.node, *add.chain):
        if any(u not in inside for u in real_users(node)):
            return True
    return False


def classify(index: GraphIndex, states: list[SiteState]) -> None:
    by_root: dict[fx.Node, list[SiteState]] = defaultdict(list)
    for state in states:
        by_root[_root_value(index, state)].append(state)
    for group in by_root.values():
        for state in group:
            state.group = group

    feeding = {state.in_add.node: state for state in states if state.in_add is not None}
    placed: list[SiteState] = []
    for state in states:  # graph order, so upstream states are placed first
        state.placement = _place(index, state, feeding, placed)
        placed.append(state)


def _place(index: GraphIndex, state: SiteState, feeding: dict, placed: list[SiteState]) -> str:
    m = state.match
    if state.output_add is not None:
        stream = stream_operand(index, state.output_add)
        branch = state.output_add.node.all_input_nodes[1 - stream] if stream is not None else None
        chain_end = state.output_chain[-1] if state.output_chain else m.output
        if branch is chain_end and state.in_add is None:
            return "sandwich" if state.output_add.node in feeding else "res_post"
    if len(state.group) > 1:
        return "parallel"
    if state.in_add is None:
        return "standalone"
    add = state.in_add
    stream = stream_operand(index, add)
    if add.scaled is not None and add.residual_scale != 1.0:
        return "deepnorm"
    if _sum_continues(state):
        return "pre"
    # post-style: the norm alone reads the sum
    ancestors = index.ancestors(add.node)
    upstream = [p for p in placed if p.match.output in ancestors]
    if stream is None and not upstream:
        return "embedding"
    if state.output_add is not None:
        out_stream = stream_operand(index, state.output_add)
        chain_end = state.output_chain[-1] if state.output_chain else m.output
        if out_stream is not None and state.output_add.node.all_input_nodes[out_stream] is chain_end:
            return "post"
    # the end of a stream: post if the stream was post-norm so far, else a pre-norm stack's final norm
    if any(p.placement in ("post", "deepnorm") for p in upstream):
        return "post"
    return "pre"
