"""Find sites: every norm in a graph, and the residual adds next to it.

A norm is matched in one of two ways, always on the canonical view:
- a norm call (``F.layer_norm``, ``torch.rms_norm``, ``aten.native_layer_norm``, ...);
- a decomposed norm, anchored at its row statistic ``mean(-1, keepdim=True)``:
  RMSNorm ``u * rsqrt(mean(u^2) + eps)`` and LayerNorm ``(u - mean) * rsqrt(var + eps)``
  in every spelling the canonical table knows, followed by an optional tail of casts,
  ``* weight`` (or ``* (offset + weight)``) and ``+ bias``.

Eps, weight, bias, offset and where each cast rounds are read off the graph. The
tail's rounding points decide the fused op's modes (``resolve_tail``); a tail the op
cannot reproduce is cut short, so the unmatched rest stays in the graph as it was.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from normfuse.passes.canonical import (Canon, canonical, dim_named, dim_value, is_exact_upcast, last_dim, node_dtype,
                                       node_shape, real_users, same_dim, same_shape, tensor_meta)
from normfuse.passes.graph import GraphIndex
from normfuse.vocabulary import KERNEL_DTYPES, LOW_PRECISION, TORCH_NORMS

__all__ = ["NormMatch", "AddMatch", "find_norms", "find_elementwise_norms", "const_value", "upcasts", "strip_upcasts", "find_input_add",
           "find_output_add", "as_add", "live_dropout_p", "autocast_upcast"]

F32 = torch.float32


@dataclass(frozen=True)
class NormMatch:
    kind: str                        # "layer_norm" | "rms_norm" | "l2_norm" (F.normalize's eps rule)
    form: str
    input: fx.Node                   # the value normalized (before exact upcasts)
    output: fx.Node                  # the last node of the norm (what its users read)
    nodes: tuple[fx.Node, ...]       # every node of the norm, the output included
    eps: float
    weight: fx.Node | None = None
    bias: fx.Node | None = None
    weight_offset: float = 0.0
    norm_round_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    hidden_size: int | None = None
    reason: str | None = None        # set when the norm itself cannot be fused
    anchor: fx.Node | None = None    # the node that identified it (for ordering and messages)
    group: int | None = None         # statistics per group of this many columns (Mamba2, NemotronH)
    layout: tuple[int, ...] | None = None  # a channel norm written out over dim d != last (LayerNorm2d,
    #                                  RmsNorm2d): the norm of ``input.permute(*layout)`` (d moved last), permuted back


@dataclass(frozen=True)
class AddMatch:
    node: fx.Node                    # the add
    operands: tuple[Any, Any]        # (a, b) as the graph adds them, exact upcasts stripped
    scaled: int | None = None        # index of the operand multiplied by residual_scale
    residual_scale: float = 1.0
    chain: tuple[fx.Node, ...] = ()  # pass-through nodes between the add and the norm
    permute: tuple[int, ...] | None = None  # a permute in the chain: the norm reads ``sum.permute(*permute)``
    reason: str | None = None        # why it cannot be folded into the kernel
    rounded: fx.Node | None = None   # the cast right after an fp32 add that rounds the sum (Wan): the sum's value
    broadcast: int | None = None     # index of an operand broadcast over the other's leading dims (positions)

    @property
    def total(self) -> fx.Node:
        """The node holding the sum the stream goes on with (the rounding cast after the add, if any)."""
        return self.rounded if self.rounded is not None else self.node


# --------------------------------------------------------------------------- helpers

def const_value(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def _last_dim_only(dims: Any, ndim: int | None) -> bool:
    return bool(ndim) and dim_named(dims, ndim) == ndim - 1


def _reduced_dim(dims: Any, ndim: int | None) -> int | None:
    """The one dim a reduction takes, made non-negative (None: several, none, not a constant, or no rank)."""
    return dim_named(dims, ndim) if ndim else None


def channel_layout(d: int, ndim: int) -> tuple[int, ...]:
    """The permute that moves dim d last (NCHW, d = 1: (0, 2, 3, 1))."""
    return (*range(d), *range(d + 1, ndim), d)


def upcasts(index: GraphIndex, node: Any) -> tuple[Any, list[fx.Node]]:
    """(the value before any chain of exact upcasts (casts that change no value), those casts)."""
    casts = []
    while index.prim(node) == "cast" and node not in index.norm_outputs:
        src = index.canon(node)["input"]
        if not isinstance(src, fx.Node) or not is_exact_upcast(node_dtype(src), node_dtype(node)):
            break
        casts.append(node)
        node = src
    return node, casts


def strip_upcasts(index: GraphIndex, node: Any) -> Any:
    """The value before any chain of exact upcasts (casts that change no value)."""
    return upcasts(index, node)[0]


def _same_value(index: GraphIndex, a: Any, b: Any) -> bool:
    return index.same(a, b) or index.same(strip_upcasts(index, a), strip_upcasts(index, b))


def _is_param_like(index: GraphIndex, node: Any) -> bool:
    """A tensor that does not depend on activations: a parameter, buffer or graph input."""
    node = strip_upcasts(index, node)
    return isinstance(node, fx.Node) and node.op in ("placeholder", "get_attr")


def _vector_of(node: Any, n: int | None, layout: tuple[int, ...] | None = None) -> bool:
    """A vector of n values along the normalized dim, broadcast over the others: (..., 1, n), or
    for a channel norm (``layout``) n along its dim, e.g. ``w.reshape(1, -1, 1, 1)`` / ``w[:, None, None]``."""
    shape = node_shape(node)
    if shape is None or n is None or len(shape) < 1:
        return False
    at = len(shape) - 1 if layout is None else len(shape) - (len(layout) - layout[-1])
    return at >= 0 and same_dim(shape[at], n) and all(same_dim(d, 1) for i, d in enumerate(shape) if i != at)


def _weight_vector(node: Any, n: int | None) -> bool:
    """The (n,) vector the fused op takes as the norm's weight or bias: a (1, 1, n) one stays a step after
    the norm (a scale or shift the call reads through its strides), a (1, 1, 1, n) one widens y."""
    shape = node_shape(node)
    return shape is not None and n is not None and len(shape) == 1 and same_dim(shape[0], n)


def _channel_param(index: GraphIndex, operand: Any, n: int, layout: tuple[int, ...]):
    """A channel norm's ``w.reshape(1, -1, 1, 1)`` / ``w[:, None, None]`` (exact upcasts allowed on
    the way) -> (w, the nodes between), or None."""
    if not _vector_of(operand, n, layout):
        return None
    cur, nodes = operand, []
    while isinstance(cur, fx.Node) and index.prim(cur) in ("view", "unsqueeze", "cast") \
            and not (cur.op in ("placeholder", "get_attr")):
        src = index.canon(cur)["input"]
        if index.prim(cur) == "cast" and not (isinstance(src, fx.Node)
                                              and is_exact_upcast(node_dtype(src), node_dtype(cur))):
            return None
        nodes.append(cur)
        cur = src
    if isinstance(cur, fx.Node) and cur.op in ("placeholder", "get_attr") and _vector_of(cur, n):
        return cur, nodes
    return None


def _other(c: Canon, node: Any) -> Any:
    a, b = c["input"], c["other"]
    return b if a is node else a if b is node else None


def _single_user(node: fx.Node) -> fx.Node | None:
    users = real_users(node)
    return users[0] if len(users) == 1 else None


def live_dropout_p(c: Canon | None) -> float | None:
    """p of a dropout that draws a mask: training mode and a constant 0 < p < 1 (None for any
    other node, an identity dropout, or a p the graph computes)."""
    if c is None or c.prim != "dropout" or c.multi_output or c["training"] is not True:
        return None
    p = const_value(c["p"])
    return p if p is not None and 0.0 < p < 1.0 else None


def identity_dropout(c: Canon) -> bool:
    """A dropout that passes its input through: eval mode, or p = 0."""
    return c.prim == "dropout" and (c["training"] is False or c["p"] == 0 or c["p"] == 0.0)


def is_pass_through(index: GraphIndex, node: fx.Node, n: int | None) -> bool:
    """Same values in, same values out, rows kept: casts, last-dim-keeping views, identity dropout."""
    c = index.canon(node)
    if c is None:
        return False
    if c.prim == "cast":
        return True
    if c.prim == "view":
        return n is not None and same_dim(last_dim(c["input"]), n) and same_dim(last_dim(node), n)
    return identity_dropout(c)


# --------------------------------------------------------------------------- norm calls

def _traced_value(value: Any) -> Any:
    """A size computed in the graph (``torch.Size([s0])``, ``sym_size``) as the capture saw it."""
    if isinstance(value, fx.Node):
        for key in ("example_value", "val"):
            if key in value.meta:
                return value.meta[key]
    return value


def _match_norm_call(index: GraphIndex, node: fx.Node, c: Canon) -> NormMatch | None:
    x = c["input"]
    n = last_dim(x)
    form = "aten" if isinstance(node.target, torch._ops.OpOverload) else (
        "module" if node.op == "call_module" else "functional")
    eps = c["eps"]
    if c.prim == "rms_norm" and eps is None and node_dtype(x) is not None:
        # torch.rms_norm's default: the eps of its compute (opmath) dtype, fp32 for fp16/bf16 inputs
        dt = node_dtype(x)
        eps = torch.finfo(torch.float32 if dt in (torch.float16, torch.bfloat16) else dt).eps
    output = node
    nodes = [node]
    reason = None
    if c.multi_output:
        # native_layer_norm / _fused_rms_norm return (out, stats...): only out may be used
        # (make_fx / AOT graphs keep a getitem for every output, read or not)
        dead = [u for u in node.users if not u.users and u.args[1:] != (0,)]
        getitems = [u for u in node.users if u not in dead]
        outs = [u for u in getitems if u.args[1:] == (0,)]
        if len(outs) != 1 or len(getitems) != 1:
            reason = "the norm's saved statistics (mean/rstd) are used by other nodes"
            output = outs[0] if outs else node
        else:
            output = outs[0]
        nodes = [node, *dead, output] if output is not node else [node, *dead]
    ns = _traced_value(c["normalized_shape"])
    ns = [_traced_value(d) for d in ns] if isinstance(ns, (list, tuple, torch.Size)) else [ns]
    if len(ns) != 1:
        reason = f"normalizes over {len(ns)} trailing dims {tuple(ns)}, not only the last dim"
    elif not same_dim(ns[0], n):
        reason = f"normalized_shape ({ns[0]},) is not known to equal the input's last dim {n}"
    if isinstance(eps, fx.Node):  # torch.compile(dynamic=True) keeps a module's float attributes symbolic
        reason = reason or "eps is a graph input (a symbolic float); the fused op takes a constant eps"
        eps = None
    m = NormMatch(kind=c.prim, form=form, input=x, output=output, nodes=tuple(nodes), eps=float(eps or 0.0),
                  weight=c["weight"], bias=c["bias"] if c.prim == "layer_norm" else None,
                  out_dtype=node_dtype(output), hidden_size=n, reason=reason, anchor=node)
    if reason is None and node_dtype(output) is not None and node_dtype(x) is not None \
            and node_dtype(output) != node_dtype(x) and not autocast_upcast(node):
        m = replace(m, reason=f"the norm returns {node_dtype(output)} for a {node_dtype(x)} input; the fused op "
                              "returns the input dtype, or fp32 for a 16-bit input (autocast's fp32 policy)")
    return m


def autocast_upcast(node: fx.Node) -> bool:
    """A norm call the capture recorded returning fp32 for a 16-bit input: CUDA autocast's fp32
    policy (layer_norm, rms_norm), which casts the input, weight and bias to fp32 and runs the
    norm there. Without autocast a norm returns its input's dtype, whatever its weight's, so the
    recorded dtypes alone tell it (a graph captured under an ambient autocast holds no
    ``_enter_autocast`` node). The fused op computes the same from the 16-bit sum with
    ``out_dtype=float32``: its statistics are fp32 and it upcasts the weight and bias itself."""
    if node_dtype(node) != F32:
        return False
    if node.op == "call_module":  # not canonical(): it adds get_attr nodes for the module's parameters
        owner = node.graph.owning_module
        try:
            module = owner.get_submodule(node.target) if owner is not None else None
        except AttributeError:
            module = None
        x = node.args[0] if isinstance(module, TORCH_NORMS) and node.args else None
    else:
        c = canonical(node)
        x = c["input"] if c is not None and c.prim in ("layer_norm", "rms_norm") and not c.multi_output else None
    return x is not None and node_dtype(x) in LOW_PRECISION


# --------------------------------------------------------------------------- decomposed norms

def _rstd_users(index: GraphIndex, denom_src: fx.Node):
    """From ``var + eps`` to the ways it becomes rstd. Yields (how, node, nodes): ("mul", rstd,
    its nodes) for rsqrt / 1/sqrt / pow(-0.5), ("div", sqrt / ..., its nodes) for
    ``v / sqrt(var + eps)``; ``nodes`` are the ones between ``var + eps`` and the rstd."""
    for u in denom_src.users:
        c = index.canon(u)
        if c is None:
            continue
        if c.prim == "rsqrt":
            yield "mul", u, [u]
        elif c.prim == "pow" and c["input"] is denom_src and const_value(c["exponent"]) == -0.5:
            yield "mul", u, [u]
        elif c.prim == "sqrt":
            for uu in u.users:
                cc = index.canon(uu)
                if cc is None:
                    continue
                if cc.prim == "reciprocal":
                    yield "mul", uu, [u, uu]
                elif cc.prim == "div" and cc["other"] is u and const_value(cc["input"]) == 1.0:
                    yield "mul", uu, [u, uu]
                elif cc.prim == "div" and cc["other"] is u:
                    yield "div", uu, [u]


def _rstd_forms(index: GraphIndex, denom_src: fx.Node):
    """``_rstd_users``, and each rstd that is multiplied after a cast (DeepSeek-V4's
    ``x * rsqrt(...).to(x.dtype)``): the cast is among the nodes (``_rounded_rstd`` tells whether
    it rounds)."""
    for how, r, nodes in _rstd_users(index, denom_src):
        yield how, r, nodes
        if how == "mul":
            for cast in r.users:
                if index.prim(cast) == "cast" and index.canon(cast)["input"] is r:
                    yield how, cast, [*nodes, cast]


def _rounded_rstd(index: GraphIndex, nodes) -> fx.Node | None:
    """A cast among the rstd's nodes that rounds it (to a narrower dtype), or None."""
    return next((c for c in nodes if index.prim(c) == "cast"
                 and not is_exact_upcast(node_dtype(index.canon(c)["input"]), node_dtype(c))), None)


