"""A RoPE distributes over a concatenation along positions.

Flux's double-stream blocks normalize the text and the image q with two norms (two weights),
concatenate them along the positions, then rotate the whole::

    q = cat([norm_added_q(text_q), norm_q(image_q)], dim=1)
    q = (q.float() * cos + rotated(q).float() * sin).to(q.dtype)        # cos, sin: (S, D) per position

A rotation reads one position's row and that position's table row only, so it is the
rotation of each piece with its slice of the tables, concatenated after:
``rope(cat([a, b], 1), cos, sin) == cat([rope(a, cos[:Sa], sin[:Sa]), rope(b, cos[Sa:], sin[Sa:])], 1)``,
the same operations on the same elements (the same bits), the cat moved after the rotation
(one copy either way). ``split_rope_over_cat`` writes it so where every piece is a norm's
output, so that each norm reads its own RoPE as the q/k fusion (``fusions/qk_norm_rope.py``)
expects. The rewrite records the cats it split (``record.attach_records``); the checker splits
the same cats of its copy of the original graph before pairing sites (``verify/sites.py``), so
each site's subgraph is the norm and its piece's RoPE.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from normfuse.passes.canonical import canonical, is_split_piece, node_shape, one_dim
from normfuse.passes.graph import copy_meta

__all__ = ["split_rope_over_cat", "rope_region", "narrowed_meta", "rows_index", "piece_spans"]

# what a rotation's steps are, between the cat and its output
_STEPS = frozenset(["view", "flatten", "unsqueeze", "cast", "slice", "cat", "stack", "neg", "mul", "add", "sub"])
_DEPTH = 12


def split_rope_over_cat(graph: fx.Graph, norm_outputs: set, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """Give each piece of a cat of norm outputs its own RoPE (module docstring); ``only``: the names
    of the cats to split (the checker replays the pass's splits by name). Returns the names of the
    cats split."""
    tables: dict[tuple, fx.Node] = {}  # (table, start, end) -> its slice, shared by q's and k's RoPE
    split = []
    for cat in [n for n in graph.nodes if (only is None or n.name in only) and _cat_of(n, norm_outputs) is not None]:
        pieces, dim = _cat_of(cat, norm_outputs)
        region = rope_region(cat)
        if region is None:
            continue
        split.append(cat.name)
        _split(graph, cat, pieces, dim, region, tables)
    return tuple(split)


def _cat_of(node: fx.Node, norm_outputs: set) -> tuple[list[fx.Node], int] | None:
    """(pieces, dim) of ``cat(pieces, dim)`` along a static dim before the last of 4-d norm outputs."""
    c = canonical(node)
    if c is None or c.prim != "cat":
        return None
    pieces, shape = list(c["tensors"]), node_shape(node)
    if shape is None or len(shape) != 4 or len(pieces) < 2 or not all(p in norm_outputs for p in pieces):
        return None
    dim = one_dim(c, 4)
    sizes = [node_shape(p) for p in pieces]
    if dim is None or dim == 3 or any(s is None or not isinstance(s[dim], int) for s in sizes):
        return None
    return pieces, dim


def rope_region(cat: fx.Node) -> tuple[list[fx.Node], fx.Node] | None:
    """(the nodes from the cat to the rotation's output in graph order, that output) when the cat is
    read by a rotation only (``x * cos ± rotated(x) * sin``, then a cast), else None."""
    reached, frontier = {cat}, [cat]
    for _ in range(_DEPTH):
        frontier = [u for n in frontier for u in n.users if u not in reached and _step(u)]
        reached.update(frontier)
    sums = [n for n in reached if canonical(n) is not None and canonical(n).prim in ("add", "sub")
            and canonical(n)["input"] in reached and canonical(n)["other"] in reached]
    if len(sums) != 1:
        return None
    out = sums[0]
    users = list(out.users)
    if len(users) == 1 and canonical(users[0]) is not None and canonical(users[0]).prim == "cast":
        out = users[0]
    region = [n for n in reached if n is not cat and (n is out or _reaches(n, out))]
    inside = set(region) | {cat}
    if any(u not in inside for n in [cat, *region] if n is not out for u in n.users):
        return None  # a step of the rotation is read elsewhere: it stays whole
    return sorted(region), out  # (fx nodes compare by their place in the graph)


def _step(node: fx.Node) -> bool:
    c = canonical(node)
    return (c is not None and c.prim in _STEPS) or is_split_piece(node) or (
        node.op == "call_function" and node.target is operator.getitem)


def _reaches(node: fx.Node, target: fx.Node, depth: int = _DEPTH) -> bool:
    frontier = [node]
    for _ in range(depth):
        if target in frontier:
            return True
        frontier = [u for n in frontier for u in n.users]
    return target in frontier


def _split(graph: fx.Graph, cat: fx.Node, pieces: list[fx.Node], dim: int, region: tuple, tables: dict) -> None:
    nodes, out = region
    total = node_shape(cat)[dim]
    outputs = []
    with graph.inserting_before(out):
        for piece, (start, end) in zip(pieces, piece_spans(pieces, dim)):
            size = end - start
            env: dict[fx.Node, Any] = {cat: piece}

            def arg(a, start=start, size=size, env=env):
                if isinstance(a, fx.Node) and a in env:
                    return env[a]
                return _table_slice(graph, a, dim, start, size, total, tables) if isinstance(a, fx.Node) else a

            for node in nodes:
                c = canonical(node)
                if c is not None and c.prim == "view" and node.op != "placeholder" and _resizes(node):
                    shape = list(node_shape(node))
                    shape[dim] = size
                    new = graph.call_method("reshape", (env[c["input"]], tuple(shape)))
                else:
                    new = graph.node_copy(node, arg)
                narrowed_meta(new, node, dim, start, size, total)
                env[node] = new
            outputs.append(env[out])
        joined = graph.call_function(torch.cat, (outputs, dim))
    copy_meta(joined, out)
    out.replace_all_uses_with(joined)
    for node in reversed(nodes):
        graph.erase_node(node)
    if not cat.users:
        graph.erase_node(cat)


def _resizes(node: fx.Node) -> bool:
    """A reshape written with sizes (it would keep the whole cat's length): rewritten per piece."""
    return any(isinstance(a, (int, tuple, list, torch.Size)) and not isinstance(a, bool)
               for a in node.args[1:])


def _table_slice(graph: fx.Graph, table: fx.Node, dim: int, start: int, size: int, total: int, cache: dict):
    """``table``'s rows of this piece's positions when it runs along them (the rotation's cos/sin,
    broadcast from the right against the 4-d value), else ``table`` as it is."""
    shape = node_shape(table)
    at = None if shape is None else len(shape) - (4 - dim)
    if at is None or at < 0 or shape[at] != total:
        return table
    key = (table, start, size)
    if key not in cache:
        with graph.inserting_after(table):  # table[..., start:start + size, ...]: a slice
            cache[key] = graph.call_function(operator.getitem, (table, rows_index(at, start, start + size)))
        narrowed_meta(cache[key], table, at, start, size, total)
    return cache[key]


def piece_spans(pieces: list, dim: int) -> list[tuple[int, int]] | None:
    """The rows [start, end) along ``dim`` each piece of ``cat(pieces, dim)`` takes in the cat, or None
    when a piece's size there is not a known int."""
    spans, start = [], 0
    for piece in pieces:
        shape = node_shape(piece) if isinstance(piece, fx.Node) else None
        size = shape[dim] if shape is not None and len(shape) > dim else None
        if not isinstance(size, int):
            return None
        spans.append((start, start + size))
        start += size
    return spans


def rows_index(dim: int, start: int, end: int) -> tuple:
    """The index of rows [start, end) along ``dim`` (``x[:, ..., start:end]``), every dim before it whole."""
    return (*[slice(None)] * dim, slice(start, end))


def narrowed_meta(new: fx.Node, old: fx.Node, dim: int, start: int, size: int, total: int) -> None:
    """``new``'s meta: ``old``'s, its example value narrowed to the piece along ``dim``."""
    copy_meta(new, old)
    new.meta.pop("tensor_meta", None)
    for key in ("example_value", "val"):
        value = old.meta.get(key)
        if isinstance(value, torch.Tensor):
            new.meta[key] = _narrow(value, dim, start, size, total)
        elif isinstance(value, (tuple, list)):
            new.meta[key] = type(value)(_narrow(v, dim, start, size, total) if isinstance(v, torch.Tensor) else v
                                        for v in value)


def _narrow(value: torch.Tensor, dim: int, start: int, size: int, total: int) -> torch.Tensor:
    if value.dim() > dim and value.shape[dim] == total:
        return value.narrow(dim, start, size)
    return value
