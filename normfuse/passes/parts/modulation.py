"""The adaLN modulation of a norm's output, a fusion part: ``norm(s) * scale + shift``.

Diffusion transformers (DiT, PixArt, SD3, Flux, Wan, CogVideoX, LTX, HunyuanVideo, Sana, ...)
modulate every norm's output with a scale and a shift computed from the timestep::

    norm_hidden_states = self.norm2(hidden_states)
    norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]

and its spellings: the factor first (``(1 + scale) * n + shift``), ``torch.addcmul(shift, n, 1 +
scale)`` (one rounding), scale only (x-transformers' adaptive norms, and a norm without affine
followed by its weight: ``LayerNorm(d, elementwise_affine=False)(x) * gamma``), shift only, and
Wan's ``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` (fp32 steps, one cast). Eagerly that
is two more passes over the row; the fused call takes it (``mod_scale`` is the factor as the
graph computed it, ``1 + scale`` included; the rounding points are ``Modulation``'s:
``normfuse.kernels.reference.modulate``).

``find_modulation(index, match)`` reads the norm's one reader; ``MODULATION`` is the part: an
add_norm call (or a plain norm's) whose y nothing else changes takes it.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.specs import Modulation
from normfuse.passes.canonical import (broadcasts_to, is_exact_upcast, mutates, node_dtype, node_shape, real_users,
                                       same_dim, same_shape)
from normfuse.passes.graph import GraphIndex, copy_meta
from normfuse.passes.parts.base import CallPiece, FusionPart
from normfuse.vocabulary import KERNEL_DTYPES, LOW_PRECISION

__all__ = ["ModulationMatch", "find_modulation", "MODULATION"]


@dataclass(frozen=True)
class ModulationMatch:
    """The modulation of one norm's output, as the fused call's options."""

    scale: fx.Node | None                # the factor y is multiplied by (``1 + scale`` as the graph has it)
    shift: fx.Node | None
    dtype: torch.dtype                   # what the product and the sum round to
    fused: bool                          # addcmul: one rounding of the product and the sum
    out_dtype: torch.dtype               # the modulated output's dtype (a cast after it: Wan's type_as)
    steps: tuple[fx.Node, ...]           # the casts that change no value before it, the product, the sum
    cast: fx.Node | None = None          # the cast after it
    times: int = 1                       # modulations of the one y (SD3.5's AdaLayerNormZeroX: two)
    reason: str | None = None            # found, but the call cannot take it
    second: ModulationMatch | None = None  # the second modulation of the same y, the call's y1
    factor: fx.Node | None = None        # the graph's ``1 + scale`` the call computes (scale: its scale)

    @property
    def output(self) -> fx.Node:
        """The node the call's y replaces."""
        return self.cast if self.cast is not None else self.steps[-1]

    @property
    def nodes(self) -> tuple[fx.Node, ...]:
        mine = (*self.steps, *(() if self.cast is None else (self.cast,)),
                *(() if self.factor is None else (self.factor,)))
        return mine if self.second is None else (*mine, *self.second.nodes)

    @property
    def operands(self) -> tuple[Any, ...]:
        """scale and shift, then the second modulation's."""
        return (self.scale, self.shift) + (() if self.second is None else (self.second.scale, self.second.shift))

    def spec(self, scale: Any, shift: Any, scale1: Any = None, shift1: Any = None) -> Modulation:
        """The kernel-facing argument group with the operands as the call reads them."""
        return Modulation(scale, shift, self.dtype, self.fused, self.out_dtype if self.out_dtype != self.dtype else None,
                          scale1, shift1, self.factor is not None)

    def without_shift(self) -> ModulationMatch:
        """The product alone, its add left to the graph (not for addcmul)."""
        return dataclasses.replace(self, shift=None, fused=False, out_dtype=self.dtype, steps=self.steps[:-1],
                                   cast=None)

    def describe(self) -> str:
        factor = "(1 + scale)" if self.factor is not None else "scale"
        steps = "addcmul" if self.fused else " ".join(
            step for step, on in ((f"* {factor}", self.scale is not None), ("+ shift", self.shift is not None)) if on)
        cast = f", then {self.out_dtype}" if self.out_dtype != self.dtype else ""
        times = f", {self.times} times" if self.times > 1 else ""  # (the second: the same steps)
        return f"y {steps} in {self.dtype}{cast}{times}".replace("torch.", "")