def _eps_of(index: GraphIndex, stat: fx.Node):
    """``stat + eps`` -> (node, eps) for each such user."""
    for u in stat.users:
        c = index.canon(u)
        if c is not None and c.prim == "add" and c["alpha"] == 1:
            other = _other(c, stat)
            if const_value(other) is not None:
                yield u, const_value(other)


def _square_of(index: GraphIndex, node: Any) -> Any:
    c = index.canon(node)
    if c is None:
        return None
    if c.prim == "pow" and const_value(c["exponent"]) == 2.0:
        return c["input"]
    if c.prim == "square":
        return c["input"]
    if c.prim == "mul" and index.same(c["input"], c["other"]):
        return c["input"]
    return None


def _find_normalized(index: GraphIndex, denom: fx.Node, value: Any):
    """The node computing ``value * rstd`` (or ``value / sqrt``) from ``var + eps``."""
    for how, r, extra in _rstd_forms(index, denom):
        for u in r.users:
            c = index.canon(u)
            if c is None:
                continue
            if how == "mul" and c.prim == "mul":
                other = _other(c, r)
                if other is not None and _same_value(index, other, value):
                    return u, extra + index.duplicates(other)
            if how == "div" and c.prim == "div" and c["other"] is r and _same_value(index, c["input"], value):
                return u, extra + index.duplicates(c["input"])
        if how == "div" and _same_value(index, index.canon(r)["input"], value):
            return r, extra
    return None, None


