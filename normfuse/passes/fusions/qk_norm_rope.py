"""The rotary embedding after a q/k norm, a fusion: QK-norm + RoPE as one ``qk_norm_rope`` call.

Qwen3, Gemma 3, OLMo 2 and GLM-4 MoE (``use_qk_norm``) normalize q and k and rotate them right
after, as HF writes it (``apply_rotary_pos_emb``)::

    q = q_norm(q_proj(x).view(B, S, H, D)).transpose(1, 2)        # OLMo 2: the norm over H * D, then the view
    q_embed = q * cos.unsqueeze(1) + cat((-q[..., D/2:], q[..., :D/2]), -1) * sin.unsqueeze(1)
    GLM (partial rotary): q_rot, q_pass = q[..., :R], q[..., R:]; the same on q_rot; cat((q_embed, q_pass), -1)
    OLMo 2: cos, sin stay fp32, so the products are fp32, then ``q_embed.to(q_type)``

torchtitan (``models/common/rope.py``) rotates q (B, S, H, D) untransposed, upcast, and casts back::

    q_f = q_norm(q).float()
    CosSinRoPE:  q_f * cos + cat((-q_f2, q_f1), -1) * sin     cos, sin: 4-d slices of a (1 | B, S, 1, 2D) cache
    ComplexRoPE: view_as_real(view_as_complex(q_f.reshape(B, S, H, D/2, 2)) * freqs_cis).flatten(3)
                 (the pair rotation in fp32: layout "gptj"; the call reads freqs_cis.real and .imag)
    then ``.type_as(q)``, a cast that reads q's dtype, not its values

GPT-J's pairs written out: ``q * cos + stack((-q[..., 1::2], q[..., ::2]), -1).flatten(-2) * sin``, full
tables (layout "gptj").

Diffusers (layout "gptj"): Flux's and HunyuanVideo's ``x.reshape(..., -1, 2).unbind(-1)``,
``stack([-imag, real], -1).flatten(3)``, ``(x.float() * cos + rotated.float() * sin).to(x.dtype)``;
LTX-Video's on the whole (B, S, N) row after a norm over it, one angle per column (one head of N);
Wan's norm over all heads, the view to heads, then the pairs' products stored interleaved::

    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(x); out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]; out.type_as(x)      (half tables)

and the complex product with a freqs_cis of fewer dims that broadcasts (Qwen-Image's (S, 1, D / 2)).

``qk_norm_rope`` (``normfuse.kernels.qk_rope``: its docstring is the semantics) computes the norm
and the rotation with the graph's dtypes: the norm's rounding modes are the norm match's, the
rotation's dtype (``rope_dtype``) is what the graph's ``y * cos`` computed in, ``out_dtype`` the
dtype of the value the call replaces (a cast after the sum included).

``find`` reads, from the norm's output, a view to heads (a norm over the whole row), the
transpose to (B, H, S, D), an exact upcast (torchtitan), and one of the RoPEs above on the
canonical view; every value on the way is read by the next step only, or the site keeps its
RoPE with a reason. Batch and sequence sizes may be symbolic; heads and head_dim may not. The
norm is an RMSNorm or a LayerNorm (CogVideoX's and CogView4's q/k LayerNorms, with their biases).
A RoPE after a norm the call does not compute (an L2 norm) or after q is multiplied by a number
(MuseGlimmer's ``qk_scale_factor``) is found and kept, with the reason. ``offer`` takes the k
norm of the same attention (the same cos and sin, the same modes) as the call's second site;
the call replaces both RoPE outputs. A q whose k is not found is fused alone.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from normfuse.kernels.qk_rope import KINDS as QK_KINDS, qk_norm_rope
from normfuse.kernels.specs import OP_OUTPUTS
from normfuse.passes.canonical import (canonical, is_exact_upcast, is_split_piece, node_dtype, node_shape, real_users,
                                       one_dim, same_dim, same_shape, strided_store, tensor_meta, unbound_dim)
from normfuse.passes.graph import copy_meta, module_paths
from normfuse.passes.fusions.base import Fusion
from normfuse.passes.step import BuiltCall, PlanContext
from normfuse.vocabulary import KERNEL_DTYPES

__all__ = ["QK_NORM_ROPE", "RopeMatch"]

QK_NORM_ROPE_OUTPUTS = OP_OUTPUTS["qk_norm_rope_fwd"][:2]  # (q_out, k_out): what a call returns


@dataclass(frozen=True)
class RopeMatch:
    """The RoPE found after one q/k norm (``reason`` set: found, but the call cannot take it)."""

    nodes: tuple[fx.Node, ...] = ()   # the nodes after the norm the call replaces (views, transpose, RoPE)
    output: fx.Node | None = None     # the node whose value the call's output replaces
    cos: fx.Node | None = None        # the tables as the kernel reads them: (1 | B, S, R) or (1 | B, 1 | S, 1, R)
    sin: fx.Node | None = None        # (complex form: cos and sin are freqs_cis, the call reads .real / .imag)
    layout: str = "neox"
    rotary_dim: int = 0
    head_dim: int = 0
    heads_shape: tuple[int, ...] = ()  # (B, S, H, D): q as the kernel reads it
    operand: fx.Node | None = None    # what the kernel reads as q when not the norm's input (Gemma 3's
    #                                   norm reads q transposed: the kernel reads it before the transpose)
    norm_width: str = "head"          # "row": the norm is over H * D (OLMo 2, Wan); a 3-d q (B, S, H * D) is
    #                                   reshaped to heads for the kernel (LTX-Video's row: one head)
    transpose_out: bool = False       # the RoPE reads q transposed to (B, H, S, D)
    rope_dtype: torch.dtype | None = None
    out_dtype: torch.dtype | None = None
    reason: str | None = None
    complex_table: bool = False       # cos / sin are one complex freqs_cis broadcasting as (1 | B, 1 | S, 1, D / 2)

    def describe(self) -> str:
        return f"{self.layout}, rotary {self.rotary_dim} of {self.head_dim}"


@dataclass(frozen=True)
class QkPair:
    """What one call takes: the q site's norm and RoPE, and the k site's (None: q alone)."""

    q_norm: object
    q: RopeMatch
    k_norm: object | None = None
    k: RopeMatch | None = None


# --------------------------------------------------------------------------- find

def _last(dims, ndim: int | None) -> bool:
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return len(dims) == 1 and ndim is not None and dims[0] in (-1, ndim - 1)


def _other(index, node: fx.Node, value: fx.Node):
    """The operand of the mul ``node`` that is not ``value`` (None when it is not such a mul)."""
    c = index.canon(node)
    if c is None or c.prim != "mul":
        return None
    a, b = c["input"], c["other"]
    return b if a is value else a if b is value else None


def _slice_of(index, node: fx.Node, value: fx.Node, width: int):
    """(start, end) of ``value[..., start:end]`` over the last dim, bounds resolved; None otherwise."""
    c = index.canon(node)
    if c is None or c.prim != "slice" or c["input"] is not value or c["step"] not in (1, None):
        return None
    if not _last(c["dim"], len(node_shape(value) or ())):
        return None
    start, end = c["start"], c["end"]
    if not all(b is None or isinstance(b, int) for b in (start, end)):
        return None
    start = 0 if start is None else start + width if start < 0 else start
    end = width if end is None else end + width if end < 0 else min(end, width)
    return start, end


def _readers(node: fx.Node) -> list[fx.Node]:
    """The users that read the values of ``node``: not a cast that takes only its dtype
    (torchtitan's ``rotated.type_as(query)`` reads query's dtype, not query)."""
    users = []
    for u in real_users(node):
        c = canonical(u)
        if c is None or c.prim != "cast" or c["input"] is node:
            users.append(u)
    return users


def _single_user(node: fx.Node) -> fx.Node | None:
    users = _readers(node)
    return users[0] if len(users) == 1 else None


def _sum_with_rotated(index, a: fx.Node, rotated: fx.Node):
    """(o, s, b) of the RoPE's sum ``o = a + b``, ``b = rotated * s``, with ``a = r * c``; None
    when the readers of ``rotated`` and ``a`` are not that."""
    b = _single_user(rotated)
    s = _other(index, b, rotated) if b is not None else None
    if s is None:
        return None
    o = _single_user(a)
    co = index.canon(o) if o is not None else None
    if co is None or co.prim != "add" or co["alpha"] != 1 or {co["input"], co["other"]} != {a, b}:
        return None
    return o, s, b


def _rotate_half(index, r: fx.Node, width: int):
    """``r * c + cat((-r2, r1), -1) * s`` on ``r`` of last dim ``width``: (sum, c, s, nodes), or
    None when r's readers are not that; a str when they are, but something else reads a step."""
    users = _readers(r)
    half = width // 2
    muls = [(u, _other(index, u, r)) for u in users if _other(index, u, r) is not None]
    halves = {_slice_of(index, u, r, width): u for u in users if index.prim(u) == "slice"}
    if width % 2 or len(muls) != 1 or set(halves) != {(0, half), (half, width)}:
        return None
    a, c = muls[0]
    x1, x2 = halves[(0, half)], halves[(half, width)]
    neg = _single_user(x2)
    if neg is None or index.prim(neg) != "neg" or index.canon(neg)["input"] is not x2:
        return None
    cat = _single_user(neg)
    cc = index.canon(cat) if cat is not None else None
    if cc is None or cc.prim != "cat" or list(cc["tensors"]) != [neg, x1] \
            or not _last(cc["dim"], len(node_shape(cat) or ())):
        return None
    summed = _sum_with_rotated(index, a, cat)
    if summed is None:
        return None
    o, s, b = summed
    if len(users) != 3 or _readers(x1) != [cat] or _readers(b) != [o]:
        return "the normalized q/k is read outside its RoPE"
    return o, c, s, [a, x1, x2, neg, cat, b, o]