def _broadcasts_to(operand: Any, y: fx.Node, smaller: bool) -> bool:
    """``operand`` is a tensor of at least one dim that broadcasts to y's shape without widening y
    (and, with ``smaller``, has fewer elements: a stream of y's size is another value's add)."""
    a, b = node_shape(operand) if isinstance(operand, fx.Node) else None, node_shape(y)
    if not a or not broadcasts_to(a, b) or node_dtype(operand) not in KERNEL_DTYPES:
        return False
    padded = (1,) * (len(b) - len(a)) + tuple(a)
    return not smaller or any(same_dim(d, 1) and not same_dim(e, 1) for d, e in zip(padded, b))


def _other(c, value: fx.Node, names: tuple[str, str]) -> Any:
    """The operand of ``c`` that is not ``value`` (None when neither or both are)."""
    first, second = (c[name] for name in names)
    if first is value and second is not value:
        return second
    if second is value and first is not value:
        return first
    return None


def _only_reader(node: fx.Node) -> fx.Node | None:
    readers = real_users(node)
    return readers[0] if len(readers) == 1 else None


def _steps(index: GraphIndex, y: fx.Node, first: fx.Node | None) -> tuple[Any, Any, bool, list[fx.Node]]:
    """(scale, shift, fused, nodes) of the modulation ``first`` starts on y; nodes empty when it starts none."""
    c = index.canon(first) if first is not None else None
    if c is None:
        return None, None, False, []
    if c.prim == "addcmul" and c["value"] == 1 and _broadcasts_to(c["input"], y, smaller=False):
        scale = _other(c, y, ("tensor1", "tensor2"))
        return (scale, c["input"], True, [first]) if _broadcasts_to(scale, y, smaller=False) else (None, None, False, [])
    if c.prim == "mul":
        scale = _other(c, y, ("input", "other"))
        if not _broadcasts_to(scale, y, smaller=False):
            return None, None, False, []
        after = _only_reader(first)
        a = index.canon(after) if after is not None else None
        if a is not None and a.prim == "add" and a["alpha"] == 1:
            shift = _other(a, first, ("input", "other"))
            if _broadcasts_to(shift, y, smaller=False) and node_dtype(after) == node_dtype(first):
                return scale, shift, False, [first, after]
        return scale, None, False, [first]
    if c.prim == "add" and c["alpha"] == 1:  # shift only: a value that broadcasts (a stream's add is not one)
        shift = _other(c, y, ("input", "other"))
        return (None, shift, False, [first]) if _broadcasts_to(shift, y, smaller=True) else (None, None, False, [])
    return None, None, False, []


def _token_slice(index: GraphIndex, node: fx.Node) -> bool:
    """``y[:, a:b]``: a slice of y along a dim before the last (a segment of the tokens)."""
    c = index.canon(node)
    if c is None or c.prim != "slice":
        return False
    ndim = len(node_shape(node) or ())
    dims = c["dim"] if isinstance(c["dim"], (list, tuple)) else [c["dim"]]
    return ndim > 0 and all(isinstance(d, int) and d % ndim != ndim - 1 for d in dims)