def _finish_decomposed(index: GraphIndex, kind: str, source: Any, stat: fx.Node, value: Any,
                       stat_nodes: list[fx.Node], n: int, anchor: fx.Node,
                       layout: tuple[int, ...] | None = None) -> NormMatch | None:
    """From a row statistic (mean of squares, or variance) to ``value * rsqrt(stat + eps)``;
    ``source`` is the normalized input as the graph holds it (maybe upcast)."""
    for denom, eps in _eps_of(index, stat):
        normed, extra = _find_normalized(index, denom, value)
        if normed is not None:
            upcast = [source] if source is not strip_upcasts(index, source) else []
            m = NormMatch(kind=kind, form="decomposed", input=strip_upcasts(index, source), output=normed,
                          nodes=(*upcast, *stat_nodes, denom, *extra, normed), eps=eps, hidden_size=n, anchor=anchor,
                          layout=layout)
            if node_dtype(stat) in LOW_PRECISION:
                return replace(m, reason=(
                    f"the row statistic is computed in {node_dtype(stat)} (no upcast before the mean): the graph "
                    "rounds the mean, the rstd and the normalized value there; the kernels accumulate in fp32"))
            rounded = _rounded_rstd(index, extra)
            if rounded is not None:
                return replace(m, reason=(
                    f"the rstd is rounded to {node_dtype(rounded)} before the multiply (x * rsqrt(...).to(x.dtype)): "
                    "the kernels multiply by the fp32 rstd and round the product once"))
            return _with_tail(index, m)
    if kind == "rms_norm" and layout is None:
        # the rstd alone, multiplying another value (HY-V4's hyper-connections norm returns
        # rsqrt(mean(x^2) + eps), which scales linear(x)): no normalized row to fuse; listed
        for denom, eps in _eps_of(index, stat):
            for how, r, extra in _rstd_forms(index, denom):
                if how == "mul" and r.users:
                    return NormMatch(kind=kind, form="decomposed", input=strip_upcasts(index, source), output=r,
                                     nodes=(*stat_nodes, denom, *extra), eps=eps, hidden_size=n, anchor=anchor,
                                     reason=("the row's rstd (rsqrt(mean(x^2) + eps)) multiplies another value, not "
                                             "the row it is computed from: there is no normalized row to fuse"))
    return None


