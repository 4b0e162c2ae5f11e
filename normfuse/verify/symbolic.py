"""Symbolic checking: per site, the original subgraph equals the fused op's formula.

Both sides become sympy expressions over one symbolic row of length ``ROW`` (x, the
residual, the weight and the bias are rows of symbols, eps is a symbol): the original
subgraph node by node through the canonical view, the fused call from its keyword
arguments and its fusion's formula (``Fusion.formula``, the defining formula of its op). Casts, views and
identity dropout are identities in exact arithmetic; the rounding points are the
numeric checker's business.

Equality is decided by algebra: every ``base**(k/2)`` becomes ``t**k`` for a positive
symbol ``t`` per distinct (expanded) base, the difference is brought over one
denominator and its numerator reduced modulo ``t**2 - base``. Only when that does not
reach zero are random rational points substituted; a nonzero value refutes, zeros at
every point are reported as such (``method``), never as an algebraic proof.
"""

from __future__ import annotations

import math
import operator
import random
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

import sympy
import torch
import torch.fx as fx

from normfuse.passes.canonical import (TUPLE_SPELLINGS, canonical, canonicalize, common_subexpressions, node_dtype,
                                       node_shape, one_dim, strided_store, unbound_dim)
from normfuse.passes.find import live_dropout_p
from normfuse.passes.fusions import fusion_of
from normfuse.passes.order import STEPS
from normfuse.passes.record import fused_op_name
from normfuse.verify.sites import SitePair

__all__ = ["ROW", "SymbolicResult", "prove_site"]

ROW = 4          # length of the symbolic row
_POINTS = 3      # random rational points tried when algebra cannot decide


@dataclass
class SymbolicResult:
    status: str                 # "proved" | "refuted" | "unsupported"
    method: str | None = None   # "algebra" | "algebra (t^2 = base)" | "random rational points"
    detail: str | None = None   # why unsupported / where it differs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Unsupported(Exception):
    pass


# --------------------------------------------------------------------------- rows

def _row(name: str, n: int) -> list:
    return [sympy.Symbol(f"{name}{i}", real=True) for i in range(n)]


class _Heads(list):
    """A value split into heads: one row per head (a norm over all heads of a position, then the
    view to (..., H, D): OLMo 2's q/k). Elementwise steps, slices and cats act per head."""


class _Groups(list):
    """A row whose last dim became groups along a new last dim, one tuple per group: the view
    to (..., D/2, 2) of the complex form, a ``stack(..., -1)``; flattening them back interleaves."""


class _Complex(list):
    """A row of complex values as (real, imaginary) pairs of real expressions: ``view_as_complex``
    of pairs, a complex table (freqs_cis). Kept apart so that no expression needs sympy's I."""


def _complex_mul(a: Any, b: Any) -> "_Complex":
    """Elementwise product of two rows, at least one complex (a real row scales both parts)."""
    def parts(v):
        return v if isinstance(v, tuple) else (v, 0)
    a, b = _bcast(a, b)
    out = []
    for u, v in zip(a, b):
        (ar, ai), (br, bi) = parts(u), parts(v)
        out.append((ar * br - ai * bi, ar * bi + ai * br))
    return _Complex(out)


def _structured(*values: Any) -> bool:
    return any(isinstance(v, (_Groups, _Complex)) for v in values)


@dataclass(frozen=True)
class _HeadRows:
    """How the rows of a call stand for heads (its fusion says so: ``Fusion.heads``): a head's ``head_dim`` columns are
    ``per_head`` symbols, so many that the rotary columns and their halves fall on whole symbols.
    A value of m heads (m * head_dim columns) is a row of d heads, d the least prime factor of m
    (one head for m = 1), each symbol standing for the same columns of the m / d heads it covers:
    a statistic over the row then differs from one per head, and heads h and h + d share
    symbols (a permutation of heads by d would not be seen). m with no prime factor up to 7 is
    left unsupported (the rows would grow with it)."""

    head_dim: int
    per_head: int

    def symbols(self, width: int) -> int | None:
        """The symbols of a value whose last dim is ``width`` columns (None: not whole symbols)."""
        if width % self.head_dim == 0:
            heads = width // self.head_dim
            d = 1 if heads == 1 else next((f for f in (2, 3, 5, 7) if heads % f == 0), None)
            return None if d is None else self.per_head * d
        return width * self.per_head // self.head_dim if width * self.per_head % self.head_dim == 0 else None


