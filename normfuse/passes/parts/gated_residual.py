"""The gated residual branch, a fusion part: ``norm(residual + x_gate * branch)``.

Diffusion transformers gate each sub-layer's output before its residual add (adaLN-Zero)::

    attn_output = gate_msa.unsqueeze(1) * attn_output
    hidden_states = hidden_states + attn_output
    norm_hidden_states = self.norm2(hidden_states)

The x_gate is per sample ((B, 1, C)) or per token ((B, S, C)), sometimes ``tanh(x_gate)``: a value the
graph computed, which the call reads as ``x_gate``. Eagerly the product is one more pass over the
branch; the call reads the branch and the x_gate and forms ``s = residual + branch * x_gate`` itself,
the product rounded as eager's (``normfuse.kernels.reference.gated_branch``).

``find_gated_branch(index, in_add)`` reads the add the norm normalizes; ``GATED_RESIDUAL`` is the
part: an add_norm call whose x is that product takes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from normfuse.passes.canonical import broadcasts_to, node_dtype, node_shape, real_users, same_shape
from normfuse.passes.find import upcasts
from normfuse.passes.graph import GraphIndex
from normfuse.passes.parts.base import CallPiece, FusionPart
from normfuse.vocabulary import KERNEL_DTYPES

__all__ = ["GatedBranch", "find_gated_branch", "GATED_RESIDUAL"]


@dataclass(frozen=True)
class GatedBranch:
    """One operand of the norm's add that is ``branch * x_gate``."""

    add: fx.Node
    product: fx.Node
    branch: fx.Node
    x_gate: fx.Node
    casts: tuple[fx.Node, ...] = ()      # identities between the branch and the product (x / 1.0)

    def describe(self) -> str:
        shape = tuple(node_shape(self.x_gate) or ())
        return f"x * x_gate {shape}"


def _gate_and_branch(product: fx.Node, c) -> tuple[fx.Node, fx.Node] | None:
    """(x_gate, branch) of a product whose one operand broadcasts to the other (the x_gate); for two
    full-size operands the first is taken as the x_gate (the product is the same)."""
    a, b = c["input"], c["other"]
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node) or a is b:
        return None
    shapes = node_shape(a), node_shape(b), node_shape(product)
    if any(not s for s in shapes) or any(node_dtype(t) not in KERNEL_DTYPES for t in (a, b)):
        return None
    for x_gate, branch in ((a, b), (b, a)):
        g, x = node_shape(x_gate), node_shape(branch)
        if same_shape(x, shapes[2]) and broadcasts_to(g, x):
            return x_gate, branch
    return None


def find_gated_branch(index: GraphIndex, in_add) -> GatedBranch | None:
    """The gated operand of the add the norm normalizes (``in_add``: find.find_input_add's), or else of an
    operand of it that is a sum only it reads (``(stream + gate * branch) + other``), or None."""
    if in_add is None or in_add.reason is not None:
        return None
    found = gated_operand(index, in_add.node)
    c = index.canon(in_add.node)
    for operand in (c["input"], c["other"]) if found is None and c is not None and c.prim == "add" else ():
        reader = in_add.node
        # (through casts: Wan's ``(h.float() + ffn.float() * gate).type_as(h)``, found for its reason)
        while isinstance(operand, fx.Node) and index.prim(operand) == "cast" and real_users(operand) == [reader]:
            reader, operand = operand, index.canon(operand)["input"]
        if isinstance(operand, fx.Node) and index.prim(operand) == "add" and real_users(operand) == [reader]:
            found = found or gated_operand(index, operand)
    return found


def gated_operand(index: GraphIndex, add: fx.Node) -> GatedBranch | None:
    """The operand of ``add`` that is ``branch * x_gate``, read by the add only, or None."""
    c = index.canon(add)
    if c is None or c.prim != "add" or c["alpha"] != 1:
        return None
    for operand in (c["input"], c["other"]):
        p = index.canon(operand) if isinstance(operand, fx.Node) else None
        if p is None or p.prim != "mul" or real_users(operand) != [add] or operand in index.norm_outputs:
            continue  # a written-out norm's last step (y = n * weight) is that norm's, not an x_gate
        found = _gate_and_branch(operand, p)
        # the product rounds to the promoted dtype, as the call's (gated_branch) does
        if found is not None and node_dtype(operand) == torch.promote_types(*map(node_dtype, found)):
            x_gate, branch = found
            same, casts = upcasts(index, branch)  # the branch before casts that keep its values and dtype
            if casts and node_dtype(same) == node_dtype(branch) and all(real_users(c) == [n] for c, n in
                                                                         zip(casts, [operand, *casts])):
                return GatedBranch(add, operand, same, x_gate, tuple(casts))
            return GatedBranch(add, operand, branch, x_gate)
    return None


def _second_branch_only(fold) -> bool:
    """The branch fold took a second add (x1), and no drop path or dropout (the kernel gates x before them)."""
    return fold is not None and fold.x1 is not None and fold.rowscale is None and not fold.dropout_p


