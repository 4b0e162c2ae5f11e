"""The permuted (channel) layout, a fusion part: a norm over dim 1 of NCHW, read in place.

Convolutional models normalize channels: ConvNeXt, CoAtNet and MaxViT permute NCHW to NHWC,
add and norm over the last dim, and permute back (the add then moves through the permute:
``sum(a, b).permute(d) == a.permute(d) + b.permute(d)``); timm's and Gemma 3n's RmsNorm2d write
the norm out over dim 1. The kernels read such operands in place, rows along a strided dim
(``normfuse.kernels.triton``: the channels-first kernels), so the call reads x and residual
permuted, and its outputs go back to the layout the graph gave them.

``CHANNEL_LAYOUT`` is the part: an add_norm call whose add was found through a permute (``find``'s
``AddMatch.permute``), or a norm written out over dim 1 (``NormMatch.layout``), reads its operands
permuted by those dims (``Plan.permute``), and hands y and the sum back permuted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from normfuse.passes.canonical import tensor_meta
from normfuse.passes.find import permuted_layout
from normfuse.passes.graph import copy_meta
from normfuse.passes.parts.base import CallPiece, FusionPart, PlanContext

__all__ = ["CHANNEL_LAYOUT", "Layout"]


@dataclass(frozen=True)
class Layout:
    """How a call reads its operands and hands its outputs back."""

    operands: tuple[int, ...] | None   # x and residual are read permuted by these dims (the sum goes back)
    y_back: tuple[int, ...] | None      # a norm written out over dim 1: y comes with its channels last


def permuted(graph: fx.Graph, value: fx.Node, dims: tuple[int, ...], as_op: bool) -> fx.Node:
    """``value.permute(*dims)``, its fake value permuted too."""
    if as_op:
        node = graph.call_function(torch.ops.aten.permute.default, (value, list(dims)))
    else:
        node = graph.call_method("permute", (value, *dims))
    val = tensor_meta(value)
    for key in ("val", "example_value"):
        if key in value.meta and isinstance(val, torch.Tensor):
            node.meta[key] = val.permute(dims)
    return node


def _inverse(dims: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(range(len(dims)), key=dims.__getitem__))


_VIEWS = ("view", "view_as", torch.Tensor.view, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def _viewed_later(node: fx.Node) -> bool:
    """Whether a value computed from ``node`` (through any op: convolutions and elementwise ops
    keep a channels_last input's layout) reaches a ``.view()``, which may need the layout eager gave it."""
    seen, todo = set(), [node]
    while todo:
        for user in todo.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if user.op in ("call_method", "call_function") and user.target in _VIEWS:
                return True
            todo.append(user)
    return False


def _contiguous(graph: fx.Graph, value: fx.Node, as_op: bool) -> fx.Node:
    if as_op:
        return graph.call_function(torch.ops.aten.clone.default, (value,), {"memory_format": torch.contiguous_format})
    return graph.call_method("contiguous", (value,))


class _ChannelLayout(FusionPart):
    name = "channel_layout"
    exclusive = False

    def offer(self, ctx: PlanContext, site, found, plan):
        m, add = site.match, site.in_add
        operands = add.permute if plan.op == "add_norm" else m.layout if plan.op == "norm" else None
        if operands is None and m.layout is None:
            return None, None
        if plan.op == "add_norm" and operands is not None and add.scaled is None \
                and permuted_layout(plan.residual, operands) != permuted_layout(add.node, operands):
            plan.x, plan.residual = plan.residual, plan.x  # the call returns the sum in its residual's layout: the add's
        plan.permute = operands
        return Layout(operands, m.layout), None

    def operands(self, found: Layout, values: tuple, originals: tuple, rewriting) -> tuple[tuple, CallPiece]:
        if found.operands is None:
            return values, CallPiece()
        piece, moved = CallPiece(), []
        for value, original in zip(values, originals):
            if value is not None:
                value = permuted(rewriting.graph, value, found.operands, rewriting.as_op)
                piece.inserted.append(value)
                piece.holds[value] = original
            moved.append(value)
        return tuple(moved), piece

    def returned(self, found: Layout, name: str, value: fx.Node, original: fx.Node, rewriting
                 ) -> tuple[fx.Node, list[fx.Node], tuple[int, ...] | None]:
        """The call's output ``name`` ("y" or "s", the getitem ``value``) as the graph had
        ``original``: (the node replacing it, the nodes inserted, the dims it was permuted back by)."""
        dims = found.y_back if name == "y" else found.operands if name == "s" else None
        if dims is None:
            return value, [], None
        graph, as_op = rewriting.graph, rewriting.as_op
        value.meta.update({k: v.permute(dims) for k, v in value.meta.items()
                           if k in ("val", "example_value") and isinstance(v, torch.Tensor)})
        inverse = _inverse(dims)
        result = permuted(graph, value, inverse, as_op)
        copy_meta(result, original)
        inserted = [result]
        if name == "y" and _viewed_later(original):  # eager's y had x's layout: a .view() downstream may need it
            result = _contiguous(graph, result, as_op)
            copy_meta(result, original)
            inserted.append(result)
        return result, inserted, inverse


CHANNEL_LAYOUT = _ChannelLayout()
