"""Find the quantization of a norm's output: the fp8 epilogue a fused call can take over.

A linear that reads fp8 needs the norm's output ``y`` quantized: a scale (static, or from
the amax of each row or group of y), y divided (or multiplied) by it, clamped to the fp8
range and cast. Written out in the graph it reads y back from memory right after the norm
wrote it; the fused call computes it from the value it still holds (the steps and their
rounding points: ``normfuse.kernels.reference``, "Quantization epilogue").

``find_quant(index, match)`` reads, on the canonical view, these spellings of it::

    ys    = y.float() | y | either viewed as (..., N // G, G)      # the value quantized
    amax  = ys.abs().amax(-1, keepdim=True) [.float()] [.clamp(min=a)]
    scale = amax / qmax | qmax / amax (Python: 1/amax * qmax) | amax.reciprocal() * qmax
            [.clamp(min=m)]                       # or a static scale: a graph input / buffer
    v     = ys / scale | ys * scale | ys * scale.reciprocal()
    q     = v [.clamp(-c, c)] .to(float8_e4m3fn | float8_e5m2)

and returns a ``QuantMatch``: the call's quantization options, the nodes it replaces (the
cast giving q, and the scale node the graph reads on), or why the quantization cannot be
taken over (``reason``). A norm whose output is not cast to fp8 has no match (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.reference import quant_max
from normfuse.passes.canonical import is_exact_upcast, node_dtype, node_shape, real_users, tensor_meta
from normfuse.passes.find import const_value, strip_upcasts, upcasts
from normfuse.passes.graph import GraphIndex
from normfuse.vocabulary import QUANT_DTYPES

__all__ = ["QuantMatch", "find_quant"]

F32 = torch.float32
_SEARCH_DEPTH = 8  # nodes between y and its fp8 cast that are still read as its quantization


@dataclass(frozen=True)
class QuantMatch:
    """The quantization of one norm's output, as the fused call's options."""

    dtype: torch.dtype | None = None
    q: fx.Node | None = None               # the cast to fp8: the call's q replaces it
    scale_node: fx.Node | None = None      # dynamic: the scale the graph divides by (or multiplies by)
    static_scale: fx.Node | None = None    # static: the scale tensor the graph passes in
    group: int | None = None               # columns per scale (None: one per row)
    scale_form: str = "amax/max"
    amax_min: float | None = None
    scale_min: float | None = None
    apply: str = "div"
    clamp: float | None = None
    nodes: tuple[fx.Node, ...] = ()        # every node of the quantization, graph order
    reads_y: bool = False                  # y (or an upcast or view of it) is read outside it too
    reason: str | None = None              # why the call cannot take it over

    def options(self) -> dict[str, Any]:
        """The fused call's quantization options (``normfuse.kernels.add_norm``)."""
        return dict(quant_dtype=self.dtype, quant_scale=self.static_scale, quant_group=self.group,
                    quant_scale_form=self.scale_form, quant_amax_min=self.amax_min, quant_scale_min=self.scale_min,
                    quant_apply=self.apply, quant_clamp=self.clamp)

    def describe(self) -> str:
        """What the report says of it, e.g. "float8_e4m3fn, dynamic per row"."""
        if self.q is None:
            return "fp8, inside torchao's float8 linear"
        name = str(self.dtype).removeprefix("torch.")
        if self.reason is not None:
            return f"{name}, in a spelling the epilogue does not compute"
        if self.static_scale is not None:
            return f"{name}, static per-tensor scale"
        return f"{name}, dynamic per row" if self.group is None else f"{name}, dynamic per group of {self.group}"


class _Refused(Exception):
    """The fp8 cast is there, but the way to it is not one the epilogue computes."""