def _match_decomposed(index: GraphIndex, mean: fx.Node, c: Canon) -> NormMatch | None:
    """Anchored at ``mean(t, -1, keepdim=True)``: RMSNorm when t = u^2, LayerNorm when ``u - mean`` follows.
    A mean over another single dim d (``mean(t, dim=1, keepdim=True)`` of NCHW: timm's RmsNorm2d, SAM's
    LayerNorm2d) is a channel norm: the same norm of t with d moved last (``layout``)."""
    t = c["input"]
    shape = node_shape(t)
    d = _reduced_dim(c["dim"], None if shape is None else len(shape))
    if d is None or not c["keepdim"]:
        return None
    layout = None if d == len(shape) - 1 else channel_layout(d, len(shape))
    n = last_dim(t) if layout is None else dim_value(shape[d])
    if n is None:
        return None
    sq = _square_of(index, t)
    if sq is not None:  # RMSNorm: u * rsqrt(mean(u^2) + eps)
        return _finish_decomposed(index, "rms_norm", sq, mean, sq, [t, mean], n, mean, layout)
    # LayerNorm: d = u - mean(u); var = mean(d^2); n = d * rsqrt(var + eps)
    dim = d
    for d in mean.users:
        cd = index.canon(d)
        if cd is None or cd.prim != "sub" or not index.same(cd["other"], mean) \
                or not _same_value(index, cd["input"], t):
            continue
        for sqn in (u for u in d.users if index.same(_square_of(index, u), d)):
            for var in sqn.users:
                cv = index.canon(var)
                if cv is None or cv.prim != "mean" or _reduced_dim(cv["dim"], len(shape)) != dim or not cv["keepdim"]:
                    continue
                m = _finish_decomposed(index, "layer_norm", t, var, d, [mean, d, sqn, var], n, mean, layout)
                if m is not None:
                    return m
    return None


def _match_var_layer_norm(index: GraphIndex, var: fx.Node, c: Canon, claimed: set) -> NormMatch | None:
    """``(u - mean(u)) * rsqrt(var(u, unbiased=False) + eps)``. ``claimed``: nodes of norms found
    before; two norms of one value (parallel blocks) each have their own ``mean`` and ``u - mean``,
    equal to the other's, and each takes its own."""
    u = c["input"]
    shape = node_shape(u)
    if shape is None or not _last_dim_only(c["dim"], len(shape)) or not c["keepdim"] or c["unbiased"]:
        return None
    # mean(u) directly, or the mean item of var_mean(u) (the var's own source)
    siblings = [g for t in {var.args[0]} if isinstance(var.args[0], fx.Node) and var.target is operator.getitem
                for g in t.users]
    for mean in (x for x in [*(getattr(u, "users", None) or ()), *siblings]
                 if index.prim(x) == "mean" and index.canon(x)["input"] is u and x not in claimed):
        cm = index.canon(mean)
        if not _last_dim_only(cm["dim"], len(shape)) or not cm["keepdim"]:
            continue
        for d in mean.users:
            cd = index.canon(d)
            if cd is None or cd.prim != "sub" or not index.same(cd["other"], mean) or d in claimed:
                continue
            m = _finish_decomposed(index, "layer_norm", u, var, d, [mean, d, var], last_dim(u), var)
            if m is not None:
                return m
    return None


def _match_normalize(index: GraphIndex, node: fx.Node, c: Canon) -> NormMatch | None:
    """``F.normalize(x, dim=-1) * sqrt(d)`` (p = 2), then a weight: an RMSNorm whose eps clamps the
    row's L2 norm, ``x / max(||x||_2, eps) * sqrt(d)`` (x-transformers' RMSNorm, ScaleNorm,
    SimpleRMSNorm): the ``l2_norm`` kind, computed in fp32 (x upcast or fp32); the weight and the
    casts after it are read as after any norm call."""
    x = c["input"]
    shape = node_shape(x)
    if shape is None or const_value(c["p"]) != 2.0 or _reduced_dim(c["dim"], len(shape)) != len(shape) - 1:
        return None
    eps = const_value(c["eps"])
    # an RMSNorm scales the unit row by sqrt(d); a bare L2 normalization (cosine attention's
    # q and k: Swin v2, EdgeNeXt, x-transformers' qk_norm) is not a norm of the residual stream
    scale = _single_user(node)
    cs = index.canon(scale) if scale is not None else None
    n = last_dim(x)
    k = None if cs is None or cs.prim != "mul" else const_value(_other(cs, node))
    if not isinstance(n, int) or k is None or abs(k - n ** 0.5) > 1e-6 * n ** 0.5:
        return None
    m = NormMatch(kind="l2_norm", form="normalize", input=strip_upcasts(index, x), output=scale,
                  nodes=(*([x] if x is not strip_upcasts(index, x) else []), node, scale), eps=eps or 0.0,
                  hidden_size=n, anchor=node, out_dtype=node_dtype(scale))
    if eps is None:  # a graph input (a symbolic float)
        return replace(m, reason="F.normalize's eps is not a number known when the graph is captured")
    if node_dtype(x) in LOW_PRECISION:
        return replace(m, reason=(
            f"F.normalize computes the row's L2 norm in {node_dtype(x)} (no upcast before it): the graph rounds "
            "the norm and the quotient there; the kernels accumulate in fp32"))
    if k != n ** 0.5:
        return replace(m, reason=f"the unit row is scaled by {k!r}, not by sqrt({n}) = {n ** 0.5!r}, the l2_norm "
                                 "kind's scale")
    return _with_tail(index, m, call=True)


# --------------------------------------------------------------------------- the tail