def find_modulation(index: GraphIndex, match) -> ModulationMatch | None:
    """The modulation of a matched norm's output (see the module docstring), or None: each step
    rounds to the dtype eager's type promotion gives it, so the call rounds where eager does."""
    y, casts, rounded = match.output, [], None
    # casts that change no value between the norm and the product (FP32LayerNorm's .to(float32)), or
    # one that rounds an fp32 norm's output to 16 bits (FP32LayerNorm's .to(x.dtype) in a bf16
    # model: the call rounds y to the modulation's dtype before the product, so that must be it)
    while (reader := _only_reader(y)) is not None and index.prim(reader) == "cast":
        if rounded is None and is_exact_upcast(node_dtype(y), node_dtype(reader)):
            pass
        elif not casts and node_dtype(y) == torch.float32 and node_dtype(reader) in LOW_PRECISION:
            rounded = node_dtype(reader)
        else:
            break
        y = reader
        casts.append(reader)
    readers = real_users(y)
    segments = [r for r in readers if _token_slice(index, r)]
    if len(readers) > 1 and len(segments) == len(readers):  # HunyuanVideo's token_replace: y[:, :F], y[:, F:]
        found = [st for st in (_steps(index, r, _only_reader(r)) for r in segments) if st[3]]
        if len(found) != len(segments):
            return None
        scale, shift, fused, nodes = found[0]
        return ModulationMatch(scale, shift, node_dtype(nodes[-1]), fused, node_dtype(nodes[-1]), tuple(nodes),
                               times=len(found), reason=f"the norm's output is modulated per segment of tokens "
                               f"({len(found)} slices along the positions, each with its own scale and shift: "
                               "HunyuanVideo's token_replace): the call modulates every row with one")
    if len(readers) > 1:  # several modulations of one y: the call returns two, as y and y1
        found = [_modulation(index, y, r, []) for r in readers]
        if any(f is None for f in found) or len(found) < 2:
            return None
        first, second = found[0], found[1]
        if (first.factor is None) != (second.factor is None):  # 1 + a beside 2 + b: both factors as operands
            first, second = (dataclasses.replace(m, scale=m.factor, factor=None) if m.factor is not None else m
                             for m in (first, second))
        if len(found) > 2:
            reason = f"the norm's output is modulated {len(found)} times: the call returns two modulated outputs"
        elif casts:
            reason = "the norm's output is cast before its two modulations: the call modulates the norm's y"
        elif _modes(first) != _modes(second):
            reason = ("the norm's output is modulated twice with different steps (scale or shift, rounding): the "
                      "call's second modulation takes the steps of the first")
        else:
            return dataclasses.replace(first, times=2, second=second)
        return dataclasses.replace(first, times=len(found), reason=reason)
    found = _modulation(index, y, _only_reader(y), casts)
    if found is None and len(readers) == 1 and index.prim(readers[0]) == "view":
        # SANA-WM's ``norm2(x).reshape(B, frames, -1, C) * (1 + scale) + shift``, a scale per frame
        viewed = readers[0]
        while (reader := _only_reader(viewed)) is not None and index.prim(reader) == "view":
            viewed = reader
        found = _modulation(index, viewed, _only_reader(viewed), [])
        if found is not None:
            shape = tuple(node_shape(viewed) or ())
            return dataclasses.replace(found, reason=f"the norm's output is viewed to {shape} before its modulation: "
                                                     "the call modulates the rows of y as the norm gives them")
    if found is not None and rounded is not None and found.dtype != rounded:
        return dataclasses.replace(found, reason=f"the norm's output is rounded to {rounded} before a modulation "
                                                 f"in {found.dtype}: the call rounds y to the modulation's dtype")
    return found


def _modes(m: ModulationMatch) -> tuple:
    """What two modulations of one y must share to be one call's y and y1."""
    return m.scale is None, m.shift is None, m.dtype, m.fused, m.out_dtype, m.factor is None


def _one_plus(index: GraphIndex, factor: Any) -> tuple[Any, fx.Node | None]:
    """(scale, the add) when ``factor`` is the graph's ``1 + scale`` (either order), read by the product
    only, in scale's dtype and shape: the call computes it (a per-token one is a pass of its own);
    (factor, None) otherwise."""
    c = index.canon(factor) if isinstance(factor, fx.Node) else None
    if c is None or c.prim != "add" or c["alpha"] != 1 or len(real_users(factor)) != 1 or mutates(factor):
        return factor, None  # (an in-place ``scale += 1`` stays: something may read scale after it)
    a, b = c["input"], c["other"]
    scale = b if _is_one(a) else a if _is_one(b) else None
    if not isinstance(scale, fx.Node) or node_dtype(scale) != node_dtype(factor) \
            or not same_shape(node_shape(scale), node_shape(factor)):
        return factor, None
    return scale, factor