class _Reader:
    """Walks one norm output's quantization on the canonical view."""

    def __init__(self, index: GraphIndex, y: fx.Node):
        self.index, self.y = index, y
        self.nodes: list[fx.Node] = []
        self.sources: set[fx.Node] = set()  # the upcasts and views of y it reads (others may read them too)

    def prim(self, node: Any) -> str | None:
        return self.index.prim(node) if isinstance(node, fx.Node) else None

    def canon(self, node: fx.Node):
        return self.index.canon(node)

    def take(self, node: fx.Node) -> fx.Node:
        if node not in self.nodes:
            self.nodes.append(node)
        return node

    # ------------------------------------------------------------------ the value quantized

    def rows_of(self, node: Any) -> int | None:
        """``node`` holds y's values (through exact upcasts and views): the columns per row of
        it (N, or a group G dividing N); None when it does not."""
        path = []
        while isinstance(node, fx.Node) and node is not self.y:
            c = self.canon(node)
            if c is None or c.prim not in ("cast", "view") or not isinstance(c["input"], fx.Node):
                return None
            if c.prim == "cast" and not is_exact_upcast(node_dtype(c["input"]), node_dtype(node)):
                return None
            path.append(node)
            node = c["input"]
        if node is not self.y:
            return None
        shape, n = node_shape(path[0] if path else self.y), node_shape(self.y)
        if shape is None or n is None or not all(isinstance(d, int) for d in (*shape, *n)):
            raise _Refused("the shape of the value quantized is not static")
        cols, width = shape[-1], n[-1]
        if cols == width and tuple(shape[:-1]) == tuple(n[:-1]):
            group = width
        elif cols < width and width % cols == 0 and (cols & (cols - 1)) == 0:
            group = cols
        else:
            raise _Refused(f"the value quantized has rows of {cols} columns, neither the norm's {width} nor a "
                           f"power-of-two group of them")
        for node in path:
            self.take(node)
        self.sources.update(path)
        return group

    # ------------------------------------------------------------------ the scale

    def dynamic_scale(self, scale: fx.Node, values: fx.Node, qmax: float) -> dict[str, Any]:
        """The options of a scale computed from the amax of ``values``."""
        found: dict[str, Any] = {}
        c = self.canon(scale)
        if c is not None and c.prim == "clamp" and c["max"] is None and const_value(c["min"]) is not None:
            found["scale_min"] = const_value(c["min"])
            self.take(scale)
            scale = c["input"]
            c = self.canon(scale)
        if c is None or node_dtype(scale) != F32:
            raise _Refused(f"the scale {getattr(scale, 'name', scale)} is not an fp32 value computed from an amax")
        amax, number = None, None
        if c.prim == "div" and const_value(c["other"]) is not None:
            found["scale_form"], amax, number = "amax/max", c["input"], const_value(c["other"])
        elif c.prim == "div" and const_value(c["input"]) is not None:
            # Python's ``qmax / amax`` (Tensor.__rtruediv__) is a reciprocal, then a multiply
            found["scale_form"], amax, number = "max*(1/amax)", c["other"], const_value(c["input"])
        elif c.prim == "mul":
            a, b = c["input"], c["other"]
            number_side, other = (a, b) if const_value(a) is not None else (b, a)
            if const_value(number_side) is not None and self.prim(other) == "reciprocal":
                found["scale_form"], number = "max*(1/amax)", const_value(number_side)
                amax = self.canon(self.take(other))["input"]
        if amax is None:
            raise _Refused(f"the scale {scale.name} is not amax / qmax, qmax / amax or amax.reciprocal() * qmax")
        if number != qmax:
            raise _Refused(f"the scale divides by {number:g}, not by the fp8 dtype's largest value {qmax:g}")
        self.take(scale)
        c = self.canon(amax) if isinstance(amax, fx.Node) else None
        if c is not None and c.prim == "clamp" and c["max"] is None and const_value(c["min"]) is not None:
            found["amax_min"] = const_value(c["min"])
            self.take(amax)
            amax = c["input"]
        amax, casts = upcasts(self.index, amax)  # an amax of the 16-bit y, upcast: exact either way
        for cast in casts:
            self.take(cast)
        c = self.canon(amax) if isinstance(amax, fx.Node) else None
        if c is None or c.prim != "amax" or self.prim(c["input"]) != "abs":
            raise _Refused(f"the scale is not computed from the amax of |y| ({getattr(amax, 'name', amax)})")
        ndim = len(node_shape(amax) or ())
        dims = list(c["dim"]) if isinstance(c["dim"], (list, tuple)) else [c["dim"]]
        if dims not in ([-1], [ndim - 1]) or c["keepdim"] is not True:
            raise _Refused("the amax is not over the last dim with keepdim=True (a per-tensor amax is not "
                           "row-local: the kernel computes one scale per row or group)")
        absolute = c["input"]
        measured = self.canon(absolute)["input"]
        if not self.index.same(measured, values) or self.rows_of(measured) is None:  # rows_of takes its path
            raise _Refused("the amax is taken of another value than the one divided by the scale")
        self.take(amax)
        self.take(absolute)
        return found

    # ------------------------------------------------------------------ the whole epilogue

    def read(self, cast: fx.Node) -> QuantMatch:
        dtype = node_dtype(cast)
        qmax = quant_max(dtype)
        found: dict[str, Any] = {"dtype": dtype, "q": cast}
        if getattr(tensor_meta(cast), "requires_grad", False):
            raise _Refused("the graph differentiates through the quantization (autograd records the cast to fp8); "
                           "the epilogue's q is not differentiable: fused in graphs captured without grad "
                           "(inference, torch.no_grad)")
        v = self.canon(cast)["input"]
        c = self.canon(v) if isinstance(v, fx.Node) else None
        if c is not None and c.prim == "clamp":
            low, high = const_value(c["min"]), const_value(c["max"])
            if low is None or high is None or low != -high or high <= 0:
                raise _Refused(f"the clamp before the cast is not symmetric, [-c, c] ({c['min']}, {c['max']})")
            found["clamp"] = high
            self.take(v)
            v = c["input"]
            c = self.canon(v) if isinstance(v, fx.Node) else None
        if c is None or c.prim not in ("div", "mul"):
            raise _Refused("the value cast to fp8 is not the norm output divided or multiplied by a scale")
        if node_dtype(v) != F32:
            raise _Refused(f"the graph scales y in {node_dtype(v)}; the epilogue computes fp32(y) / scale in fp32")
        values, scale = c["input"], c["other"]
        if c.prim == "mul" and self.rows_of(values) is None:
            values, scale = scale, values
        columns = self.rows_of(values)
        if columns is None:
            raise _Refused("the value cast to fp8 is not computed from the norm output")
        found["group"] = None if columns == node_shape(self.y)[-1] else columns
        found["apply"] = "div" if c.prim == "div" else "mul"
        self.take(v)
        if c.prim == "mul" and self.prim(scale) == "reciprocal":
            found["apply"] = "mul_reciprocal"
            scale = self.canon(self.take(scale))["input"]
        given = strip_upcasts(self.index, scale)  # a buffer's .float(): the graph keeps it, the call reads the buffer
        if isinstance(given, fx.Node) and given.op in ("placeholder", "get_attr"):
            scale = given
            meta = tensor_meta(scale)
            if not isinstance(meta, torch.Tensor) or meta.numel() != 1 or not is_exact_upcast(meta.dtype, F32):
                raise _Refused(f"the static scale {scale.name} is not a 1-element float tensor fp32 holds exactly")
            if found["group"] is not None:
                raise _Refused("a static scale with the values viewed in groups")
            found["static_scale"] = scale
        elif isinstance(scale, fx.Node):
            found.update(self.dynamic_scale(scale, values, qmax))
            found["scale_node"] = scale
        else:
            raise _Refused(f"the scale is the constant {scale!r}, not a tensor")
        self.take(cast)
        self.check_readers(found)
        inside = set(self.nodes)
        reads_y = any(u not in inside for n in (self.y, *self.sources) for u in real_users(n))
        return QuantMatch(**found, nodes=tuple(sorted(inside, key=self.index.order.__getitem__)), reads_y=reads_y)

    def check_readers(self, found: dict[str, Any]) -> None:
        """Only the cast and the scale are read outside the epilogue: the call computes the rest."""
        inside = set(self.nodes)
        for node in self.nodes:
            if node in (found["q"], found.get("scale_node")) or node in self.sources:
                continue
            if any(u not in inside for u in real_users(node)):
                raise _Refused(f"the graph reads {node.name}, a step of the quantization, elsewhere")