def _weight_operand(index: GraphIndex, operand: Any, n: int, layout: tuple[int, ...] | None = None):
    """``w``, ``w.float()`` or ``offset + w`` (in fp32) -> (w, offset, nodes) or None; a channel
    norm's (``layout``): ``w.reshape(1, -1, 1, 1)``, ``w[:, None, None]``."""
    if layout is not None:
        found = _channel_param(index, operand, n, layout)
        return None if found is None else (found[0], 0.0, found[1])
    if _is_param_like(index, operand) and _weight_vector(operand, n):
        nodes = []
        cur = operand
        while cur is not strip_upcasts(index, cur) and index.prim(cur) == "cast":
            nodes.append(cur)
            cur = index.canon(cur)["input"]
        return strip_upcasts(index, operand), 0.0, nodes
    c = index.canon(operand)
    if c is not None and c.prim == "add" and c["alpha"] == 1 and _weight_vector(operand, n):
        a, b = c["input"], c["other"]
        off, w = (const_value(a), b) if const_value(a) is not None else (const_value(b), a)
        # w + 0.0 is w in any dtype (x-transformers' ``gamma + float(unit_offset)``); another offset in fp32
        if off is not None and _is_param_like(index, w) and (node_dtype(operand) == F32 or off == 0.0):
            inner = [x for x in [w] if index.prim(x) == "cast"]
            return strip_upcasts(index, w), off, [operand, *inner]
    return None


