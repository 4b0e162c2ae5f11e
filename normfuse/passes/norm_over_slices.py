"""A norm distributes over slices of its rows.

HunyuanVideo's single-stream blocks normalize q (image and text tokens together) and rotate the
image tokens only, joining the text tokens back unrotated::

    q = norm_q(q)                                               # (B, S, H, D), per head
    q = cat([rope(q[:, :-T], cos, sin), q[:, -T:]], dim=1)      # T text tokens, not rotated

CogVideoX and CogView4 normalize q (B, H, S, D) and store the rotated image tokens back into it::

    q = norm_q(q)
    q[:, :, T:] = rope(q[:, :, T:], cos, sin)                   # the T text tokens kept as they are

HunyuanVideo I2V gates, adds and modulates its first frame's tokens with a set of their own (token
replace): the two segments' sums are joined by a cat, normalized together, and the norm's output is
sliced at the same row, each slice modulated with its set::

    h = cat([h[:, :T] + attn[:, :T] * tr_gate_msa, h[:, T:] + attn[:, T:] * gate_msa], dim=1)
    n = norm2(h)
    n = cat([n[:, :T] * (1 + tr_scale) + tr_shift, n[:, T:] * (1 + scale) + shift], dim=1)

A norm over the last dim reads one row and writes that row, so the norm of a slice of the rows
is the slice of the norm: ``norm(x)[:, a:b] == norm(x[:, a:b])``, the same operations on the same
elements (the same bits). ``split_norm_over_slices`` writes it so where a slice of a norm's rows
is rotated and either every reader of the norm's output is a slice of its rows (each slice becomes
a norm of the input's slice: a view, no copy; the same rows normalized once in all), or the
rotated slice is stored back into the norm's output, read after the store (the stored value is
then ``cat`` of the norm of the rows not stored and the rotation: the store's copy becomes the
cat's). The rotated slice is then a norm followed by a RoPE of its whole output, as
the q/k fusion (``fusions/qk_norm_rope.py``) expects. A slice of a cat's rows that is one of its
pieces is read as that piece, so each of HunyuanVideo I2V's segments gets a norm of its own sum, whose
gated add, scale and shift its call takes. The pass splits a norm where a slice's call then takes a
step the whole norm's could not (``pipeline._splits_taken``). The rewrite records what it split
(``record.GraphSplits``); the checker splits its copy of the original graph alike before pairing
sites (``verify/sites.py``), so each site is held to the split graph, and the split itself to the
model's outputs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from normfuse.passes.canonical import canonical, mutates, node_dtype, node_shape, one_dim
from normfuse.passes.graph import copy_meta
from normfuse.passes.rope_over_cat import narrowed_meta, piece_spans, rope_region, rows_index

__all__ = ["splittable", "split_norm_over_slices", "split_stores_into_cats", "past_no_op_casts"]


def splittable(norms: dict[fx.Node, fx.Node], rotated: bool = True) -> dict[fx.Node, fx.Node]:
    """The norms of ``norms`` (output -> input) that have a form split_norm_over_slices splits (no
    change to the graph): nothing to try when none has. ``rotated=False``: also those whose row slices
    no RoPE reads (each slice's own steps, its scale and shift, are what the split is tried for)."""
    return {y: x for y, x in norms.items() if _split_form(y, x, rotated) is not None}


def split_norm_over_slices(graph: fx.Graph, norms: dict[fx.Node, fx.Node],
                           only: tuple[tuple[str, str], ...] | None = None, rotated: bool = True,
                           pieces_of: dict[str, tuple[str, list[str]]] | None = None) -> tuple[tuple[str, str], ...]:
    """Give each row slice of a norm's output a norm of its own (module docstring). ``norms``: the
    output -> input of the norms to consider; ``only``: the (output, input) names to split (the checker
    replays the pass's splits by name); ``rotated=False``: slices no RoPE reads are split too.
    ``pieces_of``: filled with, per split (by the name it returns), the norm's output as given and the
    outputs of its new norms. Returns the names split: (the output past its no-op casts, the input)."""
    if only is not None:
        by_name = {n.name: n for n in graph.nodes}
        norms = {by_name[y]: by_name[x] for y, x in only if y in by_name and x in by_name}
        rotated = False  # (the pass decided which to split)
    split = []
    for given, x in norms.items():
        form = _split_form(given, x, rotated)
        if form is None:
            continue
        y, region, pieces, stored = form
        made = []
        if pieces is not None:
            for piece, dim in pieces:
                made.append(_split_piece(graph, piece, dim, x, region))
        else:
            made += _store_as_cat(graph, *stored, x, region)
        split.append((y.name, x.name))
        if pieces_of is not None:
            pieces_of[y.name] = (given.name, [n.name for n in made])
        for node in reversed(region):
            if not node.users:
                graph.erase_node(node)
        if not x.users and canonical(x) is not None and canonical(x).prim == "transpose":
            graph.erase_node(x)  # each slice now reads its rows before the heads' swap (_rows_of)
    return tuple(split)


def split_stores_into_cats(graph: fx.Graph, norm_outputs: set, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """EasyAnimate's ``q = cat([norm_added_q(text), norm_q(image)], 2)``, then ``q[:, :, T:] =
    rope(q[:, :, T:])``, the stored rows one piece's: read after as ``cat`` of the pieces with the
    rotation in that piece's place, the rotation reading the norm's output. ``norm_outputs``: the
    pieces to consider; ``only``: the cats' names (the checker's replay). Returns the names rewritten."""
    rewritten = []
    if only is not None:
        cats = [n for n in graph.nodes if n.name in only]
    else:  # the readers of the norms' outputs, in graph order
        cats = sorted({u for p in norm_outputs for u in p.users})
    for cat in cats:
        c = canonical(cat)
        if c is None or c.prim != "cat":
            continue
        pieces = list(c["tensors"])
        dim = one_dim(c)
        if dim is None or len(pieces) < 2 or (only is None and not all(p in norm_outputs for p in pieces)) \
                or any(node_dtype(p) != node_dtype(cat) or len(p.users) != 1 for p in pieces):
            continue  # (a piece in another dtype is promoted by the cat; one read elsewhere may change after it)
        stored = _stored_slice(cat)
        if stored is None or stored[1] != dim % len(node_shape(cat)):
            continue
        piece, _, store, readers = stored
        rows, spans = _bounds(piece, node_shape(cat)[stored[1]]), piece_spans(pieces, stored[1])
        if spans is None or rows not in spans:
            continue
        k = spans.index(rows)
        rewritten.append(cat.name)
        piece.replace_all_uses_with(pieces[k])
        graph.erase_node(piece)
        with graph.inserting_before(readers[0]):
            whole = graph.call_function(torch.cat, ([*pieces[:k], store.args[2], *pieces[k + 1:]], stored[1]))
        copy_meta(whole, cat)
        for reader in readers:
            reader.replace_input_with(cat, whole)
        graph.erase_node(store)
        if not cat.users:
            graph.erase_node(cat)
    return tuple(rewritten)


def _split_form(y: fx.Node, x: fx.Node, rotated: bool = True) -> tuple | None:
    """(the norm's output past its no-op casts, its region, the row slices when every reader is one,
    none is written in place, and one is rotated (with ``rotated=False``, or two slices or more: a
    model's one slice of its last norm, HF's ``hidden[:, -k:]`` before the head, is not tried), else
    the stored slice's match), or None when the norm has no such form."""
    y = past_no_op_casts(y)  # CogView4's norm_q(q).to(dtype): the stores write into the cast's value
    pieces, stored = _row_slices(y), None  # (y's readers first: most norms have neither form)
    if pieces is not None:
        taken = (not rotated and len(pieces) > 1) or any(rope_region(p) is not None for p, _ in pieces)
        # slices are views of one tensor: a write into one (or into y) would reach the others, not the
        # split's separate norms
        if not taken or _written_through(y):
            return None
    else:
        stored = _stored_slice(y)
        if stored is None:
            return None
    region = _region(x, y)
    return None if region is None else (y, region, pieces, stored)


def past_no_op_casts(y: fx.Node) -> fx.Node:
    """``y``, or the last of the casts to its own dtype that follow it, each the only reader of the one
    before (``.to(dtype)`` of a value already in that dtype: the same tensor)."""
    while len(y.users) == 1:
        user = next(iter(y.users))
        c = canonical(user)
        if c is None or c.prim != "cast" or c["input"] is not y or node_dtype(user) != node_dtype(y) \
                or node_dtype(y) is None:
            break
        y = user
    return y


_VIEW_PRIMS = ("view", "slice", "transpose", "unsqueeze", "cast")  # (a cast to its own dtype is the same tensor)


def _writes(node: fx.Node) -> bool:
    """An in-place op or a store (``t[index] = value``)."""
    return mutates(node) or (node.op == "call_function" and node.target is operator.setitem)


def _written_through(y: fx.Node) -> bool:
    """Whether a node writes in place into ``y`` or into a view of it (followed through views and casts)."""
    seen, frontier = {y}, [y]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if _writes(user) and user.args and user.args[0] is node:
                return True
            c = canonical(user)
            if user not in seen and (user.target is operator.getitem or (c is not None and c.prim in _VIEW_PRIMS)):
                seen.add(user)
                frontier.append(user)
    return False


def _written_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a node after ``first`` up to ``last`` (graph order) writes in place into anything."""
    node = first.next
    while node.op != "root" and node <= last:
        if _writes(node):
            return True
        node = node.next
    return False


def _row_slices(y: fx.Node) -> list[tuple[fx.Node, int]] | None:
    """(slice, dim) of every reader of ``y`` when each is a row slice (``_row_slice``), else None."""
    pieces = [(user, _row_slice(user, y)) for user in y.users]
    return pieces if pieces and all(dim is not None for _, dim in pieces) else None


def _row_slice(node: fx.Node, y: fx.Node) -> int | None:
    """The dim of ``node = y[..., a:b, ...]`` sliced along one static dim before the last (rows, not
    columns), else None."""
    shape, c = node_shape(y), canonical(node)
    if not shape or c is None or c.prim != "slice" or c["input"] is not y or c["step"] != 1 \
            or node.target is not operator.getitem \
            or not all(b is None or type(b) is int for b in (c["start"], c["end"])):
        return None
    dim = one_dim(c, len(shape))
    if dim is None or dim == len(shape) - 1 or not isinstance(shape[dim], int):
        return None
    return dim


def _bounds(piece: fx.Node, total: int) -> tuple[int, int]:
    """[start, end) of the rows a row slice takes, as Python resolves its bounds."""
    c = canonical(piece)
    return slice(c["start"], c["end"]).indices(total)[:2]


def _stored_slice(y: fx.Node) -> tuple | None:
    """(piece, dim, store, readers) when ``y``'s readers are one row slice ``piece`` rotated, then
    ``y[index] = rotation`` at the same index (one store, the rotation's dtype and shape the
    slice's), then readers of the whole ``y`` only; the slice a head or a tail of the rows."""
    stores = [u for u in y.users if u.op == "call_function" and u.target is operator.setitem and u.args[0] is y]
    if len(stores) != 1:
        return None
    store = stores[0]
    before = [u for u in y.users if u < store]  # (fx nodes compare by their place in the graph)
    readers = sorted(u for u in y.users if u > store)
    if len(before) != 1 or not readers:
        return None
    piece = before[0]
    dim = _row_slice(piece, y)
    found = rope_region(piece) if dim is not None else None
    if found is None or found[1] is not store.args[2] or piece.args[1] != store.args[1]:
        return None
    value = store.args[2]
    if node_dtype(value) != node_dtype(y) or node_shape(value) != node_shape(piece) \
            or any(_row_slice(r, y) is not None and r.args[1] == piece.args[1] for r in readers):
        return None
    start, end = _bounds(piece, node_shape(y)[dim])
    if start != 0 and end != node_shape(y)[dim]:
        return None  # rows kept on both sides: not one cat of two pieces
    return piece, dim, store, readers


def _region(x: fx.Node, y: fx.Node) -> list[fx.Node] | None:
    """The norm's nodes from ``x`` to ``y`` in graph order (those on a path between them, ``y``
    last), when nothing outside reads one of them but ``y``; else None."""
    below, frontier = set(), [x]
    while frontier:  # the nodes reading x, up to y (fx nodes compare by their place in the graph)
        frontier = [u for n in frontier for u in n.users if u not in below and u <= y]
        below.update(frontier)
    above, frontier = {y}, [y]
    while frontier:  # ... that y reads
        frontier = [a for n in frontier for a in n.all_input_nodes if a in below and a not in above]
        above.update(frontier)
    region = sorted(above)
    if any(u not in above for n in region if n is not y for u in n.users):
        return None
    return region


def _norm_of_rows(graph: fx.Graph, x: fx.Node, region: list[fx.Node], dim: int, index: Any,
                  rows: tuple[int, int]) -> fx.Node:
    """The norm (``region``'s nodes copied) of ``x[index]``, the rows [rows[0], rows[1]) of ``x``
    along ``dim``: inserted right after the original norm, where its inputs are, so that an in-place
    change of x after the norm does not reach the copy."""
    total, (start, end) = node_shape(x)[dim], rows
    with graph.inserting_before(region[-1].next):
        sliced = _rows_of(graph, x, dim, index, rows, region[-1])
        env: dict[fx.Node, Any] = {x: sliced}
        for node in region:
            new = graph.node_copy(node, lambda a: env.get(a, a))
            narrowed_meta(new, node, dim, start, end - start, total)
            env[node] = new
    return env[region[-1]]


def _rows_of(graph: fx.Graph, x: fx.Node, dim: int, index: Any, rows: tuple[int, int], at: fx.Node) -> fx.Node:
    """``x[index]`` (rows [rows[0], rows[1]) along ``dim``); of a transpose's input, transposed after,
    when ``x`` swaps ``dim`` with another (CogVideoX's ``q.transpose(1, 2)`` before its norm: the norm of
    the slice then reads a transpose, as the q/k fusion expects of a norm after the heads' swap)."""
    total, (start, end) = node_shape(x)[dim], rows
    piece = _piece_of_cat(x, dim, rows, at)
    if piece is not None:
        return piece
    c = canonical(x)
    n = len(node_shape(x))
    swapped = c is not None and c.prim == "transpose" and isinstance(c["input"], fx.Node) \
        and dim in (c["dim0"] % n, c["dim1"] % n)
    if not swapped:
        sliced = graph.call_function(operator.getitem, (x, index))
        narrowed_meta(sliced, x, dim, start, end - start, total)
        return sliced
    d0, d1 = c["dim0"] % n, c["dim1"] % n
    other = d1 if dim == d0 else d0
    source = graph.call_function(operator.getitem, (c["input"], rows_index(other, start, end)))
    narrowed_meta(source, c["input"], other, start, end - start, total)
    sliced = graph.call_method("transpose", (source, d0, d1))
    narrowed_meta(sliced, x, dim, start, end - start, total)
    return sliced


def _piece_of_cat(x: fx.Node, dim: int, rows: tuple[int, int], until: fx.Node) -> fx.Node | None:
    """The piece of ``x = cat([..., piece, ...], dim)`` (through cats of cats) whose rows are exactly
    ``rows``: ``x[rows]`` is that piece, the same elements (HunyuanVideo I2V joins its first frame's
    and the other frames' sums with a cat the next norm reads, then slices that norm's output at the
    same row), read in its place at ``until``. None when the rows are not one whole piece, or anything is
    written in place between the piece and ``until`` (through a view of the piece, its source: the cat
    copied the values before)."""
    c = canonical(x)
    if c is None or c.prim != "cat":
        return None
    shape = node_shape(x)
    pieces = list(c["tensors"])
    spans = piece_spans(pieces, dim) if shape and one_dim(c, len(shape)) == dim else None
    for piece, (start, end) in zip(pieces, spans or ()):
        if start <= rows[0] and rows[1] <= end:
            if node_dtype(piece) != node_dtype(x):
                return None
            if (start, end) == rows:
                return None if _written_between(piece, until) else piece
            return _piece_of_cat(piece, dim, (rows[0] - start, rows[1] - start), until)
    return None


def _split_piece(graph: fx.Graph, piece: fx.Node, dim: int, x: fx.Node, region: list[fx.Node]) -> fx.Node:
    """Replace ``piece`` (a slice of the norm's rows) by the norm of the same slice of ``x``; returns that norm."""
    rows = _bounds(piece, node_shape(x)[dim])
    norm = _norm_of_rows(graph, x, region, dim, rows_index(dim, *rows), rows)
    piece.replace_all_uses_with(norm)
    graph.erase_node(piece)
    return norm


def _store_as_cat(graph: fx.Graph, piece: fx.Node, dim: int, store: fx.Node, readers: list[fx.Node], x: fx.Node,
                  region: list[fx.Node]) -> list[fx.Node]:
    """``y[index] = rotation(y[index])`` read after as ``cat`` of the norm of the other rows and the
    rotation of the norm of ``x[index]`` (``_stored_slice``'s match)."""
    total = node_shape(x)[dim]
    start, end = _bounds(piece, total)
    rotated_norm = _split_piece(graph, piece, dim, x, region)
    rows = (end, total) if start == 0 else (0, start)  # the rows not stored
    kept = _norm_of_rows(graph, x, region, dim, rows_index(dim, *rows), rows)
    rotated = store.args[2]
    with graph.inserting_before(readers[0]):
        whole = graph.call_function(torch.cat, ([rotated, kept] if start == 0 else [kept, rotated], dim))
    copy_meta(whole, region[-1])
    for reader in readers:
        reader.replace_input_with(region[-1], whole)
    graph.erase_node(store)
    return [rotated_norm, kept]
