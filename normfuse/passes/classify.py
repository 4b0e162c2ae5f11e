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
from typing import NamedTuple

import torch.fx as fx

from normfuse.passes.canonical import real_users
from normfuse.passes.find import AddMatch, NormMatch, is_pass_through
from normfuse.passes.graph import GraphIndex
from normfuse.vocabulary import POST_FAMILY, Placement

__all__ = ["Found", "classify", "stream_operand"]


class Found(NamedTuple):
    """A norm as the find stage left it: the match and the adds next to it."""

    match: NormMatch
    in_add: AddMatch | None
    output_add: AddMatch | None
    output_chain: tuple[fx.Node, ...] | list


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


def _root_value(index: GraphIndex, found: Found) -> fx.Node:
    """The value a norm reads, before pass-through nodes: its add, or its input."""
    if found.in_add is not None:
        return found.in_add.node
    node = found.match.input
    n = found.match.hidden_size
    while isinstance(node, fx.Node) and is_pass_through(index, node, n):
        node = index.canon(node)["input"]
    return node


def sum_continues(found: Found) -> bool:
    """Whether the sum the norm reads is read by anything but the norm (the stream goes on; a
    call of the site then returns the sum). The one answer: the analysis keeps it per site."""
    if found.in_add is None:
        return False
    add = found.in_add
    inside = set(add.chain) | set(found.match.nodes)
    for node in (add.node, *add.chain):
        if any(u not in inside for u in real_users(node)):
            return True
    return False


def classify(index: GraphIndex, found: list[Found]) -> tuple[list[Placement], list[tuple[int, ...]]]:
    """Per norm (graph order): its placement, and the numbers of the norms reading the same value."""
    by_root: dict[fx.Node, list[int]] = defaultdict(list)
    for number, f in enumerate(found):
        by_root[_root_value(index, f)].append(number)
    groups: list[tuple[int, ...]] = [()] * len(found)
    for members in by_root.values():
        for number in members:
            groups[number] = tuple(members)
    feeding = {f.in_add.node for f in found if f.in_add is not None}
    placements: list[Placement] = []
    for number, f in enumerate(found):  # graph order, so upstream norms are placed first
        placements.append(_place(index, f, len(groups[number]) > 1, feeding, found[:number], placements))
    return placements, groups


def _place(index: GraphIndex, f: Found, shared: bool, feeding: set, upstream_found: list[Found],
           upstream_placements: list[Placement]) -> Placement:
    m = f.match
    if f.output_add is not None:
        stream = stream_operand(index, f.output_add)
        branch = f.output_add.node.all_input_nodes[1 - stream] if stream is not None else None
        chain_end = f.output_chain[-1] if f.output_chain else m.output
        if branch is chain_end and f.in_add is None:
            return Placement.SANDWICH if f.output_add.node in feeding else Placement.RES_POST
    if shared:
        return Placement.PARALLEL
    if f.in_add is None:
        return Placement.STANDALONE
    add = f.in_add
    stream = stream_operand(index, add)
    if add.scaled is not None and add.residual_scale != 1.0:
        return Placement.DEEPNORM
    if sum_continues(f):
        return Placement.PRE
    # post-style: the norm alone reads the sum
    ancestors = index.ancestors(add.node)
    upstream = [p for u, p in zip(upstream_found, upstream_placements) if u.match.output in ancestors]
    if stream is None and not upstream:
        return Placement.EMBEDDING
    if f.output_add is not None:
        out_stream = stream_operand(index, f.output_add)
        chain_end = f.output_chain[-1] if f.output_chain else m.output
        if out_stream is not None and f.output_add.node.all_input_nodes[out_stream] is chain_end:
            return Placement.POST
    # the end of a stream: post if the stream was post-norm so far, else a pre-norm stack's final norm
    if any(p in POST_FAMILY for p in upstream):
        return Placement.POST
    return Placement.PRE
