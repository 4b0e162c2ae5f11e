"""The cost model: HBM bytes and kernel launches of a site, computed eagerly and by its fused call.

Read off the analysed graph's shape metadata (``normfuse.audit`` runs it on meta-device
graphs: no data, no compute). Eagerly, every non-free node of the site is one kernel that
reads its inputs and writes its output; its backward is what autograd runs for it
(docs/audit.md states the arithmetic). Fused, the plan's call reads each operand once and
writes each output once; its backward reads the saved sum and statistics. An estimate
counted per kernel, not a timing.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.specs import stores_mean
from normfuse.passes.analysis import SiteAnalysis
from normfuse.passes.canonical import node_dtype, node_shape, real_users, tensor_meta
from normfuse.passes.find import identity_dropout
from normfuse.passes.order import taken_steps
from normfuse.passes.parts import folded_nodes, taken_parts
from normfuse.passes.planning import Plan

__all__ = ["Traffic", "site_bytes", "numel"]


def _numel_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:  # noqa: BLE001 - a symbolic size without a hint
            return 0
    if isinstance(value, (tuple, list)):
        return sum(_numel_bytes(v) for v in value)
    return 0


def _bytes(node: Any) -> int:
    """Bytes of the tensor(s) a node produces, from the graph's shape metadata."""
    if not isinstance(node, fx.Node):
        return 0
    for key in ("val", "example_value"):
        if key in node.meta:
            return _numel_bytes(node.meta[key])
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return math.prod(int(d) for d in tm.shape) * tm.dtype.itemsize
    return 0


def _last_dim(node: Any) -> int:
    shape = node_shape(node)
    try:
        return int(shape[-1]) if shape else 1
    except Exception:  # noqa: BLE001
        return 1


def numel(node: Any) -> int:
    t = tensor_meta(node)
    try:
        return int(math.prod(int(d) for d in t.shape)) if t is not None else 0
    except Exception:  # noqa: BLE001
        return 0


# the sizes a fusion part's fused_bytes reads off the graph
_SIZES = SimpleNamespace(bytes=_bytes, numel=numel)


@dataclass
class Traffic:
    """HBM bytes and kernel launches of one way of computing a site, forward and backward."""

    fwd: int = 0
    bwd: int = 0
    fwd_kernels: int = 0
    bwd_kernels: int = 0

    def add(self, fwd: int = 0, bwd: int = 0, fwd_kernels: int = 0, bwd_kernels: int = 0) -> None:
        self.fwd += fwd
        self.bwd += bwd
        self.fwd_kernels += fwd_kernels
        self.bwd_kernels += bwd_kernels

    def to_dict(self) -> dict[str, int]:
        return {"fwd": self.fwd, "bwd": self.bwd, "fwd_kernels": self.fwd_kernels, "bwd_kernels": self.bwd_kernels}


def _is_free(index, node: fx.Node) -> bool:
    """Nodes that launch no kernel: views/reshapes, identity dropout, getitem, casts to the same dtype."""
    if node.op not in ("call_function", "call_method", "call_module") or node.target is operator.getitem:
        return True
    prim = index.prim(node)
    if prim == "view":
        return True
    if prim == "dropout":  # identity in eval mode or at p = 0
        return identity_dropout(index.canon(node))
    if prim == "cast":
        src = index.canon(node)["input"]
        return node_dtype(src) == node_dtype(node)
    return False