def _every_other(index, node: fx.Node, value: fx.Node, width: int):
    """The first column of ``value[..., a::2]`` over the last dim (0 or 1); None otherwise."""
    c = index.canon(node)
    if c is None or c.prim != "slice" or c["input"] is not value or c["step"] != 2:
        return None
    if not _last(c["dim"], len(node_shape(value) or ())):
        return None
    start, end = c["start"] or 0, c["end"]
    if start not in (0, 1) or not (end is None or isinstance(end, int) and end >= width):
        return None
    return start


def _rotate_pairs(index, r: fx.Node, width: int):
    """GPT-J's rotation written out on ``r`` of last dim ``width``::

        r * c + stack((-r[..., 1::2], r[..., ::2]), -1).flatten(-2) * s

    (sum, c, s, nodes) as _rotate_half's, or None; a str when something else reads a step."""
    users = _readers(r)
    muls = [(u, _other(index, u, r)) for u in users if _other(index, u, r) is not None]
    halves = {_every_other(index, u, r, width): u for u in users if index.prim(u) == "slice"}
    if width % 2 or len(muls) != 1 or set(halves) != {0, 1}:
        return None
    a, c = muls[0]
    x1, x2 = halves[0], halves[1]
    rotated = _stacked_pairs(index, x1, x2, r)
    if rotated is None:
        return None
    neg, stack, flat = rotated
    summed = _sum_with_rotated(index, a, flat)
    if summed is None:
        return None
    o, s, b = summed
    if len(users) != 3 or _readers(x1) != [stack] or _readers(b) != [o]:
        return "the normalized q/k is read outside its RoPE"
    return o, c, s, [a, x1, x2, neg, stack, b, o, flat]  # a and b at _rotate_half's positions


def _stacked_pairs(index, first: fx.Node, second: fx.Node, like: fx.Node):
    """GPT-J's rotation of two interleaved halves, ``stack((-second, first), -1).flatten(-2)`` with
    ``like``'s shape, each step read once by the next: (neg, stack, flat), or None."""
    neg = _single_user(second)
    if neg is None or index.prim(neg) != "neg" or index.canon(neg)["input"] is not second:
        return None
    stack = _single_user(neg)
    cs = index.canon(stack) if stack is not None else None
    if cs is None or cs.prim != "stack" or list(cs["tensors"]) != [neg, first] \
            or not _last(cs["dim"], len(node_shape(stack) or ())):
        return None
    flat = _single_user(stack)
    if flat is None or index.prim(flat) not in ("flatten", "view") or not same_shape(node_shape(flat), node_shape(like)):
        return None
    return neg, stack, flat


def _swaps_heads(c) -> bool:
    """A transpose of dims 1 and 2 of a 4-d value: (B, S, H, D) <-> (B, H, S, D)."""
    return isinstance(c["dim0"], int) and isinstance(c["dim1"], int) and {c["dim0"] % 4, c["dim1"] % 4} == {1, 2}