def _is_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def _modulation(index: GraphIndex, y: fx.Node, first: fx.Node | None, casts: list) -> ModulationMatch | None:
    """The modulation that ``first``, a reader of y, starts (after ``casts`` of y that change no
    value), or None: each step rounds to the dtype eager's type promotion gives it."""
    factor, shift, fused, nodes = _steps(index, y, first)
    if not nodes:
        return None
    scale, one_plus = _one_plus(index, factor)
    nodes = [*casts, *nodes]
    dtype = node_dtype(nodes[-1])
    promoted = node_dtype(y)
    for t in (scale, shift):
        promoted = promoted if t is None else torch.promote_types(promoted, node_dtype(t))
    if dtype not in KERNEL_DTYPES or dtype != promoted or any(node_dtype(n) != dtype for n in nodes[len(casts):]):
        return None  # a python scalar or a 0-dim operand promotes otherwise; not a modulation of the row
    out = _only_reader(nodes[-1])
    if out is not None and index.prim(out) == "cast" and node_dtype(out) in KERNEL_DTYPES:
        return ModulationMatch(scale, shift, dtype, fused, node_dtype(out), tuple(nodes), out, factor=one_plus)
    return ModulationMatch(scale, shift, dtype, fused, dtype, tuple(nodes), factor=one_plus)


def _per_column(t: Any, ndim: int) -> bool:
    """An operand with one value per column (or none) of at most ``ndim`` dims: it broadcasts alike against
    any view of y of ``ndim`` dims that keeps the last dim."""
    shape = node_shape(t) if isinstance(t, fx.Node) else ()
    return t is None or shape is not None and len(shape) <= ndim and all(same_dim(d, 1) for d in shape[:-1])