def _ungrouped(index: GraphIndex, m: NormMatch) -> NormMatch:
    """A norm over ``x.view(..., N // G, G)`` whose result is viewed back to (..., N) (Mamba2's
    and NemotronH's grouped RMSNorm): the same norm over the rows of x, with statistics per group
    of G columns (``group``); the tail (weight, casts) is then read after the view back."""
    split = m.input
    c = index.canon(split) if isinstance(split, fx.Node) else None
    merge = _single_user(m.output)
    if c is None or c.prim != "view" or merge is None or index.prim(merge) != "view" or m.weight is not None:
        return m
    source = c["input"]
    rows, grouped, merged = node_shape(source), node_shape(split), node_shape(merge)
    if not (isinstance(source, fx.Node) and rows and grouped and merged and len(grouped) == len(rows) + 1
            and same_shape(merged, rows) and same_shape(grouped[:-2], rows[:-1])):
        return m
    width, group = dim_value(rows[-1]), dim_value(grouped[-1])
    if not isinstance(width, int) or not isinstance(group, int) or group >= width or width % group \
            or not same_dim(grouped[-2], width // group) or any(u not in m.nodes for u in real_users(split)):
        return m
    return replace(m, input=source, output=merge, hidden_size=width, group=group,
                   nodes=(split, *m.nodes, merge))


def _with_tail(index: GraphIndex, m: NormMatch, call: bool = False) -> NormMatch:
    """Extend a matched normalization ``n`` with casts, ``* weight`` and ``+ bias`` while the
    fused op can reproduce every rounding point; stop before the first step it cannot.

    The op computes ``round(out, [round(r, n)] * (w + offset) + b)``: at most one rounding
    of n before the weight (Llama) and one rounding at the end (Gemma, F.layer_norm).
    ``call``: ``m`` is a norm call without weight and bias (``nn.LayerNorm(d,
    elementwise_affine=False)``, then ``* gamma``: x-transformers' LayerNorm); its output is n
    rounded to the call's dtype, and its form stays the call's.
    """
    m = _ungrouped(index, m) if m.layout is None and not call else m
    n = m.hidden_size
    cur = m.output
    cur_dtype = node_dtype(cur) or F32
    phase = "n"                 # "n": before the weight, "w": after it
    round_dtype = cur_dtype if call and cur_dtype in LOW_PRECISION else None  # where n was rounded before the weight
    weight = bias = None
    offset = 0.0
    extra: list[fx.Node] = []
    best = (cur, None, None, 0.0, None, cur_dtype, [])  # the last state the op can reproduce
    while True:
        user = _single_user(cur)
        c = index.canon(user) if user is not None else None
        if c is None:
            break
        dt = node_dtype(user) or cur_dtype
        added = [user]
        if c.prim == "cast":
            if dt == cur_dtype:
                pass                                  # identity cast
            elif phase == "n" and round_dtype is None and cur_dtype == F32 and dt.itemsize < 4:
                round_dtype = dt                      # n rounded (before a weight, or as the output)
            elif phase == "n" and round_dtype is not None and cur_dtype == round_dtype and dt == F32:
                pass                                  # exact upcast of the rounded n
            elif phase == "w" and cur_dtype == F32 and dt.itemsize < 4:
                phase = "out"                         # the one rounding of "multiply then round"
            else:
                break
        elif c.prim == "mul" and phase == "n":
            wm = _weight_operand(index, _other(c, cur), n, m.layout)
            if wm is None:
                break
            weight, offset, wnodes = wm
            added += wnodes
            phase = "w"
        elif c.prim == "add" and c["alpha"] == 1 and phase in ("n", "w") and bias is None \
                and m.kind == "layer_norm" and cur_dtype == F32:
            other = _other(c, cur)
            if m.layout is not None:
                channel_bias = None if other is None else _channel_param(index, other, n, m.layout)
                if channel_bias is None:
                    break
                other = channel_bias[0]
                added += channel_bias[1]
            elif call or other is None or not _is_param_like(index, other) or not _weight_vector(other, n):
                # (after a norm call: eager's layer_norm with a bias rounds its affine step otherwise than
                # a separate ``+ b``, which stays a step after the norm: a shift)
                break
            bias = strip_upcasts(index, other)
            phase = "w"
        else:
            break
        cur, cur_dtype = user, dt
        extra += added
        if phase != "n":
            best = (cur, weight, bias, offset, round_dtype, cur_dtype, list(extra))
        elif round_dtype is None or cur_dtype == round_dtype:
            # no weight: a rounded n is "multiply by 1, then round once"
            best = (cur, None, None, 0.0, None, cur_dtype, list(extra))
    out, weight, bias, offset, round_dtype, out_dtype, extra = best
    if call:
        return m if weight is None and bias is None else replace(
            m, output=out, weight=weight, bias=bias, weight_offset=offset, norm_round_dtype=round_dtype,
            out_dtype=out_dtype, nodes=m.nodes + tuple(x for x in extra if x not in m.nodes))
    if m.kind == "layer_norm":
        style = "layer_norm"
    elif round_dtype is not None:
        style = "llama"                       # round n to the input dtype, then * weight
    elif offset:
        style = "gemma"                       # * (1 + w) in fp32, round once
    else:
        style = "rms_norm"
    return replace(m, output=out, weight=weight, bias=bias, weight_offset=offset, norm_round_dtype=round_dtype,
                   out_dtype=out_dtype, nodes=m.nodes + tuple(x for x in extra if x not in m.nodes),
                   form=f"decomposed:{style}")


# --------------------------------------------------------------------------- all norms

def find_norms(index: GraphIndex) -> list[NormMatch]:
    found: list[NormMatch] = []
    claimed: set[fx.Node] = set()
    for node in index.graph.nodes:
        if node in claimed:
            continue
        c = index.canon(node)
        if c is None:
            continue
        m = None
        if c.prim in ("layer_norm", "rms_norm"):
            m = _match_norm_call(index, node, c)
            if m.reason is None and m.weight is None and m.bias is None:
                m = _with_tail(index, m, call=True)  # a norm without affine, then its weight
        elif c.prim == "mean":
            m = _match_decomposed(index, node, c)
        elif c.prim == "var":
            m = _match_var_layer_norm(index, node, c, claimed)
        elif c.prim == "normalize":
            m = _match_normalize(index, node, c)
        if m is None or any(x in claimed for x in m.nodes):
            continue
        if m.reason is None and m.weight is not None and not _weight_vector(m.weight, m.hidden_size):
            m = replace(m, reason=f"weight of shape {node_shape(m.weight)} is not a vector of the hidden size "
                                  f"{m.hidden_size}")
        if m.reason is None and m.bias is not None and not _weight_vector(m.bias, m.hidden_size):
            m = replace(m, reason=f"bias of shape {node_shape(m.bias)} is not a vector of the hidden size "
                                  f"{m.hidden_size}")
        claimed.update(m.nodes)
        found.append(m)
        index.norm_outputs.add(m.output)
    found.sort(key=lambda m: index.order[m.output])
    return found


def find_elementwise_norms(index: GraphIndex) -> list[fx.Node]:
    """The elementwise replacements of a norm: DynamicTanh (``tanh(alpha * x) * w + b``, "Transformers
    without Normalization") and Derf (``erf(alpha * x + s) * w + b``), a learned scalar ``alpha`` and a
    vector weight. Not
    sites: with no row statistic the add before one and the function itself are one elementwise
    pass, which Inductor fuses; the report lists them (``elementwise_norm_note``)."""
    found = []
    for node in index.graph.nodes:
        c = index.canon(node)
        if c is None or c.prim not in ("tanh", "erf"):
            continue
        scaled = index.canon(c["input"])
        if scaled is not None and scaled.prim == "add" and any(_is_scalar(o) for o in (scaled["input"], scaled["other"])):
            scaled = index.canon(_other(scaled, next(o for o in (scaled["input"], scaled["other"]) if _is_scalar(o))))
        weighted = _single_user(node)
        cw = index.canon(weighted) if weighted is not None else None
        if scaled is None or scaled.prim != "mul" or cw is None or cw.prim != "mul":
            continue
        n = last_dim(node)
        if any(_is_scalar(o) for o in (scaled["input"], scaled["other"])) and _vector_of(_other(cw, node), n):
            found.append(node)
    return found


def _is_scalar(value: Any) -> bool:
    shape = node_shape(value) if isinstance(value, fx.Node) else None
    return shape is not None and all(d == 1 for d in shape)


# --------------------------------------------------------------------------- adds next to a norm

def as_add(index: GraphIndex, node: Any, n: int | None) -> AddMatch | None:
    c = index.canon(node)
    if c is None or c.prim != "add":
        return None
    a, b = c["input"], c["other"]
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    sa, sb = node_shape(a), node_shape(b)
    if sa is None or sb is None:
        return None
    if not same_shape(sa, sb):
        table = _broadcast_operand(sa, sb, node_shape(node))
        if table is None or c["alpha"] != 1:
            why = "over other dims than the leading ones" if table is None else f"with alpha={c['alpha']}"
            return AddMatch(node=node, operands=(a, b), reason=f"the add broadcasts ({tuple(sa)} + {tuple(sb)}) {why}")
        ops = tuple(strip_upcasts(index, o) for o in (a, b))
        dts = [node_dtype(o) for o in ops]
        reason = f"operand dtypes {dts} are not ones the kernels take" if any(d not in KERNEL_DTYPES for d in dts) \
            else None
        return AddMatch(node=node, operands=ops, broadcast=table, reason=reason)
    if c["alpha"] != 1:
        return AddMatch(node=node, operands=(a, b),
                        reason=f"torch.add with alpha={c['alpha']} (scaled operand inside the add)")
    ops, scaled, residual_scale = [], None, 1.0
    for i, op in enumerate((a, b)):
        co = index.canon(op)
        if co is not None and co.prim == "mul" and scaled is None and len(op.users) == 1:
            k = const_value(co["other"]) if const_value(co["other"]) is not None else const_value(co["input"])
            inner = co["input"] if const_value(co["other"]) is not None else co["other"]
            if k is not None and isinstance(inner, fx.Node) and same_shape(node_shape(inner), sa) and \
                    node_dtype(inner) == node_dtype(op):
                scaled, residual_scale = i, k
                ops.append(inner)
                continue
        ops.append(strip_upcasts(index, op))
    dts = [node_dtype(o) for o in ops]
    reason = f"operand dtypes {dts} are not ones the kernels take" if any(d not in KERNEL_DTYPES for d in dts) else None
    return AddMatch(node=node, operands=tuple(ops), scaled=scaled, residual_scale=residual_scale, reason=reason)


def _broadcast_operand(sa: tuple, sb: tuple, out: tuple | None) -> int | None:
    """The index of the operand that broadcasts over the other's leading dims only (a (S, C) or
    (1, S, C) table of learned positions added to (B, S, C)): the kernel reads its rows again every
    table's length of rows. None for any other broadcast."""
    for i, (small, big) in enumerate(((sa, sb), (sb, sa))):
        if len(small) > len(big) or out is None or not same_shape(out, big):
            continue
        padded = (1,) * (len(big) - len(small)) + tuple(small)
        k = next((j for j, d in enumerate(padded) if not same_dim(d, 1)), len(padded) - 1)
        if k > 0 and all(same_dim(padded[j], big[j]) for j in range(k, len(big))):
            return i
    return None


def permute_dims(index: GraphIndex, node: Any) -> tuple[int, ...] | None:
    """The dims of a permute node, made non-negative; None when they are not constants."""
    dims = index.canon(node)["dims"] if index.prim(node) == "permute" else None
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(d % len(dims) for d in dims)


def _is_contiguous(shape: tuple, strides: tuple) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(shape, strides))):
        if not same_dim(size, 1) and not same_dim(stride, expected):
            return False
        expected = expected * size
    return True