def _pair_halves(index, x: fx.Node, width: int, halves: bool = False):
    """``x.reshape(*x.shape[:-1], -1, 2).unbind(-1)``, x's last dim ``width``: (the view to pairs,
    the unbind, the first and the second of each pair), or None; ``halves``: CogView4's
    ``x.reshape(*x.shape[:-1], 2, -1).unbind(-2)``, the first and the second half."""
    shape = tuple(node_shape(x) or ())
    split = (2, width // 2) if halves else (width // 2, 2)
    pairs = next((u for u in _readers(x) if index.prim(u) == "view"
                  and same_shape(tuple(node_shape(u) or ()), (*shape[:-1], *split))), None)
    unbind = _single_user(pairs) if pairs is not None else None
    dim = unbound_dim(unbind) if unbind is not None else None
    if unbind is None or not isinstance(dim, int) or dim % len(node_shape(pairs)) != len(node_shape(pairs)) - 1 - halves:
        return None
    items = {u.args[1]: u for u in unbind.users if u.target is operator.getitem}
    if set(items) != {0, 1} or len(unbind.users) != 2:
        return None
    return pairs, unbind, items[0], items[1]


def _unbound_pairs(index, x: fx.Node, width: int):
    """Diffusers' interleaved rotation of ``x`` (Flux, CogVideoX, HunyuanDiT)::

        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)

    GPT-J's pair rotation: (the x_rotated node, the nodes from the reshape on), or None."""
    found = _pair_halves(index, x, width)
    if found is None:
        return None
    pairs, unbind, real, imag = found
    rotated = _stacked_pairs(index, real, imag, x)
    if rotated is None or _readers(real) != [rotated[1]]:
        return None
    neg, stack, flat = rotated
    return flat, [pairs, unbind, real, imag, neg, stack, flat]


def _unbound_halves(index, x: fx.Node, width: int):
    """Diffusers' rotation of halves (CogView4, ``use_real_unbind_dim=-2``)::

        x_real, x_imag = x.reshape(*x.shape[:-1], 2, -1).unbind(-2)
        x_rotated = torch.cat([-x_imag, x_real], dim=-1)

    rotate_half: (the x_rotated node, the nodes from the reshape on, padded to _unbound_pairs's
    seven), or None."""
    found = _pair_halves(index, x, width, halves=True)
    if found is None:
        return None
    pairs, unbind, real, imag = found
    neg = _single_user(imag)
    if neg is None or index.prim(neg) != "neg" or index.canon(neg)["input"] is not imag:
        return None
    cat = _single_user(neg)
    cc = index.canon(cat) if cat is not None else None
    if cc is None or cc.prim != "cat" or list(cc["tensors"]) != [neg, real] or _readers(real) != [cat] \
            or not _last(cc["dim"], len(node_shape(cat) or ())):
        return None
    return cat, [pairs, unbind, real, imag, neg, cat, cat]


def _rotate_unbound_pairs(index, r: fx.Node, x: fx.Node, width: int):
    """``r * c + fp32(x_rotated) * s`` with ``r`` an exact upcast of ``x`` and x_rotated diffusers'
    rotation of x, interleaved pairs or halves (the rotation commutes with the upcast: GPT-J's pairs,
    or rotate_half, on r): ((sum, c, s, nodes) as _rotate_pairs's, layout), or None."""
    found, layout = _unbound_pairs(index, x, width), "gptj"
    if found is None:
        found, layout = _unbound_halves(index, x, width), "neox"
    if found is None:
        return None
    flat, nodes = found
    cast = _single_user(flat)
    muls = [(u, _other(index, u, r)) for u in _readers(r) if _other(index, u, r) is not None]
    if cast is None or index.prim(cast) != "cast" or node_dtype(cast) != node_dtype(r) or len(muls) != 1 \
            or not is_exact_upcast(node_dtype(flat), node_dtype(cast)):
        return None
    a, c = muls[0]
    summed = _sum_with_rotated(index, a, cast)
    if summed is None:
        return None
    o, s, b = summed
    pairs, unbind, real, imag, neg, stack, flat = nodes
    steps = [a, pairs, unbind, real, imag, b, neg, *dict.fromkeys([stack, flat]), cast, o]  # a, b as _rotate_half's
    return (o, c, s, steps), layout


def _stored_index(node: fx.Node, out: fx.Node) -> int | None:
    """k of ``out[..., k::2] = v`` (``node`` a setitem into ``out``); None for any other store."""
    store = strided_store(node)
    return store[1] if store is not None and store[0] is out and store[2] == 2 else None


def _products(index, x1: fx.Node, x2: fx.Node, node: fx.Node):
    """(the product of x1, its table, the product of x2, its table) of ``node = x1 * a ± x2 * b``."""
    c = index.canon(node)
    if c is None or c.prim not in ("add", "sub") or c["alpha"] != 1:
        return None
    first, second = c["input"], c["other"]
    if c.prim == "add" and _other(index, first, x2) is not None:
        first, second = second, first  # x2 * cos + x1 * sin
    a, b = _other(index, first, x1), _other(index, second, x2)
    return None if a is None or b is None else (c.prim, first, a, second, b)


def _stored_pairs(index, x: fx.Node, width: int):
    """Wan's rotation of ``x``: the complex product written out on the pairs and stored interleaved::

        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(x)
        out[..., 0::2] = x1 * cos - x2 * sin
        out[..., 1::2] = x1 * sin + x2 * cos        (cos, sin: one value per pair)

    GPT-J's pair rotation with half tables; each store rounds to x's dtype. (out's one reader after
    the stores, cos, sin, the even columns' value, nodes), or None; a str when it is that, but
    something else reads a step."""
    found = _pair_halves(index, x, width)
    outs = [u for u in x.users if u.op == "call_function" and u.target is torch.empty_like and u.args[0] is x]
    if found is None or len(outs) != 1:
        return None
    pairs, unbind, x1, x2 = found
    out = outs[0]
    stores = {_stored_index(u, out): u for u in out.users if _stored_index(u, out) is not None}
    if set(stores) != {0, 1}:
        return None
    even, odd = stores[0].args[2], stores[1].args[2]
    pe = _products(index, x1, x2, even) if isinstance(even, fx.Node) else None
    po = _products(index, x1, x2, odd) if isinstance(odd, fx.Node) else None
    if pe is None or po is None or pe[0] != "sub" or po[0] != "add":
        return None
    (_, m1, c, m2, s), (_, m3, s2, m4, c2) = pe, po
    if not (index.same(c, c2) and index.same(s, s2)):
        return None
    last = max(stores.values(), key=index.order.__getitem__)
    after = [u for u in out.users if u not in stores.values()]
    nodes = [pairs, unbind, x1, x2, m1, m2, m3, m4, even, odd, out, stores[0], stores[1]]
    if len(after) != 1 or index.order[after[0]] < index.order[last] or set(_readers(x)) != {pairs, out} \
            or len(x1.users) != 2 or len(x2.users) != 2 or any(len(n.users) != 1 for n in (m1, m2, m3, m4, even, odd)):
        return "the normalized q/k is read outside its RoPE"
    return after[0], c, s, even, nodes


def _stored_match(index, found, chain: list, heads: _Heads) -> RopeMatch:
    """The RopeMatch of Wan's rotation (``found``: _stored_pairs'): layout "gptj", half tables,
    the products and sums in their promotion (rope_dtype), rounded by the store to x's dtype; a
    cast after it (Wan's ``.type_as(hidden_states)``) is taken where it adds no second rounding
    (to the stored dtype, or from a store that rounded nothing)."""
    B, S, H, D = heads.shape
    if isinstance(found, str):
        return RopeMatch(reason=found)
    reader, c, s, even, nodes = found
    chain += nodes
    out = nodes[-3]  # the stored tensor
    rope_dtype = node_dtype(even)
    if index.prim(reader) == "cast" and index.canon(reader)["input"] is out:
        if node_dtype(reader) != node_dtype(out) and node_dtype(out) != rope_dtype:
            return RopeMatch(reason=f"the rotation stored in {node_dtype(out)} is cast to {node_dtype(reader)}: two "
                                    f"roundings of the {rope_dtype} rotation, the call makes one")
        out = reader
        chain.append(reader)
    cos, sin = (_table(index, t, False, B, S, D // 2) for t in (c, s))
    if cos is None or sin is None:
        return RopeMatch(reason="cos/sin are not (1 | batch, 1 | seq, 1, head_dim / 2) tables, one value per pair")
    out_dtype = node_dtype(out)
    refusal = _dtypes_refusal(rope_dtype, out_dtype, heads.value, cos, sin, nodes[4:10])  # each product and sum
    if refusal is not None:
        return RopeMatch(reason=refusal)
    return RopeMatch(nodes=tuple(chain), output=out, cos=cos, sin=sin, layout="gptj", rotary_dim=D, head_dim=D,
                     heads_shape=(B, S, H, D), operand=heads.operand, norm_width=heads.width, transpose_out=False,
                     rope_dtype=rope_dtype, out_dtype=out_dtype)


def _first_reader(index, node: fx.Node, prim: str):
    """(the first reader of ``node`` that is a ``prim``, whether anything else reads ``node``)."""
    readers = _readers(node)
    hits = [u for u in readers if index.prim(u) == prim]
    return (hits[0] if hits else None), len(readers) > 1


def _complex_rotation(index, r: fx.Node, shape: tuple):
    """torchtitan's ComplexRoPE on ``r`` (B, S, H, D)::

        view_as_real(view_as_complex(r.reshape(B, S, H, D/2, 2)) * freqs_cis).flatten(3)

    (flat, freqs_cis, nodes), or None when r's readers are not that; a str when they are, but
    something else reads a step."""
    B, S, H, D = shape
    pairs, leak = _first_reader(index, r, "view")
    if pairs is None or not same_shape(node_shape(pairs), (B, S, H, D // 2, 2)):
        return None
    z, more = _first_reader(index, pairs, "view_as_complex")
    mul, more2 = _first_reader(index, z, "mul") if z is not None else (None, False)
    f = _other(index, mul, z) if mul is not None else None
    real, more3 = _first_reader(index, mul, "view_as_real") if f is not None else (None, False)
    if real is None:
        return None
    flat, more4 = _first_reader(index, real, "flatten")
    if flat is None:  # ATen graphs spell the flatten as a view
        flat, more4 = _first_reader(index, real, "view")
    if flat is None or not same_shape(node_shape(flat), (B, S, H, D)):
        return None
    if leak or more or more2 or more3 or more4:
        return "the normalized q/k is read outside its RoPE"
    return flat, f, [pairs, z, mul, real, flat]


def _freqs_cis(f, batch: int, seq: int, half: int) -> bool:
    """A complex table that broadcasts as (1 | B, 1 | S, 1, D / 2): one rotation per position and
    pair. Fewer dims are leading ones, as broadcasting reads them (Qwen-Image's (S, 1, D / 2))."""
    shape, dtype = node_shape(f), node_dtype(f)
    if shape is None or not 2 <= len(shape) <= 4 or dtype != torch.complex64:
        return False
    shape = (1,) * (4 - len(shape)) + tuple(shape)
    return _one_or(shape[0], batch) and _one_or(shape[1], seq) and shape[2] == 1 and shape[3] == half


def _one_or(dim, size) -> bool:
    """A table's dim that broadcasts to ``size`` (1) or is it; sizes may be symbolic (a graph
    captured for varied lengths)."""
    return same_dim(dim, 1) or same_dim(dim, size)


def _table(index, t, transposed: bool, batch: int, seq: int, width: int, row: bool = False):
    """The cos/sin table the kernel reads for an operand ``t`` of the RoPE's products: HF's (1 | B, S, R)
    before ``unsqueeze(unsqueeze_dim)``, when the unsqueeze adds the heads axis of the layout the
    RoPE reads; ``t`` itself when it is a 4-d (1 | B, 1 | S, 1, R) value (torchtitan's CosSinRoPE
    slices its cache: the kernel reads any strides) on q untransposed, or a 3-d (1 | B, S, R) one
    on a RoPE of the (B, S, N) row (``row``); diffusers' (S, R) table before ``cos[None, None]`` on q
    transposed (CogVideoX, CogView4); None otherwise."""
    c = index.canon(t)
    shape = node_shape(t)
    if transposed and not row and shape is not None and len(shape) == 4 and same_dim(shape[0], 1) \
            and same_dim(shape[1], 1):
        view = t
        while index.prim(view) == "cast" and node_dtype(index.canon(view)["input"]) == node_dtype(view):
            view = index.canon(view)["input"]  # cos.to(x.device): the same values
        v = index.canon(view)
        base = node_shape(v["input"]) if v is not None and v.prim in ("view", "unsqueeze") \
            and isinstance(v["input"], fx.Node) else None
        if base is not None and len(base) == 2 and same_dim(base[0], seq) and base[1] == width:
            return v["input"]
    if (c is None or c.prim != "unsqueeze") and not transposed and not row and shape is not None and len(shape) == 4 \
            and _one_or(shape[0], batch) and _one_or(shape[1], seq) and shape[2] == 1 and shape[3] == width:
        return t
    if row and shape is not None and len(shape) == 3 and _one_or(shape[0], batch) and same_dim(shape[1], seq) \
            and shape[2] == width:
        return t  # a RoPE on the (B, S, N) row: HF's 3-d table, no heads axis to add
    if row or c is None or c.prim != "unsqueeze" or not isinstance(c["input"], fx.Node):
        return None
    if one_dim(c) not in ((1, -3) if transposed else (2, -2)):
        return None
    base = c["input"]
    shape = node_shape(base)
    if shape is None or len(shape) != 3 or not _one_or(shape[0], batch) or not same_dim(shape[1], seq) \
            or shape[2] != width:
        return None
    return base


def find_rope(index, m) -> RopeMatch | None:
    """The RoPE after the norm ``m`` (see the module docstring), or None when there is none; a
    RoPE after a norm the call does not compute (an L2 norm, q scaled between the two)
    is found and kept, with the reason."""
    if m.group is not None or m.layout is not None or m.reason:
        return None
    steps: list[str] = []
    found = _find_rope(index, m, steps)
    refusal = (f"qk_norm_rope computes an RMSNorm or a LayerNorm; this q/k norm is a {m.kind}"
               if m.kind not in QK_KINDS else steps[0] if steps else None)
    if found is None:  # none of the forms read: is there a rotation all the same?
        form = _rotation_after(index, m.output)
        if form is None:
            return None
        return RopeMatch(reason=refusal or f"a RoPE follows this q/k norm {form}; {_FORMS_READ}")
    if found.reason is not None or refusal is None:
        return found
    return RopeMatch(reason=refusal)


_FORMS_READ = ("qk_norm_rope reads HF's rotate_half, interleaved pairs (GPT-J's, diffusers' unbind/stack) and "
               "the complex product, on (batch, seq, heads, head_dim) rows that only the RoPE reads")
# what a rotation may pass through after the norm: same values moved, cast, combined elementwise
_ROTATION_PATH = frozenset(["view", "permute", "transpose", "flatten", "unsqueeze", "squeeze", "expand", "cast",
                            "slice", "cat", "stack", "neg", "mul", "add", "sub", "addcmul", "view_as_complex",
                            "view_as_real", "sum"])


def _rotation_after(index, value: fx.Node, depth: int = 12) -> str | None:
    """Whether the values of ``value`` are rotated before anything else reads them (a matmul, the
    attention): a sum or difference of two of its products, one by a tensor computed elsewhere (a
    table), as every RoPE writes ``x * cos ± rotated(x) * sin``, a product by a table summed over a
    dim (a rotation matrix times each pair), or a complex product. Returns
    how the form differs from those read (for the reason), or None when no rotation follows."""
    reached, frontier, extra = {value}, [value], []
    for _ in range(depth):
        frontier = [u for n in frontier for u in n.users if u not in reached and (
            index.prim(u) in _ROTATION_PATH or is_split_piece(u) or _indexes(u))]
        reached.update(frontier)
    reached_in_order = sorted(reached, key=index.order.__getitem__)  # the reason's words the same every run
    rotation = None
    for n in reached_in_order:
        c = index.canon(n)
        if c is None:
            continue
        if c.prim == "mul" and any(index.prim(a) == "view_as_complex" and a in reached for a in (c["input"], c["other"])):
            rotation = n
        elif c.prim in ("add", "sub") and c["input"] in reached and c["other"] in reached and any(
                index.prim(a) == "mul" and _by_table(index, a, reached) for a in (c["input"], c["other"])):
            rotation = n
        elif c.prim == "sum" and c["input"] in reached and index.prim(c["input"]) == "mul" \
                and _by_table(index, c["input"], reached):
            # Kandinsky 5: a 2x2 rotation matrix per pair, ``(rope * x.reshape(..., -1, 1, 2)).sum(-1)``
            rotation = n
            extra.append("as a 2x2 rotation matrix times each pair (a product summed over the pair)")
        if rotation is not None:
            break
    else:
        return None
    for n in reached_in_order:  # what the values go through up to the rotation (a cat after it: PRX's k)
        c = index.canon(n)
        if c is None or index.order[n] > index.order[rotation]:
            continue
        if c.prim == "cat" and any(isinstance(t, fx.Node) and t not in reached for t in c["tensors"]):
            extra.append("over rows concatenated with other tokens' before it")
        if c.prim == "slice" and not _last(c["dim"], len(node_shape(n) or ())):
            extra.append("on a slice of the tokens")
        if any(u.op == "call_function" and u.target is operator.setitem for u in n.users):
            extra.append("written into a tensor through indexed stores (out[..., 0::2] = ..., q[:, :, n:] = ...)")
    shape = node_shape(rotation)
    if shape is not None and len(shape) == 3:
        extra.append("on the (batch, seq, heads * head_dim) row, before any view to heads")
    return ", ".join(sorted(set(extra))) or "in another layout or order of steps"


def _indexes(node: fx.Node) -> bool:
    """``x[...]``: a select, a strided slice, a piece of a split (values moved, not computed)."""
    return node.op == "call_function" and node.target is operator.getitem


def _by_table(index, product: fx.Node, reached: set) -> bool:
    """``product`` multiplies a reached value by a tensor from outside the reached values."""
    c = index.canon(product)
    return any(isinstance(a, fx.Node) and a not in reached for a in (c["input"], c["other"]))


def _scaled(index, value: fx.Node) -> tuple[fx.Node, object] | tuple[None, None]:
    """(the mul, the number) when the only reader of ``value`` multiplies it by a number."""
    user = _single_user(value)
    c = index.canon(user) if user is not None else None
    if c is None or c.prim != "mul":
        return None, None
    other = c["other"] if c["input"] is value else c["input"] if c["other"] is value else None
    return (user, other) if isinstance(other, (int, float)) and not isinstance(other, bool) else (None, None)


@dataclass
class _Heads:
    """How a normalized q/k reaches its RoPE as (batch, seq, heads, head_dim) rows: the value the
    RoPE reads (so far), the nodes on the way, whether heads and positions are swapped, the node
    the kernel reads when the norm comes after the swap, the shape and the norm's width."""

    value: fx.Node
    chain: list
    transposed: bool
    operand: fx.Node | None
    shape: tuple
    width: str


def _to_heads(index, m, steps: list) -> _Heads | None:
    """The normalized q/k as heads (a scale and a view to heads on the way), or None."""
    value, chain, transposed = m.output, [], False
    out_shape = node_shape(m.output)  # batch and sequence may be symbolic; heads and head_dim are not
    if out_shape is None or not isinstance(out_shape[-1], int):
        return None
    cast = _single_user(value)
    if cast is not None and index.prim(cast) == "cast" and index.canon(cast)["input"] is value \
            and node_dtype(cast) == node_dtype(value) is not None and len(_readers(cast)) > 1:
        # CogView4's norm_q(q).to(dtype), the same tensor, read by the RoPE twice (a cast read once is
        # the RoPE's own upcast, a no-op in fp32: the forms below read it)
        value = cast
        chain.append(cast)
    mul, number = _scaled(index, value)
    if mul is not None:  # MuseGlimmer: qk_norm(q) * qk_scale_factor, rounded before the RoPE
        steps.append(f"q/k is multiplied by {number} between its norm and its RoPE, a rounding the kernel does not make")
        value = mul
        chain.append(mul)
    user = _single_user(value)
    if user is not None and index.prim(user) == "view" and len(out_shape) == 3:  # a norm over the row, to heads
        value = user
        chain.append(user)
        user = _single_user(value)
    shape = node_shape(value)
    if shape is not None and len(shape) == 3 and m.hidden_size == shape[-1]:
        # LTX-Video: the RoPE rotates the whole (B, S, N) row, its tables one value per column: one head of N
        return _Heads(value, chain, False, None, (shape[0], shape[1], 1, shape[2]), "head")
    if shape is None or len(shape) != 4:
        return None
    operand, before = None, index.canon(m.input)
    if user is not None and index.prim(user) == "transpose" and _swaps_heads(index.canon(user)):
        B, S, H, D = shape
        value, transposed = user, True
        chain.append(user)
    elif before is not None and before.prim == "transpose" and _swaps_heads(before) and len(out_shape) == 4:
        B, H, S, D = shape  # Gemma 3: transposed before the norm, which is per head: the kernel reads q before it
        operand, transposed = before["input"], True
    else:
        B, S, H, D = shape
    if not (isinstance(H, int) and isinstance(D, int)):
        return None
    norm_shape = (B, H, S, D) if operand is not None else (B, S, H, D)
    width = "head" if m.hidden_size == D and same_shape(out_shape, norm_shape) else \
        "row" if m.hidden_size == H * D and same_shape(out_shape, (B, S, H * D)) else None
    if width is None:
        return None
    return _Heads(value, chain, transposed, operand, (B, S, H, D), width)


def _find_rope(index, m, steps: list) -> RopeMatch | None:
    """find_rope's search; a step the call cannot take on the way is added to ``steps``, said why."""
    heads = _to_heads(index, m, steps)
    if heads is None:
        return None
    value, chain, transposed, operand, width = heads.value, heads.chain, heads.transposed, heads.operand, heads.width
    B, S, H, D = heads.shape

    def rotation(r):  # (the rotation on r, its layout), neox first
        found = _rotate_half(index, r, D)
        return (found, "neox") if found is not None else (_rotate_pairs(index, r, D), "gptj")

    upcast, leak = _first_reader(index, value, "cast")
    on_value = rotation(value) if upcast is not None else None
    if on_value is not None and on_value[0]:
        upcast = None  # the RoPE reads the value itself, a cast of it is read elsewhere
    if upcast is not None:  # torchtitan: query.float(), the RoPE in fp32
        value = upcast
        chain.append(upcast)
        exact = is_exact_upcast(node_dtype(m.output), node_dtype(upcast))
        if not transposed:
            found = _complex_rotation(index, value, (B, S, H, D))
            if found is not None:
                return _complex_match(index, m, found, chain, leak, exact, (B, S, H, D), width, operand)
    users = _readers(value)
    halves = {_slice_of(index, u, value, D): u for u in users if index.prim(u) == "slice"}
    rotary, passed = D, None
    found, layout = on_value if on_value is not None and upcast is None else rotation(value)
    if found is None:
        layout = "neox"
    if found is None and len(halves) == 2 and None not in halves:
        (r0, r1), (p0, p1) = sorted(halves)
        if r0 == 0 and r1 == p0 and p1 == D:  # partial rotary: value[..., :R], value[..., R:]
            rotary, rot, passed = r1, halves[(r0, r1)], halves[(p0, p1)]
            found = _rotate_half(index, rot, rotary)
            if found is not None and not isinstance(found, str):
                chain += [rot, passed]
                if len(users) != 2:
                    found = "the normalized q/k is read outside its RoPE"
    if found is None and upcast is None and not transposed:  # Wan: the pairs' products stored interleaved
        stored = _stored_pairs(index, value, D)
        if stored is not None:
            return _stored_match(index, stored, chain, heads)
    if found is None and upcast is not None:  # diffusers: x.float() * cos + x_rotated(x).float() * sin
        unbound = _rotate_unbound_pairs(index, value, heads.value, D)
        found, layout = unbound if unbound is not None else (None, None)
        pairs = found[3][1] if found is not None else None  # the reshape to pairs: read by the RoPE
        leak = leak and not (pairs is not None and set(_readers(heads.value)) == {upcast, pairs})
    if found is None:
        return None
    if isinstance(found, str) or (upcast is not None and leak):
        return RopeMatch(reason=found if isinstance(found, str) else "the normalized q/k is read outside its RoPE")
    if upcast is not None and not exact:
        return RopeMatch(reason=f"q/k is cast from {node_dtype(m.output)} to {node_dtype(upcast)} before its RoPE, "
                                f"a rounding the kernel does not make")
    return _rope_match(index, found, chain, passed, value, transposed, rotary, layout, heads)


def _rope_match(index, found: tuple, chain: list, passed, value, transposed: bool, rotary: int, layout: str,
                heads: _Heads) -> RopeMatch:
    """The RopeMatch of a rotation found (``found``: its output, cos, sin and nodes), or why the call
    cannot take it: the rest of the head put back, the cast after, the tables and the dtypes."""
    B, S, H, D = heads.shape
    o, c, s, nodes = found
    chain += nodes
    out = o
    if passed is not None:  # cat((rotated, passed), -1)
        cat = _single_user(o)
        cc = index.canon(cat) if cat is not None else None
        if cc is None or cc.prim != "cat" or list(cc["tensors"]) != [o, passed] or _readers(passed) != [cat] \
                or not _last(cc["dim"], 4):
            return RopeMatch(reason="the rotated columns are not concatenated back with the rest as the head")
        out = cat
        chain.append(cat)
    cast = _single_user(out)
    if cast is not None and index.prim(cast) == "cast":  # OLMo 2: q_embed.to(q_type)
        out = cast
        chain.append(cast)
    on_row = len(node_shape(value) or ()) == 3  # the RoPE reads the (B, S, N) row
    cos, sin = (_table(index, t, transposed, B, S, rotary, on_row) for t in (c, s))
    if cos is None or sin is None:
        return RopeMatch(reason="cos/sin are neither HF's (batch, seq, rotary) tables unsqueezed at the heads axis "
                                "nor (1 | batch, 1 | seq, 1, rotary) tables")
    chain += [t for t, table in ((c, cos), (s, sin)) if t is not table and t not in chain]
    rope_dtype, out_dtype = node_dtype(o), node_dtype(out)
    refusal = _dtypes_refusal(rope_dtype, out_dtype, value, cos, sin, (nodes[0], nodes[5]))  # the two products
    if refusal is not None:
        return RopeMatch(reason=refusal)
    return RopeMatch(nodes=tuple(chain), output=out, cos=cos, sin=sin, layout=layout, rotary_dim=rotary, head_dim=D,
                     heads_shape=(B, S, H, D), operand=heads.operand, norm_width=heads.width, transpose_out=transposed,
                     rope_dtype=rope_dtype, out_dtype=out_dtype)


def _dtypes_refusal(rope_dtype, out_dtype, q: fx.Node, cos, sin, steps) -> str | None:
    """Why the call cannot round as the RoPE does: its ``steps`` (products, sums) not all in the
    promotion of q and the tables, or dtypes the kernels do not take; None when it can."""
    want = torch.promote_types(torch.promote_types(node_dtype(q), node_dtype(cos)), node_dtype(sin))
    if rope_dtype != want or any(node_dtype(n) != rope_dtype for n in steps):
        return f"the RoPE computes in {rope_dtype}, not in the promotion of q and cos/sin ({want})"
    if rope_dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES:
        return f"RoPE dtypes {rope_dtype} -> {out_dtype} are not ones the kernels take"
    return None


def _complex_match(index, m, found, chain: list, leak: bool, exact: bool, shape: tuple, width: str, operand) -> RopeMatch:
    """The RopeMatch of torchtitan's ComplexRoPE after the upcast of q (``found``: _complex_rotation's):
    the pair rotation in fp32, ``freqs_cis.real`` / ``.imag`` as half tables, layout "gptj"."""
    if isinstance(found, str) or leak:
        return RopeMatch(reason="the normalized q/k is read outside its RoPE")
    flat, f, nodes = found
    B, S, H, D = shape
    if not exact or node_dtype(flat) != torch.float32 or not _freqs_cis(f, B, S, D // 2):
        return RopeMatch(reason=f"the complex RoPE is not the pair rotation in fp32 of q upcast from "
                                f"{node_dtype(m.output)} by a complex64 (1 | batch, 1 | seq, 1, {D // 2}) freqs_cis "
                                f"(here: q upcast to {node_dtype(chain[-1])}, a {node_dtype(f)} freqs_cis of shape "
                                f"{tuple(node_shape(f) or ())}, the rotation in {node_dtype(flat)})")
    chain += nodes
    out = flat
    cast = _single_user(flat)
    if cast is not None and index.prim(cast) == "cast":  # .type_as(query)
        out = cast
        chain.append(cast)
    out_dtype = node_dtype(out)
    if out_dtype not in KERNEL_DTYPES:
        return RopeMatch(reason=f"RoPE dtypes {torch.float32} -> {out_dtype} are not ones the kernels take")
    return RopeMatch(nodes=tuple(chain), output=out, cos=f, sin=f, layout="gptj", rotary_dim=D, head_dim=D,
                     heads_shape=shape, operand=operand, norm_width=width, transpose_out=False,
                     rope_dtype=torch.float32, out_dtype=out_dtype, complex_table=True)


# --------------------------------------------------------------------------- plan

def _modes(site) -> tuple:
    m = site.match
    return m.kind, m.eps, m.weight_offset, m.norm_round_dtype, m.out_dtype, m.bias is None


def _same_rope(a: RopeMatch, b: RopeMatch) -> bool:
    return (a.layout, a.rotary_dim, a.head_dim, a.norm_width, a.transpose_out, a.rope_dtype, a.out_dtype) == (
        b.layout, b.rotary_dim, b.head_dim, b.norm_width, b.transpose_out, b.rope_dtype, b.out_dtype) \
        and all(same_dim(x, y) for x, y in zip(a.heads_shape[:2], b.heads_shape[:2]))


def _partner(ctx: PlanContext, site, found: RopeMatch):
    """The k norm of the same attention: a later site whose RoPE reads the same cos and sin, with
    the same modes, that no call took yet (the first such in graph order). Not a norm computed
    from this one's output: every layer reads one cos/sin table, and the next layer's q norm,
    downstream of this one, is no partner (its call could not start where this one does)."""
    index = ctx.analysis.index
    if "attentions" not in ctx.memo:
        ctx.memo["attentions"] = _attentions(ctx.analysis)
    attentions = ctx.memo["attentions"]
    ours = attentions[site.number]
    for other in ctx.analysis.sites:
        theirs = other.parts.get(QK_NORM_ROPE.name)
        if other is site or other.number in ctx.unavailable or theirs is None or theirs.reason is not None:
            continue
        if index.order[other.match.output] < index.order[site.match.output] or ctx.norm_refusal(other) is not None:
            continue
        if index.is_ancestor(site.match.output, other.match.input):
            continue
        attention = attentions[other.number]
        if None not in (ours, attention) and ours != attention:
            # LTX-2's audio-to-video q and video-to-audio k share the video table: one call would make each
            # attention's gradients flow through the other's (zeros where eager has none), and move one
            # attention's k projection up before the other attention
            continue
        if index.same(theirs.cos, found.cos) and index.same(theirs.sin, found.sin) and _same_rope(theirs, found) \
                and _modes(other) == _modes(site) and (other.match.weight is None) == (site.match.weight is None):
            return other
    return None


def _attentions(analysis) -> dict[int, str | None]:
    """Each site's attention (``_attention_of``), from one pass over the graph: the computing nodes of
    each innermost module path."""
    computing: dict[str, list[fx.Node]] = {}
    for node in analysis.index.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") and (paths := module_paths(node)):
            computing.setdefault(paths[-1], []).append(node)
    normalizing = {n for s in analysis.sites for n in s.match.nodes}
    return {s.number: _attention_of(analysis.index, s.match, computing, normalizing) for s in analysis.sites}


def _attention_of(index, m, computing: dict[str, list[fx.Node]], normalizing: set[fx.Node]) -> str | None:
    """The innermost module around a q/k norm that computes more than norms (its attention), or None.
    A module whose nodes all normalize (``normalizing``: the nodes of every norm found), with casts, views,
    slices and cats of their rows, is a norm's own (whatever its class is named: an attention class may be
    named QKNormCrossAttention; a norm split per slice of its rows is two norms in one module)."""
    for path in reversed(module_paths(m.anchor or m.output)):
        if any(n not in normalizing and index.prim(n) not in ("cast", "view", "permute", "transpose", "expand",
                                                                 "slice", "cat")
               for n in computing.get(path, ())):
            return path
    return None


class _QkNormRope(Fusion):
    name = "qk_rope"
    ops = ("qk_norm_rope",)
    exclusive = True  # y is rotated in the call: nothing else reads it
    roles = {"cos": "c", "sin": "sn", "q_bias": "qb", "k_bias": "kb"}
    operand_name = "the k norm's operands"

    def find(self, index, match, in_add=None) -> RopeMatch | None:
        return find_rope(index, match)

    def offer(self, ctx: PlanContext, site, found: RopeMatch | None, plan):
        if found is None:
            return None, None
        if found.reason is not None:
            return None, found.reason
        if not ctx.config.fuse_rope:
            return None, "not fused (fuse_rope=False)"
        if not ctx.config.standalone:  # a q/k norm has no add: its call is a standalone norm's
            return None, "standalone norms not rewritten (standalone=False)"
        if ctx.as_op:
            return None, "qk_norm_rope calls are made in torch-level graphs (dynamo, export), not ATen post-grad ones"
        if plan.op != "norm" or plan.taken or plan.permute is not None:
            return None, "the norm's call takes another step"
        if any(getattr(tensor_meta(t), "requires_grad", False) for t in (found.cos, found.sin) if isinstance(t, fx.Node)):
            # Flux's tables are computed from its position ids: an input that requires grad makes them
            return None, "the rotary tables require grad (computed from an input that does): qk_norm_rope does " \
                         "not differentiate them"
        partner = _partner(ctx, site, found)
        plan.op = "qk_norm_rope"
        if partner is None:
            return QkPair(site.match, found), None
        plan.sites = (site.number, partner.number)
        return QkPair(site.match, found, partner.match, partner.parts[self.name]), None

    def may_drop(self, pair: QkPair) -> bool:
        return True  # the norm alone, its RoPE left in the graph

    def drop(self, plan, pair: QkPair) -> None:
        plan.op, plan.sites = "norm", plan.sites[:1]

    def reads(self, pair: QkPair) -> tuple[fx.Node, ...]:
        k = () if pair.k_norm is None else (pair.k.operand or pair.k_norm.input, pair.k_norm.weight, pair.k_norm.bias)
        return tuple(t for t in (*k, pair.q.cos, pair.q.sin) if isinstance(t, fx.Node))

    def nodes(self, pair: QkPair) -> tuple[fx.Node, ...]:
        k = () if pair.k_norm is None else (*pair.k_norm.nodes, *pair.k.nodes)
        return (*pair.q.nodes, *k)

    def spans(self, pair: QkPair) -> tuple[fx.Node, ...]:
        k = () if pair.k_norm is None else (*pair.k_norm.nodes, pair.k_norm.output, *pair.k.nodes)
        return (*pair.q.nodes, *k)

    def build(self, pair: QkPair, plan, rewriting, modes: dict) -> BuiltCall:
        graph, inserted, holds = rewriting.graph, [], {}
        operands = []
        for m, rope in ((pair.q_norm, pair.q), (pair.k_norm, pair.k)):
            if m is None:
                operands.append(None)
                continue
            x = rewriting.resolve(rope.operand or m.input)
            if len(node_shape(m.input) or ()) == 3:  # (B, S, H * D) -> (B, S, H, D): the kernel reads heads
                heads = tuple(rope.heads_shape[2:])  # static; B and S may be symbolic
                x = graph.call_method("unflatten", (x, -1, heads))
                _meta_of(x, m.input, lambda t: t.unflatten(-1, heads))
                inserted.append(x)
                holds[x] = m.input
            operands.append(x)
        q = pair.q
        cos, sin = q.cos, q.sin
        if q.complex_table:  # freqs_cis = cos + i sin, one per pair: the kernel reads .real and .imag
            table = q.cos
            for _ in range(4 - len(node_shape(q.cos))):  # the leading dims broadcasting adds, as views
                padded = graph.call_method("unsqueeze", (table, 0))
                _meta_of(padded, table, lambda t: t.unsqueeze(0))
                inserted.append(padded)
                table = padded
            cos, sin = (graph.call_function(part, (table,)) for part in (torch.real, torch.imag))
            for t, part in ((cos, torch.real), (sin, torch.imag)):
                _meta_of(t, table, part)
                inserted.append(t)
                holds[t] = q.cos  # the checker takes the part the same way (verify/numeric.py)
        options = dict(cos=cos, sin=sin, eps=modes["eps"], weight_offset=modes["weight_offset"],
                       norm_round_dtype=modes["norm_round_dtype"], norm_out_dtype=modes["out_dtype"],
                       rope_dtype=q.rope_dtype, out_dtype=q.out_dtype, layout=q.layout, rotary_dim=q.rotary_dim,
                       norm_width=q.norm_width, transpose_out=q.transpose_out)
        if pair.q_norm.kind == "layer_norm":  # a LayerNorm's kind and biases (an RMSNorm's are the defaults)
            options.update(kind="layer_norm", q_bias=pair.q_norm.bias,
                           k_bias=None if pair.k_norm is None else pair.k_norm.bias)
        weights = (pair.q_norm.weight, None if pair.k_norm is None else pair.k_norm.weight)
        call = graph.call_function(qk_norm_rope, (*operands, *weights), options)
        inserted.append(call)
        built = BuiltCall(call, inserted, [], [*q.nodes], holds)
        for k, rope in enumerate((q, pair.k)):
            if rope is None:
                continue
            out = graph.call_function(operator.getitem, (call, k))
            copy_meta(out, rope.output)
            inserted.append(out)
            built.stands_for.append((k, rope.output))
            if len(node_shape(rope.output) or ()) == 3:  # a RoPE of the row: (B, S, 1, N) back to (B, S, N)
                _meta_of(out, rope.output, lambda t: t.unsqueeze(2))
                out = graph.call_method("flatten", (out, 2))
                copy_meta(out, rope.output)
                inserted.append(out)
            rewriting.replace(rope.output, out)
        if pair.k_norm is not None:
            built.old_nodes += [*pair.k_norm.nodes, *pair.k.nodes]
        return built

    def report(self, record, found, fused: bool, reason: str | None) -> None:
        rope = found.q if isinstance(found, QkPair) else found
        if rope.reason is None:
            record.rope = rope.describe()
        # the k site of a call is not its lead: the call computes its RoPE all the same (in an
        # audit too, where no site is rewritten: the plan's op says the call would)
        record.fused_rope = fused or record.op == "qk_norm_rope"
        record.rope_reason = None if record.fused_rope else (rope.reason or reason)

    def eager_nodes(self, pair: QkPair) -> tuple[fx.Node, ...]:
        # the RoPE of q and of k (the k norm itself is priced at its own site)
        return (*pair.q.nodes, *(() if pair.k is None else pair.k.nodes))

    def fused_bytes(self, pair: QkPair, y_bytes: int, size) -> tuple[int, int]:
        """The q site is priced as a norm (read q and its weight, write y and rstd; backward: read
        dy, q, rstd, the weight, write dq and dweight); the k site, computed by this call, adds only
        its weight and y (backward: dy, its weight's grads). Besides: q_out, k_out in place of the
        norms' y, dq_out, dk_out in place of their dy, cos and sin read once each way (the complex
        form's freqs_cis once: its real and imaginary parts), and k's read, rstd and dk."""
        q = pair.q
        tables = size.bytes(q.cos) if q.complex_table else \
            sum(size.bytes(t) for t in (q.cos, q.sin) if isinstance(t, fx.Node))
        fwd = bwd = size.bytes(pair.q.output) - y_bytes + tables
        if pair.k is not None:
            k = pair.k_norm
            k_out, k_in, rstd = size.bytes(pair.k.output), size.bytes(k.input), 4 * (size.numel(k.input) // k.hidden_size)
            fwd += k_out - size.bytes(k.output) + k_in + rstd
            bwd += k_out - size.bytes(k.output) + k_in + rstd + k_in  # dk_out for dy; read k, rstd; write dk
        return fwd, bwd

    # ---------------------------------------------------------------- checker
    def norm_kind(self, options: dict) -> str:
        return options.get("kind", "rms_norm")

    def heads(self, call: fx.Node, outputs: list) -> tuple:
        head_dim = (node_shape(outputs[0][1]) or (None,))[-1] if outputs else None
        return head_dim, call.kwargs.get("rotary_dim")

    def reads_transposed(self, options: dict) -> bool:
        return bool(options.get("transpose_out"))

    def formula(self, options: dict, rows: dict, normalize, ops) -> list:
        """q_out, k_out: each normalized with its weight and bias (the call's x / weight / q_bias,
        residual / bias / k_bias roles) over its rows (norm_width: each head, or all heads of a
        position), then rotated head by head (``rows["heads"]``: a head is ``per_head`` symbols, the
        first ``per_head * R / D`` rotated)."""
        heads, layout = rows["heads"], options.get("layout", "neox")
        rotated = heads.per_head * (options.get("rotary_dim") or heads.head_dim) // heads.head_dim
        c, sn = (_per_column(rows[t], rotated, layout, ops) for t in ("cos", "sin"))
        out = {}
        for name, x, w, b in (("q_out", rows["x"], rows["weight"], rows.get("q_bias")),
                              ("k_out", rows["residual"], rows["bias"], rows.get("k_bias"))):
            if x is None:
                out[name] = None
                continue
            p = heads.per_head
            if options.get("norm_width", "head") == "row":
                y = normalize(x, w, b)
            else:  # each head's statistics (parameters of all heads' columns read head by head)
                def of_head(t, h):
                    return t if t is None or len(t) == p else t[h:h + p]
                y = [v for h in range(0, len(x), p) for v in normalize(x[h:h + p], of_head(w, h), of_head(b, h))]
            out[name] = [v for h in range(0, len(y), p) for v in _rotated(y[h:h + p], c, sn, layout, rotated)]
        return [out[name] for name in QK_NORM_ROPE_OUTPUTS]


def _per_column(table: list, rotated: int, layout: str, ops) -> list:
    """A table row with one value per rotated symbol: a half table (one value per pair, as the
    complex form's) repeated as the layout pairs its columns (normfuse/kernels/qk_rope.py)."""
    if len(table) == rotated:
        return table
    if 2 * len(table) != rotated:
        raise ops.unsupported(f"a table of {len(table)} symbols for {rotated} rotated ones")
    return [table[j % len(table)] if layout == "neox" else table[j // 2] for j in range(rotated)]


def _meta_of(node: fx.Node, source: fx.Node, step) -> None:
    """An inserted node's meta: ``source``'s, its example value passed through ``step``."""
    copy_meta(node, source)
    for key in ("example_value", "val"):
        if isinstance(node.meta.get(key), torch.Tensor):
            node.meta[key] = step(node.meta[key])
    node.meta.pop("tensor_meta", None)


def _rotated(y: list, c: list, s: list, layout: str, rotated: int) -> list:
    """y * c + rot(y) * s on the first ``rotated`` symbols of a head, rot(y)[j] = sign(j) * y[P(j)]
    (normfuse/kernels/qk_rope.py); the others as they are (partial rotary)."""
    half = rotated // 2
    if layout == "neox":
        rot = [-y[j + half] if j < half else y[j - half] for j in range(rotated)]
    else:
        rot = [-y[j + 1] if j % 2 == 0 else y[j - 1] for j in range(rotated)]
    return [y[j] * c[j] + rot[j] * s[j] for j in range(rotated)] + y[rotated:]


QK_NORM_ROPE = _QkNormRope()
