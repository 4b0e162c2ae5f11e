"""The gate of a gated norm, a fusion part: ``norm(x * act(z))`` or ``norm(x) * act(z)``.

Hybrid models gate the norm of their state-space or linear-attention mixer, right next to
the residual stream: Mamba2 / NemotronH's ``MambaRMSNormGated`` multiplies the norm's input
(``x.float() * silu(z.float())``, then the norm), Qwen3-Next's and Kimi-Linear's gated norms
multiply its output (``y.float() * silu(z.float())`` or ``sigmoid``, then a cast). Eagerly the
gate is two more kernels and one more round trip of the row; the fused call takes it
(``gate=``, ``gate_position``, ``gate_activation``, ``gate_out_dtype``; the rounding points
are in ``normfuse.kernels.reference``, "Gated norms").

``find_gate(index, match)`` returns a ``GateMatch`` (what the gate is, its ``spec`` for the call, the nodes it
replaces) or None when the norm is not gated in a way the kernel computes. ``GATE`` is the part:
a plain norm's call, or an add_norm call gating after the norm, takes the gate ("before" gates
the norm's input, so the call reads x and z instead of the add's sum).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.specs import Gate
from normfuse.passes.canonical import is_exact_upcast, node_dtype, node_shape, real_users, same_shape
from normfuse.passes.find import upcasts
from normfuse.passes.graph import GraphIndex
from normfuse.passes.parts.base import CallPiece, FusionPart
from normfuse.vocabulary import GATE_ACTIVATIONS, KERNEL_DTYPES

__all__ = ["GateMatch", "find_gate", "GATE"]

F32 = torch.float32


@dataclass(frozen=True)
class GateMatch:
    """The gate of one norm, as the fused call's options."""

    position: str                        # "before": norm(x * act(z)); "after": norm(x) * act(z)
    activation: str                      # one of GATE_ACTIVATIONS (canonical prims by the same names)
    gate: fx.Node                        # z (before its fp32 upcast)
    x: fx.Node | None = None             # "before": the value gated (before its fp32 upcast)
    output: fx.Node | None = None        # "after": the gated output the call's y replaces
    out_dtype: torch.dtype | None = None  # "after": the dtype the gated output is rounded to
    nodes: tuple[fx.Node, ...] = ()      # the gate's own nodes (the product, the activation, casts)

    def spec(self, z: Any) -> Gate:
        """The kernel-facing argument group (``normfuse.kernels.specs.Gate``) with ``z`` the gate
        the call reads."""
        return Gate(z, self.position, self.activation, self.out_dtype if self.position == "after" else None)


def _gating(index: GraphIndex, product: Any) -> tuple[str, Any, Any, list] | None:
    """``product`` = fp32(v) * act(fp32(z)) in fp32: (activation, v's node, z, nodes)."""
    c = index.canon(product) if isinstance(product, fx.Node) else None
    if c is None or c.prim != "mul" or node_dtype(product) != F32:
        return None
    for act, value in ((c["other"], c["input"]), (c["input"], c["other"])):
        activation = index.prim(act)
        if activation not in GATE_ACTIVATIONS:
            continue
        z, casts = upcasts(index, index.canon(act)["input"])
        taken = [product, act, *casts]
        if node_dtype(index.canon(act)["input"]) != F32 or not isinstance(z, fx.Node) \
                or node_dtype(z) not in KERNEL_DTYPES:
            continue  # the activation computed in 16 bits rounds where the kernel does not
        if not isinstance(value, fx.Node) or not same_shape(node_shape(value), node_shape(z)):
            continue
        return activation, value, z, taken
    return None


def _only_read_by(node: fx.Node, readers: set) -> bool:
    return all(u in readers for u in real_users(node))


