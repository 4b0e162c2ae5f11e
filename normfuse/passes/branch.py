"""The branch of a residual add: what the kernel can take over from it.

In ``s = residual + branch`` the branch is often not a plain value. Before the add,
models write

| the graph                                    | models                        | the kernel takes it as |
|----------------------------------------------|-------------------------------|------------------------|
| ``x + attn + mlp`` (a second add)            | GPT-J, GPT-NeoX, Phi, Cohere  | ``x1``                 |
| ``branch * keep`` with keep of shape (B,1,1) | timm drop_path (training)     | ``rowscale``           |
| ``dropout(branch, p)`` in training           | BERT, GPT-2, ViT, BART        | ``dropout_p``          |

Each writes a tensor the add reads straight back. The kernel reproduces them in the
graph's order and rounding (dropout, then the per-row scale, then the second branch:
``normfuse/kernels/reference.py``), so a fold is exact, except that a folded dropout
draws its mask from another random stream (the checker replays the kernel's mask
through the original subgraph: "equal given the mask").

A node is folded only when the step after it is its one reader.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from normfuse.passes.canonical import mutates, node_dtype, node_shape, real_users, same_dim, same_shape, tensor_meta
from normfuse.passes.find import as_add, identity_dropout, live_dropout_p
from normfuse.passes.graph import GraphIndex

__all__ = ["BranchFold", "fold_branch"]


@dataclass
class BranchFold:
    """The kernel's view of one branch: ``x`` after undoing the folded steps."""

    x: Any
    x1: fx.Node | None = None
    rowscale: fx.Node | None = None       # the graph's per-sample scale, shape (B, 1, ..., 1)
    dropout_p: float = 0.0
    nodes: list[fx.Node] = field(default_factory=list)  # the graph nodes the kernel now computes

    @property
    def folded(self) -> bool:
        return bool(self.nodes)


def _only_reader(node: Any, reader: fx.Node) -> bool:
    return isinstance(node, fx.Node) and real_users(node) == [reader]


def _live_dropout(index: GraphIndex, node: Any, shape) -> float | None:
    """p of a training-mode dropout of a tensor of ``shape`` (None if ``node`` is not one)."""
    p = live_dropout_p(index.canon(node))
    return p if p is not None and same_shape(node_shape(index.canon(node)["input"]), shape) else None


def _row_scale(index: GraphIndex, node: Any, shape) -> tuple[Any, fx.Node] | None:
    """``(value, scale)`` of ``value * scale`` where scale holds one number per sample (shape
    (B, 1, ..., 1)), needs no gradient, and the product keeps value's dtype (drop_path)."""
    c = index.canon(node)
    if c is None or c.prim != "mul" or shape is None or len(shape) < 2:
        return None
    for value, scale in ((c["input"], c["other"]), (c["other"], c["input"])):
        s_shape = node_shape(scale)
        meta = tensor_meta(scale)
        if not isinstance(scale, fx.Node) or s_shape is None or len(s_shape) != len(shape) \
                or not same_shape(node_shape(value), shape):
            continue
        if not same_dim(s_shape[0], shape[0]) or not all(same_dim(d, 1) for d in s_shape[1:]):
            continue
        # the kernel has no gradient for the scale: fold only a scale nothing differentiates
        if not isinstance(meta, torch.Tensor) or meta.requires_grad:
            continue
        if node_dtype(value) != node_dtype(node) or not all(isinstance(d, int) for d in shape):
            continue
        return value, scale
    return None


def _second_branch(index: GraphIndex, node: Any, shape, reader: fx.Node) -> tuple[Any, Any] | None:
    """``(a, b)`` of an add ``a + b`` of two full-shape tensors read only by ``reader``, which
    rounds to their promoted dtype (what the kernel's inner sum does)."""
    if not _only_reader(node, reader):
        return None
    inner = as_add(index, node, shape[-1] if shape else None)
    if inner is None or inner.reason is not None or inner.scaled is not None or inner.chain:
        return None
    a, b = inner.operands
    if not all(same_shape(node_shape(v), shape) for v in (a, b)):
        return None
    if node_dtype(node) != torch.promote_types(node_dtype(a), node_dtype(b)):
        return None  # an upcast sum (fp32 adds of bf16 values) rounds elsewhere
    if any(isinstance(v, fx.Node) and v.op == "get_attr" for v in (a, b)):
        return None
    if mutates(node) and not _only_reader(node.all_input_nodes[0], node):
        return None  # ``a += b`` where the old ``a`` is read elsewhere: those readers see the sum
    return a, b


def fold_branch(index: GraphIndex, add: fx.Node, branch: Any, *, second: bool, rowscale: bool,
                dropout: bool) -> BranchFold:
    """What of ``branch`` (an operand of ``add``) the kernel computes itself."""
    fold = BranchFold(branch)
    shape = node_shape(add)
    if not isinstance(branch, fx.Node) or shape is None:
        return fold
    reader = add
    branch, reader = _through_identity(index, fold, branch, reader)
    fold.x = branch
    if second:
        pair = _second_branch(index, branch, shape, reader)
        if pair is not None:
            a, b = pair
            # the one with steps the kernel can also take over is x; the other is x1
            if not _has_step(index, a, branch, shape, rowscale, dropout) and \
                    _has_step(index, b, branch, shape, rowscale, dropout):
                a, b = b, a
            fold.x, fold.x1 = a, b
            fold.nodes.append(branch)
            reader = branch
            fold.x, reader = _through_identity(index, fold, fold.x, reader)
    if rowscale and _only_reader(fold.x, reader):
        found = _row_scale(index, fold.x, shape)
        if found is not None:
            fold.nodes.append(fold.x)
            reader = fold.x
            fold.x, fold.rowscale = found
    if dropout and _only_reader(fold.x, reader):
        p = _live_dropout(index, fold.x, shape)
        if p is not None:
            fold.nodes.append(fold.x)
            fold.dropout_p = p
            fold.x = index.canon(fold.x)["input"]
    return fold


def _through_identity(index: GraphIndex, fold: BranchFold, value: Any, reader: fx.Node) -> tuple[Any, fx.Node]:
    """Past dropouts that are identities (eval mode, p = 0) read only by ``reader``: Falcon's
    ``dropout_add`` keeps one between its sum and the residual add."""
    while _only_reader(value, reader) and index.prim(value) == "dropout" and identity_dropout(index.canon(value)):
        fold.nodes.append(value)
        reader, value = value, index.canon(value)["input"]
    return value, reader


def _has_step(index: GraphIndex, value: Any, reader: fx.Node, shape, rowscale: bool, dropout: bool) -> bool:
    if not _only_reader(value, reader):
        return False
    return (rowscale and _row_scale(index, value, shape) is not None) or (
        dropout and _live_dropout(index, value, shape) is not None)