def _head_rows(pair: SitePair) -> _HeadRows | None:
    """The heads of a call's rows (None for a call whose rows are not heads)."""
    heads = fusion_of(fused_op_name(pair.call)).heads(pair.call, pair.outputs)
    if heads is None:
        return None
    head_dim, rotary = heads
    if not isinstance(head_dim, int) or head_dim % 2:
        raise _Unsupported(f"the output {pair.outputs[0][1].name} has no even head_dim")
    rotary = rotary or head_dim
    # p * rotary / 2 a multiple of head_dim: the halves of the rotary columns are whole symbols
    return _HeadRows(head_dim, math.lcm(ROW, 2 * head_dim // math.gcd(rotary, 2 * head_dim)))


def _bcast(a: list, b: list) -> tuple[list, list]:
    if len(a) == len(b):
        return a, b
    if len(a) == 1:
        return a * len(b), b
    if len(b) == 1:
        return a, b * len(a)
    raise _Unsupported(f"rows of lengths {len(a)} and {len(b)} do not broadcast")


def _elementwise(fn, *rows):
    if _structured(*rows):
        raise _Unsupported("an elementwise step on pairs or complex values other than a product")
    heads = {len(r) for r in rows if isinstance(r, _Heads)}
    if len(heads) > 1:
        raise _Unsupported(f"values of {sorted(heads)} heads meet in one step")
    if heads:  # per head; a row (cos, sin) meets every head
        return _Heads(_elementwise(fn, *(r[h] if isinstance(r, _Heads) else r for r in rows))
                      for h in range(heads.pop()))
    rows = [r if isinstance(r, list) else [r] for r in rows]
    if len(rows) == 2:
        rows = list(_bcast(*rows))
    return [fn(*vals) for vals in zip(*rows)]


def _const(value: Any, eps: float | None, eps_sym) -> Any:
    if isinstance(value, bool):
        return sympy.Integer(int(value))
    if isinstance(value, int):
        return sympy.Integer(value)
    if isinstance(value, float):
        if eps is not None and value == eps:
            return eps_sym
        return sympy.Rational(value)
    return value


def _whole(row: Any) -> Any:
    if isinstance(row, _Heads):
        raise _Unsupported("a statistic over a value split into heads")
    return row


def _mean(row: list) -> list:
    row = _whole(row)
    return [sympy.Add(*row) / len(row)]


def _var(row: list, unbiased: bool) -> list:
    row = _whole(row)
    m = _mean(row)[0]
    return [sympy.Add(*[(v - m) ** 2 for v in row]) / (len(row) - (1 if unbiased else 0))]


def _l2_normalized(row: list, eps_expr) -> list:
    """F.normalize(row, dim=-1, eps): row / max(||row||_2, eps)."""
    row = _whole(row)
    denom = _max(sympy.sqrt(sympy.Add(*[v ** 2 for v in row])), eps_expr)
    return [v / denom for v in row]


def _norm(kind: str, s: list, weight, bias, eps_expr, offset=0, hidden: int | None = None) -> list:
    if kind == "layer_norm":
        m = _mean(s)[0]
        rho = (_var(s, False)[0] + eps_expr) ** sympy.Rational(-1, 2)
        n = [(v - m) * rho for v in s]
    elif kind == "rms_norm":
        rho = (sympy.Add(*[v ** 2 for v in s]) / len(s) + eps_expr) ** sympy.Rational(-1, 2)
        n = [v * rho for v in s]
    elif kind == "l2_norm":  # the unit row times sqrt(N) of the real row (the constant the graph multiplies by)
        if not isinstance(hidden, int):
            raise _Unsupported("an l2_norm of a row whose length is not known")
        n = [v * sympy.Rational(hidden ** 0.5) for v in _l2_normalized(s, eps_expr)]
    else:
        raise _Unsupported(f"no formula for norm kind {kind!r}")
    if weight is not None:
        n = _elementwise(lambda a, w: a * (w + offset), n, weight)
    if bias is not None:
        n = _elementwise(operator.add, n, bias)
    return n


# --------------------------------------------------------------------------- the original subgraph

# A live dropout's keep mask, one symbol per element of the row: the original's dropout and
# the kernel's are compared given the same mask.
_MASK = _row("m", ROW)


def _live_dropout_scale(c) -> Any:
    """1 / (1 - p) of a dropout that draws a mask (None otherwise)."""
    p = live_dropout_p(c)
    return None if p is None else sympy.Rational(1.0 / (1.0 - p))


# primitives that map each value of a row on its own, with no option of their own
_UNARY = {
    "square": lambda a: a ** 2,
    "rsqrt": lambda a: a ** sympy.Rational(-1, 2),
    "sqrt": sympy.sqrt,
    "reciprocal": lambda a: 1 / a,
    "abs": sympy.Abs,
    "neg": operator.neg,
}


def _eval_getitem(node: fx.Node, load) -> Any:
    """``value[idx]``: an output of a tuple, or a row indexed as a whole or in a block."""
    src, idx = node.args
    value = load(src)
    if isinstance(value, tuple):
        return value[idx]
    if getattr(canonical(node), "prim", None) in ("unsqueeze", "view"):  # x[:, None], w[:, None, None]:
        return value                                                       # the row as it is
    if getattr(canonical(node), "prim", None) == "slice":  # x[..., a:b]: a block of the row
        return _slice_row(node, canonical(node), value)
    raise _Unsupported(f"{node.name} indexes a value that is not a tuple")


def _unbound_over(node: fx.Node) -> str | None:
    """What ``x.unbind(d)`` of a row split into groups takes apart: "positions" for d the last dim (the
    pairs' first and second members: ``x.reshape(..., -1, 2).unbind(-1)``), "groups" for the dim before
    it (CogView4's halves: ``x.reshape(..., 2, -1).unbind(-2)``); None for another unbind."""
    dim, shape = unbound_dim(node), node_shape(node.args[0])
    if not isinstance(dim, int):
        return None
    if _touches_last(node.args[0], dim):
        return "positions"
    return "groups" if shape and len(shape) >= 2 and dim % len(shape) == len(shape) - 2 else None


def _unbind_groups(node: fx.Node, value: Any, over: str) -> tuple:
    """The unbind of a row of groups (_unbound_over's ``over``): one row per position in a group, or
    each group a row (per head when the row is split into heads)."""
    if isinstance(value, _Heads) and all(isinstance(h, _Groups) for h in value):
        parts = [_unbind_groups(node, h, over) for h in value]
        return tuple(_Heads(p[k] for p in parts) for k in range(len(parts[0])))
    if not isinstance(value, _Groups) or not value or len({len(g) for g in value}) != 1:
        raise _Unsupported(f"{node.name} unbinds a value that is not a row of groups")
    if over == "groups":
        return tuple(list(g) for g in value)
    return tuple([g[k] for g in value] for k in range(len(value[0])))


def _eval_node(node: fx.Node, load, eps: float | None, eps_sym, heads: _HeadRows | None = None) -> Any:
    def val(a):
        return load(a) if isinstance(a, fx.Node) else _const(a, eps, eps_sym)

    if node.op == "call_function" and node.target is operator.getitem:
        return _eval_getitem(node, load)
    if node.op == "call_function" and node.target is torch.empty_like:
        return _empty_like(load(node.args[0]))
    if node.op == "call_function" and node.target is operator.setitem:  # (prove_site rebinds the target)
        return _store(node, load(node.args[0], unwritten=True), val(node.args[2]))
    c = canonical(node)
    if c is None and _max_values(node):  # torch.max(x, dim) returns (values, indices): the row's maximum
        return [_max(*val(node.args[0]))], None
    if c is None and (over := _unbound_over(node)) is not None:  # the pairs' members, or the row's halves
        return _unbind_groups(node, val(node.args[0]), over)
    if c is None:
        raise _Unsupported(f"no symbolic rule for node {node.name} ({node.op} {getattr(node.target, '__name__', node.target)})")
    p = c.prim
    scale = _live_dropout_scale(c) if p == "dropout" else None
    if scale is not None:  # given the mask: input * m * 1/(1-p)
        return _elementwise(lambda a, m: a * m * scale, val(c["input"]), _MASK)
    if p == "view" and heads is not None:
        return _split_heads(node, c, val(c["input"]), heads)
    if p in ("cast", "view", "permute", "dropout"):  # a row keeps its values (a permute moves it whole)
        return val(c["input"])
    if p in ("add", "sub"):
        alpha = _const(c["alpha"], None, None)
        sign = 1 if p == "add" else -1
        return _elementwise(lambda a, b: a + sign * alpha * b, val(c["input"]), val(c["other"]))
    if p in _PAIRED:
        return _PAIRED[p](node, c, val)
    if p == "flatten":
        return _flattened(node, c, val(c["input"]))
    if p == "div":
        return _elementwise(operator.truediv, val(c["input"]), val(c["other"]))
    if p == "addcmul":  # input + value * tensor1 * tensor2
        value = _const(c["value"], None, None)
        product = _elementwise(operator.mul, val(c["tensor1"]), val(c["tensor2"]))
        return _elementwise(lambda a, b: a + value * b, val(c["input"]), product)
    if p == "pow":
        return _elementwise(lambda a, e: a ** e, val(c["input"]), val(c["exponent"]))
    if p in _UNARY:
        return _elementwise(_UNARY[p], val(c["input"]))
    if p == "mean":
        return _mean(val(c["input"]))
    if p == "var":
        return _var(val(c["input"]), bool(c["unbiased"]))
    if p in ("silu", "sigmoid"):
        return _elementwise(lambda v: _activation(p, v), val(c["input"]))
    if p == "unsqueeze":  # the dim an amax without keepdim dropped, put back: the row as it is
        return val(c["input"])
    if p == "transpose":  # of two dims before the last (q's heads and positions): each row as it is
        if _touches_last(node, c["dim0"], c["dim1"]):
            raise _Unsupported(f"{node.name} transposes the last dim")
        return val(c["input"])
    if p == "slice":
        return _slice_row(node, c, val(c["input"]))
    if p == "amax":  # over the last dim, keepdim (the matcher took no other): the row's maximum
        return [_max(*_whole(val(c["input"])))]
    if p == "clamp":
        return _clamp(val(c["input"]), _bound(c["min"], val), _bound(c["max"], val), eps, eps_sym)
    if p == "normalize":  # p = 2 over the last dim (the matcher took no other)
        return _l2_normalized(val(c["input"]), _const(c["eps"], eps, eps_sym))
    if p in ("layer_norm", "rms_norm"):
        weight = val(c["weight"]) if c["weight"] is not None else None
        bias = val(c["bias"]) if p == "layer_norm" and c["bias"] is not None else None
        y = _norm(p, val(c["input"]), weight, bias, eps_sym)
        return (y, None, None) if c.multi_output else y
    raise _Unsupported(f"no symbolic rule for primitive {p!r} (node {node.name})")


def _per_head(value: Any, step) -> Any:
    """``step`` of a value, head by head when it is split into heads (a norm over all heads, then
    its complex RoPE per head: Lumina-Next)."""
    return _Heads(step(head) for head in value) if isinstance(value, _Heads) else step(value)


def _is_complex(value: Any) -> bool:
    return isinstance(value, _Complex) or (isinstance(value, _Heads) and all(isinstance(h, _Complex) for h in value))


def _eval_mul(node: fx.Node, c, val) -> Any:
    a, b = val(c["input"]), val(c["other"])
    if _is_complex(a) or _is_complex(b):  # the complex form's rotation
        if isinstance(b, _Heads):
            a, b = b, a
        if isinstance(a, _Groups) or isinstance(b, (_Groups, _Heads)) or (isinstance(a, _Heads) and not _is_complex(a)):
            raise _Unsupported(f"{node.name} multiplies complex values with pairs, or two values split into heads")
        return _per_head(a, lambda head: _complex_mul(head, b))
    return _elementwise(operator.mul, a, b)


def _eval_view_as_complex(node: fx.Node, c, val) -> Any:
    def pairs_as_complex(value):
        if not isinstance(value, _Groups) or any(len(g) != 2 for g in value):
            raise _Unsupported(f"{node.name} reads a value that is not pairs of columns as complex")
        return _Complex(value)
    return _per_head(val(c["input"]), pairs_as_complex)


def _eval_view_as_real(node: fx.Node, c, val) -> Any:
    def as_pairs(value):
        if not isinstance(value, _Complex):
            raise _Unsupported(f"{node.name} reads a value that is not complex")
        return _Groups(value)
    return _per_head(val(c["input"]), as_pairs)


def _eval_stack(node: fx.Node, c, val) -> Any:
    """Rows stacked along a new last dim: the groups of their columns."""
    ndim = len(node_shape(node) or ())
    rows = [val(t) for t in c["tensors"]]
    if one_dim(c, ndim or None) not in (-1, ndim - 1) or any(not isinstance(r, list) or _structured(r) or
                                                     isinstance(r, _Heads) for r in rows) \
            or len({len(r) for r in rows}) != 1:
        raise _Unsupported(f"{node.name} stacks other than rows of one length along a new last dim")
    return _Groups(zip(*rows))


def _eval_cat(node: fx.Node, c, val) -> Any:
    """Rows joined along the last dim (rotate_half's cat((-x2, x1), -1)), head by head if split."""
    ndim = len(node_shape(node) or ())
    if list(c["dim"]) not in ([-1], [ndim - 1]):
        raise _Unsupported(f"{node.name} concatenates along a dim other than the last")
    parts = [val(t) for t in c["tensors"]]
    if any(isinstance(t, _Heads) for t in parts):  # head by head
        if not all(isinstance(t, _Heads) and len(t) == len(parts[0]) for t in parts):
            raise _Unsupported(f"{node.name} concatenates a value split into heads with another")
        return _Heads([v for t in part for v in t] for part in zip(*parts))
    return [v for t in parts for v in t]


# primitives that build a row from pairs, complex values or several rows: (node, canonical, val)
_PAIRED = {"mul": _eval_mul, "view_as_complex": _eval_view_as_complex, "view_as_real": _eval_view_as_real,
           "stack": _eval_stack, "cat": _eval_cat}


def _touches_last(node: fx.Node, *dims: Any) -> bool:
    ndim = len(node_shape(node) or ())
    return not ndim or any(not isinstance(d, int) or d % ndim == ndim - 1 for d in dims)


def _split_heads(node: fx.Node, c, row: Any, heads: _HeadRows) -> Any:
    """A view of a value whose rows stand for heads: one that splits the last dim into heads of
    ``head_dim`` columns makes the row heads, one into pairs (..., D/2, 2) makes groups, one that
    merges groups back interleaves them; any other keeps the row as it is."""
    shape_in, shape_out = node_shape(c["input"]) or (None,), node_shape(node) or (None,)
    before, after = shape_in[-1], shape_out[-1]
    if isinstance(row, _Groups) and len(shape_in) == len(shape_out) + 1 and after == before * shape_in[-2]:
        return _interleaved(row)
    if after == 2 and len(shape_out) == len(shape_in) + 1 and shape_out[-2] * 2 == before and not _structured(row):
        if isinstance(row, _Heads):  # each head's pairs (Wan: the norm over all heads, then its RoPE per head)
            return _Heads(_pairs(node, head) for head in row)
        return _pairs(node, row)
    if isinstance(before, int) and len(shape_out) == len(shape_in) + 1 and tuple(shape_out[-2:]) == (2, before // 2) \
            and after != heads.head_dim and (before <= heads.head_dim or isinstance(row, _Heads)) and not _structured(row):
        # each head's halves (Cosmos, CogView4: x.reshape(..., 2, -1).unbind(-2)); two heads are heads
        return _Heads(_halves(node, head) for head in row) if isinstance(row, _Heads) else _halves(node, row)
    if before == after or isinstance(row, _Heads):
        return row
    if after != heads.head_dim or not isinstance(before, int) or before % after or len(row) % heads.per_head:
        raise _Unsupported(f"{node.name} reshapes the row ({before} -> {after} columns) but not into heads")
    return _Heads(row[i:i + heads.per_head] for i in range(0, len(row), heads.per_head))


def _pairs(node: fx.Node, row: list) -> "_Groups":
    if len(row) % 2:
        raise _Unsupported(f"{node.name} pairs the columns of a row of {len(row)} symbols")
    return _Groups(zip(row[0::2], row[1::2]))


def _halves(node: fx.Node, row: list) -> "_Groups":
    if len(row) % 2:
        raise _Unsupported(f"{node.name} halves a row of {len(row)} symbols")
    return _Groups([row[:len(row) // 2], row[len(row) // 2:]])


class _Unwritten(list):
    """A row of ``torch.empty_like``'s: None where no store has written a column yet."""


def _empty_like(row: Any) -> Any:
    """``torch.empty_like(x)``: a row of x's length, each symbol None until a store writes it."""
    if isinstance(row, _Heads):
        return _Heads(_Unwritten([None] * len(head)) for head in row)
    if _structured(row):
        raise _Unsupported("an empty tensor shaped like pairs or complex values")
    return _Unwritten([None] * len(row))


def _store(node: fx.Node, out: Any, value: Any) -> Any:
    """``out[..., k::step] = value`` into a row of _empty_like's: every step-th symbol from k, as
    _slice_row reads the same columns (head by head). Returns the row after the store (a new one:
    a value read before the store keeps what it read)."""
    store = strided_store(node)
    if store is None:
        raise _Unsupported(f"{node.name} stores into other than every step-th column of the last dim")
    _, start, step, _ = store
    heads = isinstance(out, _Heads)
    if heads != isinstance(value, _Heads) or (heads and len(out) != len(value)):
        raise _Unsupported(f"{node.name} stores a value split into heads otherwise than its target")
    stored = []
    for row, part in (zip(out, value) if heads else [(out, value)]):
        if not isinstance(row, _Unwritten):
            raise _Unsupported(f"{node.name} stores into a value that is not an empty tensor's")
        if _structured(part) or len(row) % step or len(row[start::step]) != len(part):
            raise _Unsupported(f"{node.name} stores {len(part)} symbols into every {step}th of {len(row)}")
        row = _Unwritten(row)
        row[start::step] = part
        stored.append(row)
    return _Heads(stored) if heads else stored[0]


def _written(value: Any, name: str) -> Any:
    """``value`` as a row read: an empty tensor's only once every column is stored."""
    rows = value if isinstance(value, _Heads) else [value]
    if any(isinstance(row, _Unwritten) and None in row for row in rows):
        raise _Unsupported(f"{name} reads columns of an empty tensor that no store wrote")
    return value


def _flattened(node: fx.Node, c, value: Any) -> Any:
    """``flatten(start, end)``: dims before the last keep each row; the last two of groups
    interleave them back into one row."""
    ndim = len(node_shape(c["input"]) or ())
    if not ndim:
        raise _Unsupported(f"{node.name} flattens a value of unknown rank")
    start, end = c["start_dim"] % ndim, c["end_dim"] % ndim
    if end != ndim - 1 or start == end:
        if isinstance(value, _Groups):
            raise _Unsupported(f"{node.name} flattens pairs other than into the last dim")
        return value
    if start == ndim - 2 and (isinstance(value, _Groups) or isinstance(value, _Heads) and
                              all(isinstance(h, _Groups) for h in value)):
        return _per_head(value, _interleaved)
    raise _Unsupported(f"{node.name} flattens dims {start}..{end} into the last")


def _interleaved(groups: "_Groups") -> list:
    """(..., n, k) flattened to (..., n * k): the groups one after the other."""
    return [v for group in groups for v in group]


def _slice_row(node: fx.Node, c, row: list) -> list:
    """``x[..., a:b:step]`` of a row whose ``len(row)`` symbols stand for the value's last dim of
    ``width`` columns: the block a:b of it, every step-th symbol of it, when its bounds fall on
    symbols (of each head). The rows are the same program on a narrower value: a step of 2 takes
    every other column there as here (GPT-J's x[..., ::2], x[..., 1::2])."""
    if isinstance(row, _Heads):
        return _Heads(_slice_row(node, c, head) for head in row)
    if _structured(row):
        raise _Unsupported(f"{node.name} slices a row of pairs")
    width = (node_shape(c["input"]) or (None,))[-1]
    start, end, step = c["start"], c["end"], c["step"] or 1
    if not isinstance(width, int) or not width:
        raise _Unsupported(f"{node.name} slices a row of unknown width")
    ndim = len(node_shape(c["input"]) or ())
    if list(c["dim"]) not in ([-1], [ndim - 1]) or not isinstance(step, int) or step < 1 \
            or not all(b is None or isinstance(b, int) for b in (start, end)):
        raise _Unsupported(f"{node.name} is not a slice of the last dim with constant bounds")
    start = 0 if start is None else max(start + width, 0) if start < 0 else min(start, width)
    end = width if end is None else max(end + width, 0) if end < 0 else min(end, width)
    if step > 1:  # every step-th column of the whole row: the same columns of the narrower row
        if start >= step or end != width or len(row) % step:
            raise _Unsupported(f"{node.name} takes columns {start}:{end}:{step} of {width}: not a residue class of "
                               f"a row of {len(row)} symbols")
        return row[start::step]
    lo, hi = start * len(row), end * len(row)
    if lo % width or hi % width:
        raise _Unsupported(f"{node.name} slices columns {start}:{end} of {width}, not whole symbols of a row of "
                           f"{len(row)}")
    return row[lo // width:hi // width]


def _bound(bound: Any, val) -> Any:
    """A clamp's bound: a number, or the one value of a one-element tensor the graph computes
    (vLLM's ``1 / (qmax * 512)``)."""
    if not isinstance(bound, fx.Node):
        return bound
    value = val(bound)
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _max_values(node: fx.Node) -> bool:
    """A max over a dim returning (values, indices), which TUPLE_SPELLINGS reads as an amax."""
    try:
        return node.op in ("call_function", "call_method") and TUPLE_SPELLINGS.get(node.target) == ("amax",)
    except TypeError:  # unhashable target
        return False


def _activation(name: str, v: Any) -> Any:
    """silu(v) = v * sigmoid(v), sigmoid(v) = 1 / (1 + exp(-v)), in exact arithmetic."""
    sigmoid = 1 / (1 + sympy.exp(-v))
    return v * sigmoid if name == "silu" else sigmoid


def _max(*args: Any) -> Any:
    """Max unevaluated: sympy's simplification of Max compares its arguments symbolically, which
    takes seconds on a norm's expressions; both sides build it the same way, and the random
    points evaluate it."""
    return sympy.Max(*args, evaluate=False)


def _clamp(row: list, low: Any, high: Any, eps: float | None = None, eps_sym=None) -> list:
    if low is not None:
        row = _elementwise(lambda v: _max(v, _const(low, eps, eps_sym)), row)
    if high is not None:
        row = _elementwise(lambda v: sympy.Min(v, _const(high, eps, eps_sym), evaluate=False), row)
    return row


# the row operations a fusion part's symbolic form is written with
_ROW_OPS = SimpleNamespace(elementwise=_elementwise, mul=operator.mul, add=operator.add, mask=_MASK,
                          activation=_activation, max=_max, clamp=lambda row, low, high: _clamp(row, low, high),
                          abs=sympy.Abs, rational=sympy.Rational, unsupported=_Unsupported)


def _part_read(pair: SitePair, role: str, leaf: Any) -> Any:
    """The row a call argument holds: a complex value's real or imaginary parts when the rewrite
    took one of them (freqs_cis.real / .imag as cos / sin), by the rewritten node itself."""
    if not isinstance(leaf, _Complex):
        return leaf
    taken = pair.call.kwargs.get(role)
    target = getattr(taken, "target", None) if isinstance(taken, fx.Node) else None
    if target not in (torch.real, torch.imag):
        raise _Unsupported(f"the fused call's {role} reads a complex value whole")
    return [part[0 if target is torch.real else 1] for part in leaf]


def _leaf(node: fx.Node, name: str, hidden: int | None, layout: tuple[int, ...] | None = None,
          heads: _HeadRows | None = None) -> list:
    if node_dtype(node) is not None and node_dtype(node).is_complex:  # (real, imaginary) symbols
        re, im = (_leaf_row(node, f"{name}_{part}", hidden, layout, heads) for part in ("re", "im"))
        return _Complex(zip(re, im))
    return _leaf_row(node, name, hidden, layout, heads)


def _leaf_row(node: fx.Node, name: str, hidden: int | None, layout: tuple[int, ...] | None = None,
              heads: _HeadRows | None = None) -> list:
    shape = node_shape(node)
    if layout is not None and shape and len(shape) == len(layout):
        shape = tuple(shape[d] for d in layout)  # the row the call reads is along the permuted last dim
    last = shape[-1] if shape else 1
    if heads is None and hidden is not None and last == hidden:
        return _row(name, ROW)
    if last == 1:
        return _row(name, 1)
    if heads is not None and isinstance(last, int) and heads.symbols(last):
        return _row(name, heads.symbols(last))
    raise _Unsupported(f"input {node.name} of shape {shape} is neither a row of the hidden size nor a scalar")


def _source(node: fx.Node, inside: set, transposes: bool = False) -> fx.Node:
    """The value ``node`` holds in exact arithmetic: through the casts, identity dropouts and
    row-keeping views between it and the node they read, stopping at the subgraph. A model
    may cast outside a norm's subgraph (Mamba: ``norm(h.to(norm.weight.dtype))``) while the
    fused call reads the uncast value; both are one row of symbols (the rounding of the
    cast is the numeric check's business)."""
    while node not in inside:
        c = canonical(node)
        # (a slice of positions keeps each row: a RoPE split over a cat reads its table's rows so)
        if c is None or c.prim not in ("cast", "dropout", "view", "transpose", "unsqueeze", "slice") \
                or not isinstance(c["input"], fx.Node):
            return node
        if c.prim == "unsqueeze" and _touches_last(node, *(c["dim"] if isinstance(c["dim"], (list, tuple))
                                                              else (c["dim"],))):
            return node  # a new last dim: the row is another one
        # a transpose keeps each row only for a call that reads the value before it
        # (Fusion.reads_transposed); elsewhere it stays a value of its own, so a call reading
        # the untransposed value is refuted
        if c.prim == "transpose" and (not transposes or _touches_last(node, c["dim0"], c["dim1"])):
            return node
        if c.prim == "view" and (node_shape(node) or (None,))[-1:] != (node_shape(c["input"]) or (None,))[-1:]:
            return node  # a view that changes the row is not the same row
        if c.prim == "slice" and _touches_last(node, *c["dim"]):
            return node  # columns taken: another row
        node = c["input"]
    return node


# --------------------------------------------------------------------------- the fused formula

def _fused(pair: SitePair, rows: dict[str, Any], eps_sym, eps: float | None) -> list:
    """The fused call's outputs by its fusion's formula (``Fusion.formula``, from the defining
    formulas of normfuse/kernels/), in the order the call returns them."""
    kw = pair.call.kwargs
    fusion = fusion_of(fused_op_name(pair.call))
    kind = fusion.norm_kind(kw)
    w, b = rows["weight"], rows["bias"]
    offset = _const(float(kw.get("weight_offset", 0.0)), None, None) if w is not None else 0
    e = _const(float(kw["eps"]), eps, eps_sym)

    def normalize(value, weight=w, bias=b):  # the call's norm of a row (a second norm: its own parameters)
        return _norm(kind, value, weight, bias, e, offset, pair.site.hidden_size)

    return fusion.formula(kw, rows, normalize, _ROW_OPS)


# --------------------------------------------------------------------------- equality

def _radicals_to_symbols(exprs: list) -> tuple[list, list[tuple[Any, Any]]]:
    """base**(k/2) -> t**k with one positive symbol t per distinct expanded base."""
    table: dict[Any, Any] = {}

    def is_half_power(e):
        return e.is_Pow and e.exp.is_Rational and e.exp.q == 2

    def sub(e):
        key = sympy.expand(e.base)
        t = table.setdefault(key, sympy.Symbol(f"t{len(table)}", positive=True))
        return t ** e.exp.p

    out = [e.replace(is_half_power, sub) if isinstance(e, sympy.Basic) else e for e in exprs]
    return out, [(t, base) for base, t in table.items()]


def _algebraic_zero(diff, relations) -> str | None:
    num = sympy.expand(sympy.numer(sympy.together(diff)))
    if num == 0:
        return "algebra"
    for t, base in relations:
        num = sympy.expand(sympy.rem(num, t ** 2 - base, t))
        if num == 0:
            return "algebra (t^2 = base)"
    return None


def _random_point(symbols, rng: random.Random) -> dict:
    point = {}
    for s in symbols:
        if s.name.startswith("eps"):
            point[s] = sympy.Rational(rng.randint(1, 9), 1000)
        else:
            point[s] = sympy.Rational(rng.randint(-40, 40), rng.randint(1, 9))
    return point


def _decide(lhs, rhs, rng: random.Random) -> tuple[str, str, str | None]:
    """(status, method, detail) for lhs == rhs."""
    (l2, r2), relations = _radicals_to_symbols([lhs, rhs])
    method = None
    difference = l2 - r2
    if difference == 0:
        method = "algebra"
    elif not difference.has(sympy.Max, sympy.Min, sympy.Abs):
        # Max / Min / Abs (an fp8 scale, a clamp) are not polynomial: equal ones cancel above,
        # others go to the points
        method = _algebraic_zero(difference, relations)
    if method:
        return "proved", method, None
    diff = lhs - rhs
    # every symbol of both sides: one may cancel in the difference and still scale lhs
    symbols = sorted(sympy.sympify(lhs).free_symbols | sympy.sympify(rhs).free_symbols, key=lambda s: s.name)
    for _ in range(_POINTS):
        point = _random_point(symbols, rng)
        value = sympy.N(diff.xreplace(point), 40)
        scale = abs(sympy.N(sympy.sympify(lhs).xreplace(point), 40)) + 1
        if abs(value) > sympy.Float("1e-25") * scale:
            shown = ", ".join(f"{k}={v}" for k, v in list(point.items())[:6])
            return "refuted", "random rational points", f"differ by {sympy.N(value, 6)} at {shown}"
    return "proved", "random rational points", "simplify could not decide; equal at random rational points"


# the symbols of each argument of the fused call: x0..x3, r0..r3, ...
_SYMBOL_PREFIX = {"x": "x", "residual": "r", "weight": "w", "bias": "b",
                  **{role: p for step in STEPS for role, p in step.roles.items()}}


def prove_site(pair: SitePair, seed: int = 0, equal: dict[fx.Node, fx.Node] | None = None) -> SymbolicResult:
    """Prove (or refute) that the fused call computes what its original subgraph computed (``equal``:
    ``representatives`` of the original graph, computed here when not given)."""
    if pair.site.converted:
        return SymbolicResult("unsupported", detail="converted from Post-Norm to Pre-Norm: changes the function "
                                                    "by design")
    if pair.problem:
        return SymbolicResult("unsupported", detail=pair.problem)
    hidden = pair.site.hidden_size
    transposes = fusion_of(fused_op_name(pair.call)).reads_transposed(pair.call.kwargs)
    eps_sym = sympy.Symbol("eps", positive=True)
    inside = set(pair.nodes)
    rep = representatives(pair.nodes[0].graph) if equal is None and pair.nodes else equal or {}

    def same(node: fx.Node) -> fx.Node:  # the node standing for its value among equal ones
        return rep.get(node, node)
    try:
        heads = _head_rows(pair)
        leaves: dict[fx.Node, Any] = {}   # keyed by source (see _source): a value and its casts share symbols
        rows: dict[str, Any] = {}
        for role, node in pair.args.items():
            if node is None:
                rows[role] = None
            elif isinstance(node, fx.Node):
                source = _source(node, inside, transposes)
                if same(source) not in leaves:
                    leaves[same(source)] = _leaf(source, _SYMBOL_PREFIX[role], hidden, pair.layout, heads)
                rows[role] = _part_read(pair, role, leaves[same(source)])
            else:
                raise _Unsupported(f"the fused call's {role} is a constant {node!r}")
        unread: dict[fx.Node, str] = {}  # inputs that are no row, an error only if the subgraph reads their values
        for i, node in enumerate(pair.inputs):  # values the original reads that the call does not
            source = _source(node, inside, transposes)
            if same(source) not in leaves and source not in inside:
                try:
                    leaves[same(source)] = _leaf(source, f"z{i}_", hidden, pair.layout, heads)
                except _Unsupported as why:  # e.g. the dtype source of a type_as (Cosmos: ``.type_as(hidden_states)``)
                    unread[same(source)] = str(why)
        values: dict[fx.Node, Any] = {}

        def load(n, unwritten=False):  # (unwritten: a store reads the empty tensor it writes into)
            if n in values:
                return values[n] if unwritten else _written(values[n], n.name)
            source = _source(n, inside, transposes)
            if source in values:
                return values[source] if unwritten else _written(values[source], n.name)
            if same(source) in leaves:
                return leaves[same(source)]
            raise _Unsupported(unread.get(same(source), f"{n.name} is read by the subgraph but is outside it"))

        for node in pair.nodes:
            values[node] = _eval_node(node, load, pair.eps, eps_sym, heads)
            if node.op == "call_function" and node.target is operator.setitem:  # the target after the store
                values[node.args[0]], values[node] = values[node], None
        rows["heads"] = heads
        fused = _fused(pair, rows, eps_sym, pair.eps)
    except _Unsupported as why:
        return SymbolicResult("unsupported", detail=str(why))
    try:
        return _prove_outputs(pair, values, fused, random.Random(seed))
    except Exception as error:  # noqa: BLE001 - a proof that cannot be decided is not a check failure
        return SymbolicResult("unsupported", detail=f"the proof could not be decided ({type(error).__name__}: "
                                                    f"{str(error)[:120]})")


def representatives(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """node -> the earlier node computing the same value (canonical.common_subexpressions): a leaf
    read through either (``freqs_cos[..., 0::2]`` taken once for q and once for k) is one set of
    symbols. Computed once per graph by the caller of prove_site."""
    return common_subexpressions(graph, canonicalize(graph))


def _flat(value: Any) -> Any:
    """A value split into heads as one row, heads in order."""
    return [v for head in value for v in head] if isinstance(value, _Heads) else value


def _prove_outputs(pair: SitePair, values: dict, fused: list, rng: random.Random) -> SymbolicResult:
    methods = []
    for k, orig in pair.outputs:
        want, got = _flat(values[orig]), _flat(fused[k])
        if not isinstance(want, list) or len(want) != len(got):
            return SymbolicResult("unsupported", detail=f"{orig.name} is not a row of the hidden size")
        for i, (a, b) in enumerate(zip(want, got)):
            status, method, detail = _decide(a, b, rng)
            if status != "proved":
                return SymbolicResult(status, method, f"{orig.name}[{i}]: {detail}")
            methods.append(method)
    method = "random rational points" if "random rational points" in methods else (
        "algebra (t^2 = base)" if "algebra (t^2 = base)" in methods else "algebra")
    return SymbolicResult("proved", method, None if method.startswith("algebra") else
                          "simplify could not decide; equal at random rational points")