def _channels_first(shape: tuple, strides: tuple) -> bool:
    """A permuted view whose last dim (the channels) is strided and whose other dims are stored
    channels-first (an NCHW tensor read as NHWC): the channel-norm kernels' layout."""
    return any(_is_contiguous((*shape[:j], shape[-1], *shape[j:-1]), (*strides[:j], strides[-1], *strides[j:-1]))
               for j in range(len(shape) - 1))


def permuted_layout(value: Any, dims: tuple[int, ...]) -> tuple | None:
    """The layout the kernels read ``value.permute(*dims)`` in, from its tensor metadata: ("rows",)
    (rows contiguous: an NCHW tensor in channels_last format), ("channels-first", strides) (the
    channels strided, the positions contiguous: a contiguous NCHW tensor), or None (neither, or
    no metadata)."""
    t = tensor_meta(value)
    if not isinstance(t, torch.Tensor) or t.dim() != len(dims):
        return None
    shape = tuple(dim_value(t.shape[d]) for d in dims)
    strides = tuple(dim_value(t.stride(d)) for d in dims)
    if _is_contiguous(shape, strides):
        return ("rows",)
    if _channels_first(shape, strides):  # (a size-1 dim's stride is arbitrary)
        return ("channels-first", tuple(0 if same_dim(n, 1) else st for n, st in zip(shape, strides)))
    return None


def permuted_layout_reason(am: AddMatch, dims: tuple[int, ...]) -> str | None:
    """Why the kernels cannot read the add's operands, permuted by ``dims``, without a copy, or
    cannot hand the sum back in the layout the add gave it (None when they can). The fused call
    returns the sum in its residual's layout; the residual is the operand stored as the sum is
    (eager's add takes the first operand's layout), the scaled one when there is one."""
    layouts = []
    for op in am.operands:
        t = tensor_meta(op)
        if not isinstance(t, torch.Tensor) or t.dim() != len(dims):
            return (f"the layout of {getattr(op, 'name', op)} is unknown (no tensor metadata), so the permuted "
                    "normalized dim is not known to be contiguous")
        layout = permuted_layout(op, dims)
        if layout is None:
            return (f"the normalized dim is neither contiguous nor stored channels-first: the norm reads "
                    f"{op.name}.permute{dims} (shape {tuple(map(dim_value, t.shape))}, strides "
                    f"{tuple(map(dim_value, t.stride()))}); the kernels read contiguous rows or NCHW-style "
                    "channels (.contiguous() or .to(memory_format=torch.channels_last) make it one of them)")
        layouts.append(layout)
    total = permuted_layout(am.node, dims)
    candidates = layouts if am.scaled is None else [layouts[am.scaled]]
    if total is None or total not in candidates:
        return (f"the add returns its sum in another layout ({total}) than the operand the fused call would "
                f"take it from ({', '.join(str(lay) for lay in candidates)})")
    return None


def find_input_add(index: GraphIndex, m: NormMatch) -> AddMatch | None:
    """The add whose sum the norm reads, seen through pass-through nodes and at most one
    permute (an add commutes with permuting both operands: the channel norms of vision models)."""
    chain = []
    cur = m.input
    permute = m.layout  # a channel norm written out reads its input with the channels moved last
    n = m.hidden_size if permute is None else None
    while isinstance(cur, fx.Node) and cur not in index.norm_outputs:
        am = as_add(index, cur, n)
        if am is not None:
            reason = am.reason
            if reason is None and permute is not None:
                if any(index.prim(p) == "view" for p in chain):
                    reason = "a reshape and a permute both sit between the residual add and the norm"
                else:
                    reason = permuted_layout_reason(am, permute)
            rounded = _rounding_of_sum(am.node, chain)
            if reason is None:
                for p in chain:
                    if p is rounded:
                        continue
                    if index.prim(p) == "cast" and not is_exact_upcast(node_dtype(p.args[0]) if p.args else None,
                                                                        node_dtype(p)):
                        reason = "a rounding cast sits between the residual add and the norm"
                    elif index.prim(p) == "dropout" and not identity_dropout(index.canon(p)):
                        reason = "live dropout (training mode) sits between the residual add and the norm"
            return replace(am, chain=tuple(chain), permute=permute if am.reason is None else None, reason=reason,
                           rounded=rounded if reason is None else None)
        c = index.canon(cur)
        if c is not None and c.prim == "permute" and permute_dims(index, cur) is not None:
            # the norm reads cur.permute(permute) = input.permute(dims).permute(permute)
            dims = permute_dims(index, cur)
            permute = dims if permute is None else tuple(dims[p] for p in permute)
            if permute == tuple(range(len(permute))):  # inverse permutes cancel (vitdet's block boundary)
                permute, n = None, m.hidden_size
            else:
                n = None  # above the permute the rows are not in the last dim: views do not pass
        else:
            live_dropout = c is not None and c.prim == "dropout" and (n is None or same_dim(last_dim(cur), n))
            if not is_pass_through(index, cur, n) and not live_dropout:
                return _stream_collapse(index, cur, chain) or _add_behind_reshape(index, cur, chain)
        chain.append(cur)
        cur = index.canon(cur)["input"]
    return None


def _rounding_of_sum(add: fx.Node, chain: list) -> fx.Node | None:
    """The cast right after an fp32 add, its one reader, that rounds the sum to 16 bits (Wan:
    ``(h.float() + out * g).type_as(h)``): the kernel forms the sum in fp32 and rounds it to its
    sum dtype, the same two roundings. None otherwise."""
    cast = chain[-1] if chain else None
    if cast is None or canonical(cast) is None or canonical(cast).prim != "cast" or real_users(add) != [cast]:
        return None
    return cast if node_dtype(add) == torch.float32 and node_dtype(cast) in LOW_PRECISION else None