def _fp8_casts(index: GraphIndex, y: fx.Node) -> list[fx.Node]:
    """The casts to an fp8 dtype reached from y through elementwise steps, nearest first."""
    seen, frontier, casts = {y}, [y], []
    for _ in range(_SEARCH_DEPTH):
        following = []
        for node in frontier:
            for user in real_users(node):
                if user in seen or index.prim(user) not in ("cast", "view", "div", "mul", "clamp", "reciprocal"):
                    continue
                seen.add(user)
                if index.prim(user) == "cast" and node_dtype(user) in QUANT_DTYPES:
                    casts.append(user)
                else:
                    following.append(user)
        frontier = following
    return casts


def _opaque_quantizer(y: fx.Node) -> fx.Node | None:
    """A reader of y that quantizes it out of the graph's sight: torchao's float8 training linear
    reaches a dynamo graph as one ``autograd.Function`` call taking y and torchao's configs."""
    for user in real_users(y):
        if user.op != "call_function":
            continue
        owners = [getattr(a.target, "__module__", None) or "" for a in user.all_input_nodes if a.op == "call_function"]
        if any(owner.startswith("torchao.float8") for owner in owners):
            return user
    return None


def find_quant(index: GraphIndex, y: fx.Node) -> QuantMatch | None:
    """The quantization of the norm output ``y`` (see the module docstring), or None when y is
    not quantized. More than one cast of y to fp8 (two linears quantizing it their own way) is
    refused: the call writes one q."""
    casts = _fp8_casts(index, y)
    if not casts:
        opaque = _opaque_quantizer(y)
        if opaque is None:
            return None
        return QuantMatch(reason=f"torchao's float8 linear ({opaque.name}) takes the norm output as it is and "
                                 "quantizes it inside its autograd.Function, out of the graph: the quantization "
                                 "stays in torchao")
    if len(casts) > 1:
        return QuantMatch(dtype=node_dtype(casts[0]), q=casts[0],
                          reason=f"y is cast to fp8 {len(casts)} times ({', '.join(c.name for c in casts)}); "
                                 "the call writes one quantized output")
    try:
        return _Reader(index, y).read(casts[0])
    except _Refused as refused:
        return QuantMatch(dtype=node_dtype(casts[0]), q=casts[0], reason=str(refused))