def find_gate(index: GraphIndex, match) -> GateMatch | None:
    """The gate of a matched norm (see the module docstring), or None."""
    if match.kind != "rms_norm" or match.bias is not None:
        return None
    inside = set(match.nodes)
    # before: the norm normalizes fp32(x) * act(fp32(z)), which nothing else reads (Mamba2 views
    # it as (..., groups, N / groups) first: with one group, the same rows)
    normalized, views = match.input, []
    if index.prim(normalized) == "view" and isinstance(index.canon(normalized)["input"], fx.Node) \
            and (node_shape(normalized) or (None,))[-1:] == (node_shape(index.canon(normalized)["input"]) or (0,))[-1:]:
        views.append(normalized)
        normalized = index.canon(normalized)["input"]
    gating = _gating(index, normalized)
    if gating is not None:
        activation, value, z, taken = gating
        x, casts = upcasts(index, value)
        taken += casts
        readers = inside | set(views)
        if node_dtype(x) in KERNEL_DTYPES and all(_only_read_by(n, readers) for n in (normalized, *views)):
            return GateMatch("before", activation, z, x=x, nodes=tuple(views + taken))
    # after: y (or its fp32 upcast) times act(fp32(z)), then maybe a cast; y read by nothing else
    readers = real_users(match.output)
    if len(readers) != 1:
        return None
    y_value = readers[0]
    taken: list = []
    if index.prim(y_value) == "cast":
        if not is_exact_upcast(node_dtype(match.output), node_dtype(y_value)) or len(real_users(y_value)) != 1:
            return None
        taken.append(y_value)
        product = real_users(y_value)[0]
    else:
        product, y_value = y_value, match.output
    gating = _gating(index, product)
    if gating is None or gating[1] is not y_value:
        return None
    activation, _, z, more = gating
    output = product
    readers = real_users(product)
    if len(readers) == 1 and index.prim(readers[0]) == "cast" and node_dtype(readers[0]) in KERNEL_DTYPES:
        output = readers[0]
        more.append(output)
    return GateMatch("after", activation, z, output=output, out_dtype=node_dtype(output), nodes=tuple(taken + more))


class _Gate(FusionPart):
    name = "gate"
    roles = {"gate": "g"}

    def find(self, index: GraphIndex, match, in_add=None) -> GateMatch | None:
        return find_gate(index, match)

    def offer(self, ctx, site, found: GateMatch | None, plan) -> tuple[GateMatch | None, str | None]:
        if found is None:
            return None, None
        if not ctx.config.fuse_gate:
            return None, "gates are not fused (fuse_gate=False)"
        if ctx.as_op:
            return None, "Inductor's post-grad pass does not write the gated call (use backend=\"normfuse\" or optimize)"
        if plan.op == "add_norm" and found.position == "before":
            return None, "the gate multiplies the norm's input, which is the add's sum: no call gates a sum"
        if plan.op not in ("norm", "add_norm"):
            return None, "the norm's output goes into the add after it in the same call (norm_add)"
        if found.position == "before":  # the call reads x and z, and gates x itself
            plan.x, plan.sum_dtype = found.x, node_dtype(found.x)
        return found, None

    def reads(self, found: GateMatch) -> tuple[fx.Node, ...]:
        return (found.gate,)

    def nodes(self, found: GateMatch) -> tuple[fx.Node, ...]:
        return found.nodes

    def call(self, found: GateMatch, rewriting) -> CallPiece:
        return CallPiece(found.spec(rewriting.resolve(found.gate)).kernel_args())

    def y_output(self, found: GateMatch, y: fx.Node) -> fx.Node:
        return found.output if found.position == "after" else y

    def report(self, record, found: GateMatch, fused: bool, reason: str | None) -> None:
        record.gate = f"{found.activation}(z) {found.position} the norm"
        record.fused_gate = fused
        if not fused and reason is not None:
            record.gate_reason = reason

    def uses(self, options: dict) -> bool:
        return options.get("gate") is not None

    def symbolic(self, options: dict, rows: dict, s: list, norm, ops) -> dict[str, list] | None:
        """act(z), before the norm (its input gated) or after it (its output)."""
        act = ops.elementwise(lambda v: ops.activation(options.get("gate_activation", "silu"), v), rows["gate"])
        if options.get("gate_position", "before") == "before":
            return {"y": norm(ops.elementwise(ops.mul, s, act)), "s": s}
        return {"y": ops.elementwise(ops.mul, norm(s), act), "s": s}


GATE = _Gate()