def _stream_collapse(index: GraphIndex, node: fx.Node, chain: list) -> AddMatch | None:
    """A weighted sum of residual streams over the dim before the rows (hyper-connections
    collapse N streams (B, S, N, D) into a block's input): the add of N terms the norm reads,
    found so that the report says why it stays outside the kernel; None for any other node.
    Written as a product summed (``(pre.unsqueeze(-1) * streams).sum(dim=2)``, DeepSeek-V4) or
    as an einsum that contracts the stream dim (``einsum('... s t, ... s d -> ... t d', alpha,
    streams)[..., 0, :]``, x-transformers)."""
    found = _weighted_stream_sum(index, node) or _stream_einsum(index, node)
    if found is None:
        return None
    streams, spelling = found
    # the streams go on past the collapse (a residual stream); a weighted sum of values read
    # nowhere else (a mixture of experts' combine, a weighted sum of layers) is no residual add
    if not isinstance(streams, fx.Node) or len(streams.users) < 2:
        return None
    return AddMatch(node=node, operands=(streams,), chain=tuple(chain), reason=(
        f"the norm reads a weighted sum of {dim_value(node_shape(streams)[-2])} residual streams (hyper-connections: "
        f"{spelling}); the kernels add two or three operands of one shape, not a reduction over a stream dim"))


def _weighted_stream_sum(index: GraphIndex, node: fx.Node) -> tuple[Any, str] | None:
    c = index.canon(node)
    if c is None or c.prim != "sum" or c["keepdim"] or not isinstance(c["input"], fx.Node):
        return None
    product = index.canon(c["input"])
    shape = node_shape(c["input"])
    dim = _reduced_dim(c["dim"], len(shape) if shape is not None else None)
    # the streams sit right before the rows, (..., N, D), and a weight per stream broadcasts along D
    if product is None or product.prim != "mul" or dim is None or dim != len(shape) - 2:
        return None
    weights = [op for op in (product["input"], product["other"])
               if isinstance(op, fx.Node) and (node_shape(op) or (None,))[-1:] == (1,)]
    if not weights:
        return None
    streams = product["other"] if weights[0] is product["input"] else product["input"]
    return streams, f"(weights * streams).sum(dim={dim})"


def _stream_einsum(index: GraphIndex, node: fx.Node) -> tuple[Any, str] | None:
    """``einsum(eq, weights, streams)`` whose streams operand ends in (stream, row) and whose
    output keeps the row but not the stream letter, read directly or with one index taken on
    the dim before the rows (``[..., 0, :]``: one of several mixes)."""
    items = node.args[1] if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
        else None
    if items is not None:
        items = items if isinstance(items, tuple) else (items,)
        if not (len(items) == 3 and items[0] is Ellipsis and isinstance(items[1], int) and items[2] == slice(None)):
            return None
        node = node.args[0]
    c = index.canon(node) if isinstance(node, fx.Node) else None
    if c is None or c.prim != "einsum":
        return None
    equation, operands = c["equation"], c["operands"]
    if not isinstance(equation, str) or "->" not in equation or len(operands) != 2:
        return None
    inputs, output = equation.replace(" ", "").split("->")
    subscripts = inputs.split(",")
    if len(subscripts) != 2 or not output:
        return None
    for streams, letters in zip(operands, subscripts):
        if len(letters) >= 2 and letters[-1] == output[-1] and letters[-2] not in output:
            return streams, f"einsum('{equation}')"
    return None


def _add_behind_reshape(index: GraphIndex, node: fx.Node, chain: list) -> AddMatch | None:
    """An add the norm reads through a view that moves the rows (it splits or merges the last
    dim: a per-head norm of ``(a + b).view(..., heads, head_dim)``) or a permute the kernels do
    not follow: found, so the report says why it stays outside the kernel; None when there is
    no add behind it."""
    what = index.prim(node)
    cur, moved = node, False
    while isinstance(cur, fx.Node) and cur not in index.norm_outputs and index.prim(cur) in ("view", "permute",
                                                                                            "cast", "dropout"):
        moved = moved or _moves_last_dim(index, cur)
        cur = index.canon(cur)["input"]
    am = as_add(index, cur, None) if isinstance(cur, fx.Node) else None
    if am is None:
        return None
    if moved:
        reason = (f"the add reaches the norm through a view that moves the normalized dim ({_shape_text(cur)} -> "
                  f"{_shape_text(node)}): the kernels normalize rows of the add's own last dim")
    elif what in ("view", "permute"):  # Latte's (B*F, S, C) -> (B*S, F, C): the same rows in another order
        reason = (f"the add reaches the norm through views and permutes that reorder its rows ({_shape_text(cur)} -> "
                  f"{_shape_text(node)}): the call would read and write the sum in the norm's order of rows")
    else:
        reason = f"the add reaches the norm through {what} {node.name}, which the kernels do not read through"
    return AddMatch(node=am.node, operands=am.operands, chain=tuple(chain), reason=am.reason or reason)


def _moves_last_dim(index: GraphIndex, node: fx.Node) -> bool:
    """Whether a view or permute changes what the last dim holds (its size, or which dim it is)."""
    c = index.canon(node)
    if c.prim == "permute":
        return not _last_dim_only(c["dims"][-1:], len(node_shape(node) or ()))
    return c.prim == "view" and not same_dim(last_dim(node), last_dim(c["input"]))


def _shape_text(node: Any) -> str:
    shape = node_shape(node)
    return str(tuple(dim_value(d) for d in shape)) if shape is not None else "?"


def find_output_add(index: GraphIndex, m: NormMatch) -> tuple[AddMatch, list[fx.Node]] | None:
    """The add the norm's output goes into directly (through identity dropout or views): one the
    kernel could fold if there is one, else one it cannot (with its reason, for the report)."""
    frontier = [(m.output, [])]
    n = m.hidden_size
    refused = None
    while frontier:
        node, chain = frontier.pop()
        for u in node.users:
            am = as_add(index, u, n)
            if am is not None and am.reason is None:
                return am, chain
            if am is not None and refused is None:
                refused = am, chain
            if is_pass_through(index, u, n) and index.prim(u) != "cast":
                frontier.append((u, chain + [u]))
    return refused