def _in_second_branch(index: GraphIndex, plan, fold, claimed) -> tuple[GatedBranch | None, str | None]:
    """The gated operand of the inner add the branch fold took (``(stream + gate * branch) + other``: SD3.5's
    first attention's gated branch, then the second's; WanVACE's control hint added after the block): the call
    forms ``gate * branch + x1`` (x1 the other operand of the inner add), then adds ``other`` as its residual."""
    inner = next((n for n in fold.nodes if index.prim(n) == "add"), None)
    found = gated_operand(index, inner) if inner is not None else None
    if found is None:
        return None, "the call takes the add's operand that is a sum as its x and x1, and neither is gated"
    if found.product in claimed:
        return None, "the gated product is computed by another norm's call (as the scale of its output)"
    other = fold.x if found.product is fold.x1 else fold.x1 if found.product is fold.x else None
    if other is None or node_dtype(other) != node_dtype(found.product):
        return None, "the gated product and the value it is first added to differ in dtype"
    # (the fold changes only once taken: a refused gate leaves the fold's x and x1 as they were)
    fold.x, fold.x1 = found.product, other  # the two operands of the inner sum play one part in it
    plan.x = found.branch
    return found, None


class _GatedResidual(FusionPart):
    name = "gated_residual"
    exclusive = False  # y is still the norm of the sum
    roles = {"x_gate": "xg"}
    operand_name = "the gated branch's factor (x_gate)"

    def find(self, index: GraphIndex, match, in_add=None) -> GatedBranch | None:
        return find_gated_branch(index, in_add)

    def offer(self, ctx, site, found: GatedBranch | None, plan) -> tuple[GatedBranch | None, str | None]:
        if found is None:
            return None, None
        if not ctx.config.fuse_modulation:
            return None, "gated residual branches are not fused (fuse_modulation=False)"
        if ctx.as_op:
            return None, "Inductor's post-grad pass does not write the gated branch (use backend=\"normfuse\" or optimize)"
        add = site.in_add
        if plan.op != "add_norm" or add is None or plan.permute is not None:
            return None, "the call does not take the add the gated branch goes into"
        if found.product in ctx.claimed:
            return None, "the gated product is computed by another norm's call (as the scale of its output)"
        fold = plan.taken.get("branch_fold")
        if not all(step.joins_gated_branch or step.name == "branch_fold" and _second_branch_only(fold)
                   for step in ctx.steps if step.name in plan.taken) or len(plan.sites) > 1:
            return None, "the call takes another step on its branch or its output (drop path, dropout, a gated " \
                         "norm, fp8, a second norm) that the gated branch does not combine with yet"
        if fold is not None:  # the add's branch is a sum, the call's x and x1: its gated operand is x
            return _in_second_branch(ctx.analysis.index, plan, fold, ctx.claimed)
        if found.add is not add.node and found.add not in add.node.all_input_nodes:  # (find read through casts)
            return None, "the gated branch is in a sum rounded by a cast before the add the call takes (Wan's " \
                         "fp32 composition): the call's second branch is a sum in the product's dtype"
        if found.add is not add.node or plan.residual_scale != 1.0:
            return None, "the call does not take the add the gated branch goes into"
        if plan.residual is found.product:  # the stream was taken for the branch: they play one part in the sum
            plan.x, plan.residual = plan.residual, plan.x
        if plan.x is not found.product:
            return None, "the gated product is the add's stream, not its branch"
        plan.x = found.branch
        return found, None

    def may_drop(self, found: GatedBranch) -> bool:
        return False  # the call's x is the branch: without the x_gate it would sum another value

    def reads(self, found: GatedBranch) -> tuple[fx.Node, ...]:
        return (found.branch, found.x_gate)

    def folded(self, found: GatedBranch) -> tuple[fx.Node, ...]:
        return (found.product, *found.casts)

    def call(self, found: GatedBranch, rewriting) -> CallPiece:
        return CallPiece({"x_gate": rewriting.resolve(found.x_gate)})

    def report(self, record, found: GatedBranch, fused: bool, reason: str | None) -> None:
        record.gated_residual = found.describe()
        record.fused_gated_residual = fused
        record.gated_residual_reason = None if fused else reason

    def eager_nodes(self, found: GatedBranch) -> tuple[fx.Node, ...]:
        return (found.product, *found.casts)

    def fused_bytes(self, found: GatedBranch, y_bytes: int, size) -> tuple[int, int]:
        """Forward: the kernels' prologue reads the gate (x in place of the product the add read).
        Backward: the kernels' backward reads the branch x and the gate, and writes the gate's
        gradient (kernels/triton.py: the chain's backward)."""
        return size.bytes(found.x_gate), size.bytes(found.branch) + 2 * size.bytes(found.x_gate)

    # ---------------------------------------------------------------- checker
    def uses(self, options: dict) -> bool:
        return options.get("x_gate") is not None

    def symbolic_input(self, options: dict, rows: dict, x: list, ops) -> list:
        return x if rows.get("x_gate") is None else ops.elementwise(ops.mul, x, rows["x_gate"])


GATED_RESIDUAL = _GatedResidual()
