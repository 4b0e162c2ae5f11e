"""A norm distributes over slices of its rows.

HunyuanVideo's single-stream blocks normalize q (image and text tokens together) and rotate the
image tokens only, joining the text tokens back unrotated::

    q = norm_q(q)                                               # (B, S, H, D), per head
    q = cat([rope(q[:, :-T], cos, sin), q[:, -T:]], dim=1)      # T text tokens, not rotated

A norm over the last dim reads one row and writes that row, so the norm of a slice of the rows
is the slice of the norm: ``norm(x)[:, a:b] == norm(x[:, a:b])``, the same operations on the same
elements (the same bits). ``split_norm_over_slices`` writes it so where every reader of a norm's
output is a slice of its rows and one of them is rotated: each slice becomes a norm of the
input's slice (a view, no copy; the same rows normalized once in all), and the rotated one is
a norm followed by a RoPE of its whole output, as the q/k fusion (``fusions/qk_norm_rope.py``)
expects. The rewrite records the norms it split (``record.attach_records``); the checker splits
its copy of the original graph alike before pairing sites (``verify/sites.py``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch.fx as fx

from normfuse.passes.canonical import canonical, node_shape
from normfuse.passes.rope_over_cat import narrowed_meta, rope_region

__all__ = ["split_norm_over_slices"]


def split_norm_over_slices(graph: fx.Graph, norms: dict[fx.Node, fx.Node],
                           only: tuple[tuple[str, str], ...] | None = None) -> tuple[tuple[str, str], ...]:
    """Give each row slice of a norm's output a norm of its own (module docstring). ``norms``: the
    output -> input of the norms to consider (those the q/k fusion computes); ``only``: the (output,
    input) names to split (the checker replays the pass's splits by name). Returns the names split."""
    if only is not None:
        by_name = {n.name: n for n in graph.nodes}
        norms = {by_name[y]: by_name[x] for y, x in only if y in by_name and x in by_name}
    split = []
    for y, x in norms.items():
        pieces = _row_slices(y)
        region = _region(x, y)
        if pieces is None or region is None or not any(rope_region(p) is not None for p, _ in pieces):
            continue
        split.append((y.name, x.name))
        for piece, dim in pieces:
            _clone_for(graph, piece, dim, x, region)
        for node in reversed(region):
            if not node.users:
                graph.erase_node(node)
    return tuple(split)


def _row_slices(y: fx.Node) -> list[tuple[fx.Node, int]] | None:
    """(slice, dim) of every reader of ``y`` when each is ``y[..., a:b, ...]`` along one static dim
    before the last (rows, not columns), else None."""
    shape, pieces = node_shape(y), []
    if not shape or not y.users:
        return None
    for user in y.users:
        c = canonical(user)
        if c is None or c.prim != "slice" or c["input"] is not y or c["step"] != 1 or user.target is not operator.getitem:
            return None
        dim = c["dim"][0] if isinstance(c["dim"], (list, tuple)) else c["dim"]
        if not isinstance(dim, int) or dim % len(shape) == len(shape) - 1 or not isinstance(shape[dim], int):
            return None
        pieces.append((user, dim % len(shape)))
    return pieces


def _region(x: fx.Node, y: fx.Node) -> list[fx.Node] | None:
    """The norm's nodes from ``x`` to ``y`` in graph order (those on a path between them, ``y``
    last), when nothing outside reads one of them but ``y``; else None."""
    order = {n: i for i, n in enumerate(y.graph.nodes)}
    below, frontier = set(), [x]
    while frontier:  # the nodes reading x, up to y
        frontier = [u for n in frontier for u in n.users if u not in below and order[u] <= order[y]]
        below.update(frontier)
    above, frontier = {y}, [y]
    while frontier:  # ... that y reads
        frontier = [a for n in frontier for a in n.all_input_nodes if a in below and a not in above]
        above.update(frontier)
    region = sorted(above, key=order.__getitem__)
    if any(u not in above for n in region if n is not y for u in n.users):
        return None
    return region


def _clone_for(graph: fx.Graph, piece: fx.Node, dim: int, x: fx.Node, region: list[fx.Node]) -> None:
    """Replace ``piece`` (a slice of the norm's output) by the norm of the same slice of ``x``."""
    index = piece.args[1]
    total = node_shape(x)[dim]
    c = canonical(piece)
    start, end = c["start"] or 0, total if c["end"] is None else c["end"]
    start, end = (v + total if v < 0 else min(v, total) for v in (start, end))
    with graph.inserting_before(piece):
        sliced = graph.call_function(operator.getitem, (x, index))
        narrowed_meta(sliced, x, dim, start, end - start, total)
        env: dict[fx.Node, Any] = {x: sliced}
        for node in region:
            new = graph.node_copy(node, lambda a: env.get(a, a))
            narrowed_meta(new, node, dim, start, end - start, total)
            env[node] = new
    piece.replace_all_uses_with(env[region[-1]])
    graph.erase_node(piece)