def _eager(index, node: fx.Node) -> Traffic:
    """What one eager kernel moves: its forward, and the backward autograd runs for it."""
    t = Traffic()
    if _is_free(index, node):
        return t
    prim = index.prim(node)
    ins = [a for a in node.all_input_nodes if _bytes(a)]
    out = _bytes(node)
    reads = sum(_bytes(a) for a in ins)
    if prim in ("layer_norm", "rms_norm"):
        m = index.canon(node)
        x = m["input"]
        rows = numel(x) // max(1, _last_dim(x))
        # ATen native_layer_norm returns its stats as outputs (counted in `out`); the torch-level
        # calls write them too, as buffers the graph does not show
        stats = 0 if m.multi_output else (2 if prim == "layer_norm" else 1) * 4 * rows
        t.add(fwd=reads + out + stats, fwd_kernels=1)
        # backward: reads dy, x, stats, weight; writes dx, dweight, dbias
        params = sum(_bytes(p) for p in (m["weight"], m["bias"]) if isinstance(p, fx.Node))
        t.add(bwd=2 * _bytes(x) + out + stats + 2 * params, bwd_kernels=1)
        return t
    if prim == "dropout":
        # training-mode dropout also writes its keep mask (one byte an element), which the
        # backward reads with the gradient (free in eval mode: _is_free)
        t.add(fwd=reads + out + numel(node), fwd_kernels=1)
        t.add(bwd=out + numel(node) + reads, bwd_kernels=1)
        return t
    t.add(fwd=reads + out, fwd_kernels=1)
    if prim in ("add", "sub"):
        # the gradient passes through unchanged; a broadcast operand needs a reduction of it
        for a in ins:
            if numel(a) < numel(node):
                t.add(bwd=out + _bytes(a), bwd_kernels=1)
    elif prim in ("mul", "div"):
        # d(a*b)/da = g*b: read g and the other operand(s), write the operand's grad
        for a in ins:
            t.add(bwd=out + (reads - _bytes(a)) + _bytes(a) + (_bytes(a) if prim == "div" else 0), bwd_kernels=1)
    elif prim in ("mean", "var"):
        t.add(bwd=out + (reads if prim == "var" else 0) + reads, bwd_kernels=1)
    elif prim == "cast":
        t.add(bwd=out + reads, bwd_kernels=1)
    else:  # pow, square, rsqrt, sqrt, reciprocal and anything else: read g and the input, write its grad
        t.add(bwd=out + 2 * reads, bwd_kernels=1)
    return t


def _accumulations(node: fx.Node) -> Traffic:
    """Autograd sums the grads of a value read by k kernels: k-1 adds of (read 2, write 1)."""
    k = len(real_users(node))
    return Traffic(bwd=3 * (k - 1) * _bytes(node), bwd_kernels=k - 1) if k > 1 else Traffic()


def _site_nodes(site: SiteAnalysis, plan: Plan | None) -> list[fx.Node]:
    """The graph nodes the plan's call replaces for this site (unfused: the norm alone)."""
    m = site.match
    nodes = list(m.nodes)
    op = plan.op if plan is not None else None
    if op == "add_norm" and site.in_add is not None and site.number == plan.lead:  # the lead prices the add
        add = site.in_add
        nodes = [*reversed(folded_nodes(plan.taken)), add.node, *add.chain, *nodes]
        if add.scaled is not None:  # alpha * x of DeepNorm, computed before the add
            scale = add.node.all_input_nodes[add.scaled] if len(add.node.all_input_nodes) > add.scaled else None
            if scale is not None and scale not in nodes:
                nodes.insert(0, scale)
    elif op == "norm_add" and site.output_add is not None:
        nodes = [*nodes, *site.output_chain, site.output_add.node]
    if plan is not None and site.number == plan.lead:  # the steps of the parts the call takes (eager: y read back)
        for step, found in taken_steps(plan.taken):
            nodes = [*nodes, *step.eager_nodes(found)]
    seen: list[fx.Node] = []
    for n in nodes:
        if n not in seen:
            seen.append(n)
    return seen


def _widening(dtype: torch.dtype | None, residual_dtype: torch.dtype | None) -> float:
    """The extra bytes per byte of a 16-bit stream tensor kept in ``residual_dtype`` (0: none)."""
    if residual_dtype is None or dtype not in (torch.float16, torch.bfloat16):
        return 0.0
    return residual_dtype.itemsize / dtype.itemsize - 1.0


def _kernel_operands(site: SiteAnalysis, plan: Plan) -> list:
    """The tensors an add_norm kernel reads for the sum: the add's operands, or, with nodes
    ahead of the add folded (the branch), x and what the folding parts read in place of the
    value the add read."""
    folded = folded_nodes(plan.taken)
    if not folded:
        return list(site.in_add.operands)
    rest = [a for a in site.in_add.operands if a is not folded[0]]
    reads = [r for part, found in taken_parts(plan.taken) if part.folded(found) for r in part.reads(found)]
    return [plan.x, *reads, *rest]


def _escapes(node: fx.Node, inside: set) -> bool:
    return any(u not in inside for u in real_users(node))