class _Modulation(FusionPart):
    name = "modulation"
    exclusive = True  # y is modulated: no second norm shares the call, no linear recomputes y
    roles = {"mod_scale": "ms", "mod_shift": "mh", "mod1_scale": "ms1_", "mod1_shift": "mh1_"}
    operand_name = "the modulation's scale and shift"
    joins_gated_branch = True  # the adaLN block tail: gated branch, add, norm, modulation

    def find(self, index: GraphIndex, match, in_add=None) -> ModulationMatch | None:
        return find_modulation(index, match)

    def offer(self, ctx, site, found: ModulationMatch | None, plan) -> tuple[ModulationMatch | None, str | None]:
        if found is None:
            return None, None
        if found.reason is not None:
            return None, found.reason
        if not ctx.config.fuse_modulation:
            return None, "modulations are not fused (fuse_modulation=False)"
        if ctx.as_op:
            return None, "Inductor's post-grad pass does not write the modulated call (use backend=\"normfuse\" or optimize)"
        if plan.op not in ("norm", "add_norm"):
            return None, "the norm's output goes into the add after it in the same call (norm_add)"
        if plan.permute is not None:
            return None, "the call reads its operands permuted (a channel norm): the modulation reads rows of y"
        if plan.exclusive or site.match.group is not None:
            return None, "a gated or grouped norm: the call does not modulate its output"
        rows = node_shape(site.in_add.node) if plan.op == "add_norm" else node_shape(site.match.output)
        y = node_shape(site.match.output)
        if rows is None or y is None or not same_shape(rows, y) and not all(_per_column(t, len(rows))
                                                                            for t in found.operands):
            # (Kandinsky 5: the add on (B, N, C), its sum viewed to (B, T, H, W, C), a scale of (B, 1, 1, 1, C))
            return None, f"the call computes in the add's shape {tuple(rows or ())} and y is viewed to " \
                         f"{tuple(y or ())} after it: the scale and shift broadcast against the view"
        if found.second is not None and any(m.shift is not None and m.steps[-1] in ctx.reserved
                                            for m in (found, found.second)):
            return None, "a shift of the two modulations is the residual stream that the next norm's call adds"
        if found.shift is not None and found.steps[-1] in ctx.reserved:
            # "+ shift" is a residual add another norm reads its sum from (Z-Image's x + g * norm(a)):
            # that norm's call takes the add with its stream; this call takes the product only
            if found.scale is None or found.fused:
                return None, "the shift is the residual stream that the next norm's call adds"
            found = found.without_shift()
        return found, None

    def may_drop(self, found: ModulationMatch) -> bool:
        return True  # the call without it: the modulation stays in the graph

    def reads(self, found: ModulationMatch) -> tuple[fx.Node, ...]:
        return tuple(t for t in found.operands if isinstance(t, fx.Node))

    def nodes(self, found: ModulationMatch) -> tuple[fx.Node, ...]:
        return found.nodes

    def call(self, found: ModulationMatch, rewriting) -> CallPiece:
        return CallPiece(found.spec(*(rewriting.resolve(t) for t in found.operands)).kernel_args())

    def y_output(self, found: ModulationMatch, y: fx.Node) -> fx.Node:
        return found.output

    def added_outputs(self, found: ModulationMatch) -> tuple[fx.Node, ...]:
        return () if found.second is None else (found.second.output,)

    def outputs(self, found: ModulationMatch, rewriting, call: fx.Node, kernel_shape: tuple, where: dict[str, int]):
        """The second modulation's output: the call's y1."""
        if found.second is None:
            return [], []
        y1 = rewriting.graph.call_function(operator.getitem, (call, where["y1"]))
        copy_meta(y1, found.second.output)
        rewriting.replace(found.second.output, y1)
        return [y1], [(where["y1"], found.second.output)]

    def report(self, record, found: ModulationMatch, fused: bool, reason: str | None) -> None:
        record.modulation = found.describe()
        record.fused_modulation = fused
        record.modulation_reason = None if fused else reason

    def eager_nodes(self, found: ModulationMatch) -> tuple[fx.Node, ...]:
        return found.nodes

    def fused_bytes(self, found: ModulationMatch, y_bytes: int, size) -> tuple[int, int]:
        """Forward: the kernels' epilogue reads scale and shift (y is stored modulated,
        kernels/triton.py). Backward: the kernels' backward reads scale and shift again and writes
        their gradients (per sample: a partial row per program, summed; per token: a row per row).
        A second modulation runs around the kernels' backward: the norm's input read again to rebuild
        y, the gradients into y and y1 written and read, the gradients of the scales and shifts written."""
        operands = sum(size.bytes(t) for t in found.operands if isinstance(t, fx.Node))
        if found.second is None:
            return operands, 2 * operands
        # the second modulation: y1 written; its gradient read and added to y's (written, read once more)
        return operands + y_bytes, 5 * y_bytes + 2 * operands

    # ---------------------------------------------------------------- checker
    def uses(self, options: dict) -> bool:
        return options.get("mod_scale") is not None or options.get("mod_shift") is not None

    def symbolic(self, options: dict, rows: dict, s: list, norm, ops) -> dict[str, list]:
        """y = norm(s) * scale + shift (either may be absent), y1 the same with scale1 and shift1, s as it is."""
        n = norm(s)

        def modulated(scale, shift):
            if scale is not None and options.get("mod_one_plus"):
                scale = ops.elementwise(lambda v: 1 + v, scale)
            y = n if scale is None else ops.elementwise(ops.mul, n, scale)
            return y if shift is None else ops.elementwise(ops.add, y, shift)
        out = {"y": modulated(rows.get("mod_scale"), rows.get("mod_shift")), "s": s}
        if options.get("mod1_scale") is not None or options.get("mod1_shift") is not None:
            out["y1"] = modulated(rows.get("mod1_scale"), rows.get("mod1_shift"))
        return out


MODULATION = _Modulation()
