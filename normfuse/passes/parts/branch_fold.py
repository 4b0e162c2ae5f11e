"""The branch of a residual add, a fusion part: what the kernel can take over from it.

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

A node is folded only when the step after it is its one reader. ``BRANCH_FOLD`` is the part: an
add_norm call (not a permuted one) takes what ``fold_branch`` folds of its x (or, when that
folds nothing and the stream is unknown, of its residual) as ``x1``, ``rowscale`` and
``dropout_p`` (``fuse_branch``; dropout also ``fuse_dropout``, and never where the call cannot
draw a seed: Inductor's post-grad graphs, or DTensors, whose ranks would draw one pattern).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.specs import Dropout
from normfuse.passes.canonical import mutates, node_dtype, node_shape, real_users, same_dim, same_shape, tensor_meta
from normfuse.passes.find import as_add, identity_dropout, live_dropout_p
from normfuse.passes.graph import GraphIndex
from normfuse.passes.parts.base import CallPiece, FusionPart

__all__ = ["BranchFold", "fold_branch", "BRANCH_FOLD"]


@dataclass
class BranchFold:
    """The kernel's view of one branch: ``x`` after undoing the folded steps."""

    x: Any
    x1: fx.Node | None = None
    rowscale: fx.Node | None = None       # the graph's per-sample scale, shape (B, 1, ..., 1)
    dropout_p: float = 0.0
    nodes: list[fx.Node] = field(default_factory=list)  # the graph nodes the kernel now computes
    shape: tuple | None = None            # the add's shape (rowscale becomes one number per row of it)

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
    shape = node_shape(add)
    fold = BranchFold(branch, shape=shape)
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


# --------------------------------------------------------------------------- the part

def _per_row(graph: fx.Graph, scale: fx.Node, shape: tuple, as_op: bool) -> list[fx.Node]:
    """A (B, 1, ..., 1) scale as the kernel's one number per row: reshaped and expanded to
    shape[:-1] (a view; the op reads it as rows)."""
    flat_shape, rows_shape = list(node_shape(scale)[:-1]), list(shape[:-1])
    if as_op:
        flat = graph.call_function(torch.ops.aten.view.default, (scale, flat_shape))
        rows = graph.call_function(torch.ops.aten.expand.default, (flat, rows_shape))
    else:
        flat = graph.call_method("reshape", (scale, *flat_shape))
        rows = graph.call_method("expand", (flat, *rows_shape))
    for key in ("val", "example_value"):
        val = scale.meta.get(key)
        if isinstance(val, torch.Tensor):
            flat.meta[key] = val.reshape(flat_shape)
            rows.meta[key] = flat.meta[key].expand(rows_shape)
    return [flat, rows]


class _BranchFold(FusionPart):
    name = "branch_fold"
    exclusive = False  # y is still the norm of the sum: a second norm may share the call
    roles = {"x1": "xb", "rowscale": "k"}

    def offer(self, ctx, site, found, plan) -> tuple[BranchFold | None, None]:
        add = site.in_add
        if plan.op != "add_norm" or add is None or plan.permute is not None or not ctx.config.fuse_branch:
            return None, None
        # the kernel draws a rank's mask from its local row index: on DTensors, ranks holding
        # different rows would draw the same pattern, so their dropout stays eager's
        from normfuse.kernels.sharding import is_dtensor
        local_rows = is_dtensor(tensor_meta(add.node))
        modes = dict(second=True, rowscale=True, dropout=ctx.config.fuse_dropout and not ctx.as_op and not local_rows)
        index = ctx.analysis.index
        fold = fold_branch(index, add.node, plan.x, **modes)
        if not fold.folded and add.scaled is None:
            # the stream may be unknown (an operand is another site's output): the other
            # operand may be the branch; x and residual play the same part in the sum
            other = fold_branch(index, add.node, plan.residual, **modes)
            if other.folded:
                fold, plan.residual = other, plan.x
        if not fold.folded:
            return None, None
        if any(v in ctx.claimed and index.prim(v) != "add" for v in (fold.x, fold.x1)):
            # a value another call computes in its epilogue (a norm's scaled output: Z-Image's ``tanh(g) *
            # norm2(attn)``), not a sum another call returns: folding it left the graph's nodes out of order
            return None, None
        plan.x = fold.x
        return fold, None

    def reads(self, found: BranchFold) -> tuple[fx.Node, ...]:
        return tuple(v for v in (found.x1, found.rowscale) if isinstance(v, fx.Node))

    def folded(self, found: BranchFold) -> tuple[fx.Node, ...]:
        return tuple(found.nodes)

    def call(self, found: BranchFold, rewriting) -> CallPiece:
        piece = CallPiece()
        if found.x1 is not None:
            piece.options["x1"] = rewriting.resolve(found.x1)
        if found.rowscale is not None:
            piece.inserted = _per_row(rewriting.graph, found.rowscale, found.shape, rewriting.as_op)
            piece.options["rowscale"] = piece.inserted[-1]
            piece.holds = {view: found.rowscale for view in piece.inserted}
        if found.dropout_p:  # no seed: the call draws one per run, as eager's dropout draws a mask
            piece.options.update(Dropout(found.dropout_p).kernel_args())
        return piece

    def report(self, record, found: BranchFold, fused: bool, reason: str | None) -> None:
        record.fused_x1 = fused and found.x1 is not None
        record.fused_rowscale = fused and found.rowscale is not None
        record.fused_dropout = fused and bool(found.dropout_p)

    def uses(self, options: dict) -> bool:
        return any(options.get(k) for k in ("x1", "rowscale", "dropout_p"))

    def symbolic_input(self, options: dict, rows: dict, x: list, ops) -> list:
        """dropout (given the mask), the per-row scale, the second branch: the kernel's order."""
        p = float(options.get("dropout_p") or 0.0)
        if p:
            keep_scale = ops.rational(1.0 / (1.0 - p))
            x = ops.elementwise(lambda xv, m: xv * m * keep_scale, x, ops.mask)
        if rows.get("rowscale") is not None:
            x = ops.elementwise(ops.mul, x, rows["rowscale"])
        if rows.get("x1") is not None:
            x = ops.elementwise(ops.add, x, rows["x1"])
        return x

    def check_arguments(self, options: dict, x) -> None:
        if options.get("rowscale") is not None:  # one number per sample, as the kernel's per-row view
            scale = options["rowscale"]
            options["rowscale"] = scale.reshape(scale.shape[:-1]).expand(x.shape[:-1])


BRANCH_FOLD = _BranchFold()