def site_bytes(index, site: SiteAnalysis, plan: Plan | None, residual_dtype: torch.dtype | None = None
               ) -> tuple[Traffic, Traffic, list[fx.Node]]:
    """(eager, fused, nodes): HBM traffic of a site as the graph computes it and as the call of
    ``plan`` computes it (None: not fused, so the same as eager). ``residual_dtype``: the
    stream's sums kept in this dtype (``optimize(residual_dtype=)``)."""
    nodes = _site_nodes(site, plan)
    inside = set(nodes)
    eager = Traffic()
    for n in nodes:
        e = _eager(index, n)
        eager.add(e.fwd, e.bwd, e.fwd_kernels, e.bwd_kernels)
        if not _is_free(index, n):
            # the norm output's grads are summed before either backward, so only inner values count
            a = _accumulations(n) if n is not nodes[-1] else Traffic()
            eager.add(a.fwd, a.bwd, a.fwd_kernels, a.bwd_kernels)
    if plan is None:
        return eager, Traffic(eager.fwd, eager.bwd, eager.fwd_kernels, eager.bwd_kernels), nodes
    m, op = site.match, plan.op
    if site.number != plan.lead:
        # computed by its lead norm's kernel, which reads the sum once: this norm adds its
        # parameters and output (forward), dy1 and its parameter grads (backward), no kernel
        params = sum(_bytes(p) for p in (m.weight, m.bias) if isinstance(p, fx.Node))
        return eager, Traffic(fwd=params + _bytes(m.output), bwd=_bytes(m.output) + 2 * params), nodes
    n_cols = m.hidden_size or 1
    x_bytes = _bytes(m.input)
    rows = numel(m.input) // n_cols
    stats = (2 if stores_mean(m.kind) else 1) * 4 * rows
    params = sum(_bytes(p) for p in (m.weight, m.bias) if isinstance(p, fx.Node))
    y_bytes = _bytes(m.output)
    fused = Traffic(fwd_kernels=1, bwd_kernels=1)
    if op == "add_norm":
        add = site.in_add.node
        operands = sum(_bytes(a) for a in _kernel_operands(site, plan) if isinstance(a, fx.Node))
        s_bytes = _bytes(add)
        stored = site.sum_continues
        # fwd: read x, residual, weight, bias; write y, s (when used elsewhere), stats
        fused.add(fwd=operands + params + y_bytes + (s_bytes if stored else 0) + stats)
        # bwd: when grads are needed the kernel always stores s (add_norm's return_sum or
        # _grad_needed): a training step pays one more write of s in the forward when nothing
        # else reads it, or reads ds when something does; the backward kernel reads s. Then
        # dy, stats and weight; it writes dx, dresidual (unless it is dx itself: residual_scale 1,
        # same dtypes), dweight, dbias
        rebuild = 2 * s_bytes
        dtypes = {node_dtype(a) for a in site.in_add.operands if isinstance(a, fx.Node)}
        shared = site.in_add.residual_scale == 1.0 and len(dtypes) == 1
        grads = operands // 2 if shared else operands
        fused.add(bwd=y_bytes + rebuild + stats + 2 * params + grads)
        wide = _widening(node_dtype(add), residual_dtype)
        if wide:  # the stream in fp32: the sum written, the residual read, s re-read, dresidual wider
            fused.add(fwd=int(wide * s_bytes) * (2 if stored else 1), bwd=int(wide * s_bytes) * 3)
    elif op == "norm_add":
        out = site.output_add.node
        residual = [a for a in site.output_add.operands if isinstance(a, fx.Node) and a is not m.output]
        res = sum(_bytes(a) for a in residual)
        stored = _escapes(m.output, inside)
        fused.add(fwd=x_bytes + res + params + _bytes(out) + (y_bytes if stored else 0) + stats)
        # bwd: read dout (and dy when y was stored), f, stats, weight; write df, dresidual (unless
        # it is dout itself: residual_scale 1, same dtype), dweight, dbias
        shared = site.output_add.residual_scale == 1.0 and all(node_dtype(a) == node_dtype(out) for a in residual)
        fused.add(bwd=_bytes(out) + (y_bytes if stored else 0) + x_bytes + stats + 2 * params + x_bytes
                  + (0 if shared else res))
        wide = _widening(node_dtype(out), residual_dtype)
        if wide:  # the stream in fp32: out written and the residual read wider, their grads too
            fused.add(fwd=int(wide * (_bytes(out) + res)), bwd=int(wide * (_bytes(out) + res)))
    else:  # "norm"
        fused.add(fwd=x_bytes + params + y_bytes + stats)
        fused.add(bwd=y_bytes + x_bytes + stats + 2 * params + x_bytes)
    for step, found in taken_steps(plan.taken):  # what the steps the call takes write (or save) besides y and s
        fwd, bwd = step.fused_bytes(found, y_bytes, _SIZES)
        fused.add(fwd=fwd, bwd=bwd)
    return eager, fused, nodes


