"""The quantization of a norm's output, a fusion part: the fp8 epilogue a fused call takes over.

A linear that reads fp8 needs the norm's output ``y`` quantized: a scale (static, or from
the amax of each row or group of y), y divided (or multiplied) by it, clamped to the fp8
range and cast. Written out in the graph it reads y back from memory right after the norm
wrote it; the fused call computes it from the value it still holds (the steps and their
rounding points: ``normfuse.kernels.reference``, "Quantization epilogue").

``find_quant(index, y)`` reads, on the canonical view, these spellings of it::

    ys    = y.float() | y | either viewed as (..., N // G, G) or (M, N)   # the value quantized
    amax  = ys.abs().amax(-1, keepdim=True) [.float()] [.clamp(min=a)]
            (max(-1, keepdim=True)[0] / .values, torch.max: the same amax; keepdim=False
            with the dim put back later, x[:, None], unsqueeze(-1): vLLM's reference)
    scale = amax / qmax | qmax / amax (Python: 1/amax * qmax) | amax.reciprocal() * qmax
            [.clamp(min=m)]                       # or a static scale: a graph input / buffer
            (computed in fp64 from the exact upcast of the amax, then rounded to fp32:
            torchao's amax_to_scale)
    v     = ys / scale | ys * scale | ys * scale.reciprocal() (or 1 / scale)
    q     = v [.clamp(-c, c)] .to(float8_e4m3fn | float8_e5m2)

The amax is read by a rule, not a list of spellings: an exact upcast (``canonical.is_exact_upcast``)
changes no value, so abs, neg, max and a clamp by a constant give the same values on either
side of it (a clamp before the upcast clamps to the constant as the 16-bit dtype holds it). The
numbers may be tensors the graph builds from numbers (``torch.as_tensor(448.0)``, ``1 / (qmax *
512)``): they are evaluated as the graph computes them.

and returns a ``QuantMatch``: the call's quantization options, the nodes it replaces (the
cast giving q, and the scale node the graph reads on), or why the quantization cannot be
taken over (``reason``). A norm whose output is not cast to fp8 has no match (None).

``QUANT`` is the part: the call returns q and the scale as well (y only while something else
reads it), and the graph's cast and scale read those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import operator

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.errors import InvalidOptionError
from normfuse.kernels.reference import quant_max, quantize
from normfuse.kernels.specs import Fp8Quant
from normfuse.passes.canonical import is_exact_upcast, node_dtype, node_shape, real_users, same_shape, tensor_meta
from normfuse.passes.find import const_value, strip_upcasts, upcasts
from normfuse.passes.graph import GraphIndex, copy_meta
from normfuse.passes.parts.base import CallPiece, FusionPart
from normfuse.vocabulary import QUANT_DTYPES

__all__ = ["QuantMatch", "find_quant", "QUANT"]

F32, F64 = torch.float32, torch.float64
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

    def spec(self, scale: Any = None) -> Fp8Quant:
        """The kernel-facing argument group (``normfuse.kernels.specs.Fp8Quant``), with ``scale``
        the static scale the call reads (None: dynamic). Raises InvalidOptionError for options the
        epilogue does not take together."""
        return Fp8Quant(self.dtype, scale, self.group, self.scale_form, self.amax_min, self.scale_min, self.apply,
                        self.clamp)

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


# What a number the graph builds from numbers may be made of (vLLM's reference writes its
# constants as torch.as_tensor(448.0, dtype=torch.float32) and computes 1 / (qmax * 512) of them)
_CONSTANT_MAKERS = (torch.as_tensor, torch.tensor, torch.scalar_tensor)
_CONSTANT_PRIMS = ("cast", "view", "mul", "div", "add", "sub", "reciprocal", "neg")


def _attribute_constant(node: fx.Node) -> torch.Tensor | None:
    """The tensor a get_attr node reads when it is a constant of the graph, a plain attribute
    (torch.export lifts the tensors a forward builds, torch.as_tensor(448.0), into these); not a
    parameter or a buffer, which a user may change."""
    owner, *path, name = [node.graph.owning_module, *str(node.target).split(".")]
    try:
        for part in path:
            owner = getattr(owner, part)
        value = getattr(owner, name)
    except AttributeError:
        return None
    if not isinstance(value, torch.Tensor) or isinstance(value, nn.Parameter) or value.is_meta \
            or name in getattr(owner, "_buffers", {}):
        return None
    return value.detach().cpu()


def _run(node: fx.Node, value) -> Any:
    """Run one node on CPU with its node arguments replaced by ``value(arg)``."""
    args = fx.node.map_arg(node.args, value)
    kwargs = {k: ("cpu" if k == "device" else fx.node.map_arg(v, value)) for k, v in node.kwargs.items()}
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


class _Reader:
    """Walks one norm output's quantization on the canonical view."""

    def __init__(self, index: GraphIndex, y: fx.Node):
        self.index, self.y = index, y
        self.nodes: list[fx.Node] = []
        self.sources: set[fx.Node] = set()  # the upcasts and views of y it reads (others may read them too)
        self.constants: dict[fx.Node, torch.Tensor] = {}  # numbers the graph builds (others may read them too)
        self.unsqueezed: fx.Node | None = None  # the scale's unsqueeze of an amax without keepdim
        self.dtype: torch.dtype | None = None   # the fp8 dtype

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
        if cols == width:  # the rows of y, maybe with the leading dims flattened (vLLM's 2-D view)
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

    def number(self, value: Any) -> float | None:
        """A number the graph computes with: a Python number, or a one-element tensor the graph
        builds from numbers, evaluated as the graph computes it (the nodes are taken along)."""
        if const_value(value) is not None:
            return const_value(value)
        tensor = self.constant(value)
        if tensor is None or tensor.dtype.is_complex:
            return None
        return float(tensor.reshape(()))

    def constant(self, node: Any, depth: int = 0) -> torch.Tensor | None:
        if not isinstance(node, fx.Node) or depth > _SEARCH_DEPTH:
            return None
        if node in self.constants:
            return self.constants[node]
        if node.op == "get_attr":
            value = _attribute_constant(node)
        elif node.op in ("call_function", "call_method"):
            maker = node.op == "call_function" and node.target in _CONSTANT_MAKERS
            if not maker and self.prim(node) not in _CONSTANT_PRIMS or any(
                    self.constant(a, depth + 1) is None for a in node.all_input_nodes):
                return None
            try:
                value = _run(node, self.constants.__getitem__)
            except Exception:  # noqa: BLE001 - a call that does not run on CPU numbers is no constant
                return None
        else:
            return None
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return None
        self.constants[node] = value
        return value

    def reciprocal_of(self, node: Any) -> fx.Node | None:
        """s when ``node`` is 1 / s: ``s.reciprocal()``, or 1 divided by s (a Python 1 is a
        reciprocal times 1, a one-element 1 one IEEE division: both the correctly rounded 1 / s)."""
        c = self.canon(node)
        if c is not None and c.prim == "reciprocal":
            return c["input"]
        if c is not None and c.prim == "div" and self.number(c["input"]) == 1.0 and isinstance(c["other"], fx.Node):
            return c["other"]
        return None

    def skip(self, node: Any) -> Any:
        """Past the steps that leave a scale's values as they are: exact upcasts (same dtype
        included), and the one unsqueeze putting back the dim an amax without keepdim dropped."""
        while True:
            node, casts = upcasts(self.index, node)
            for cast in casts:
                self.take(cast)
            c = self.canon(node)
            if c is None or c.prim != "unsqueeze" or self.unsqueezed is not None:
                return node
            before, after = node_shape(c["input"]), node_shape(node)
            if before is None or after != (*before, 1):
                raise _Refused(f"{node.name} adds a dim of size 1 elsewhere than after the last dim")
            self.unsqueezed = self.take(node)
            node = c["input"]

    def floor(self, node: fx.Node, c) -> float:
        """The fp32 floor the epilogue applies to |y|'s amax for the graph's ``clamp(amax, min=m)``
        computed in the clamp's dtype."""
        m, dtype = self.number(c["min"]), node_dtype(node)
        if dtype == F32:
            return m
        if dtype in (torch.float16, torch.bfloat16):
            # clamped before the upcast: to m as the 16-bit dtype holds it (an exact fp32 value)
            return float(torch.tensor(m, dtype=dtype))
        raise _Refused(f"the amax is clamped in {dtype}")

    def wide_floor(self, clamp: fx.Node, scale: fx.Node, m: float, found: dict[str, Any]) -> None:
        """An amax floored in fp64 (torchao: clamp(amax.double(), min=1e-12)) where the epilogue
        floors in fp32: every row's scale agrees except, maybe, those whose amax is below m, whose
        scale comes from m as fp64 holds it in the graph and as fp32 holds it in the epilogue.
        Those two are computed here, each as its side computes it; they must be equal."""
        values = {clamp: torch.tensor([m], dtype=F64)}
        order, node = [], scale
        while node is not clamp:
            order.append(node)
            node = next(a for a in node.all_input_nodes if a is clamp or self.index.is_ancestor(clamp, a))
        try:
            for node in reversed(order):
                values[node] = _run(node, lambda a: values.get(a, self.constants.get(a)))
        except Exception as error:  # noqa: BLE001 - then its scale cannot be compared: refused
            raise _Refused(f"the amax is floored at {m:g} in float64, and the scale of a row below it could not "
                           f"be computed here ({type(error).__name__})") from None
        graph = values[scale].to(F32)
        epilogue = quantize(torch.zeros(1, 1), self.dtype, None, None, found["scale_form"], m, None, "div", None,
                            "scale")[1]
        if not torch.equal(graph.reshape(-1), epilogue.reshape(-1)):
            raise _Refused(f"the amax is floored at {m:g} in float64: a row below it gets the scale "
                           f"{graph.item():.9g}, the epilogue (flooring in fp32) {epilogue.item():.9g}")

    def magnitude(self, node: Any) -> tuple[fx.Node, list[fx.Node]] | None:
        """(X, the steps) when ``node`` is |X| through abs, neg and exact upcasts in any order under
        its outer abs (|-v| = |v| = ||v||, and |upcast(v)| = upcast(|v|)); None otherwise."""
        node, steps = upcasts(self.index, node)
        if self.prim(node) != "abs":
            return None
        while self.prim(node) in ("abs", "neg"):
            steps.append(node)
            below, casts = upcasts(self.index, self.canon(node)["input"])
            if self.prim(below) not in ("abs", "neg"):
                return self.canon(node)["input"], steps  # its upcasts of y are read as the value's path
            steps += casts
            node = below
        return None

    def dynamic_scale(self, scale: fx.Node, values: fx.Node, qmax: float) -> dict[str, Any]:
        """The options of a scale computed from the amax of ``values``."""
        found: dict[str, Any] = {}
        self.unsqueezed = None
        node = self.skip(scale)
        c = self.canon(node)
        if c is not None and c.prim == "clamp" and c["max"] is None and self.number(c["min"]) is not None:
            if node_dtype(node) != F32:
                raise _Refused(f"the scale is clamped in {node_dtype(node)}; the epilogue computes it in fp32")
            found["scale_min"] = self.number(c["min"])
            self.take(node)
            node = self.skip(c["input"])
            c = self.canon(node)
        wide = c is not None and c.prim == "cast" and node_dtype(node) == F32 and node_dtype(c["input"]) == F64
        top = node
        if wide:  # torchao: the scale computed in fp64, then rounded to fp32
            self.take(node)
            node = self.skip(c["input"])
            c = self.canon(node)
        if c is None or node_dtype(node) != (F64 if wide else F32):
            raise _Refused(f"the scale {getattr(node, 'name', node)} is not an fp32 value computed from an amax")
        amax, number = None, None
        if c.prim == "div" and self.number(c["other"]) is not None:
            found["scale_form"], amax, number = "amax/max", c["input"], self.number(c["other"])
        elif c.prim == "div" and const_value(c["input"]) is not None:
            # Python's ``qmax / amax`` (Tensor.__rtruediv__) is a reciprocal, then a multiply
            found["scale_form"], amax, number = "max*(1/amax)", c["other"], const_value(c["input"])
        elif c.prim == "div" and self.number(c["input"]) is not None:  # a one-element qmax: one division
            found["scale_form"], amax, number = "max/amax", c["other"], self.number(c["input"])
        elif c.prim == "mul":
            a, b = c["input"], c["other"]
            number_side, other = (a, b) if self.number(a) is not None else (b, a)
            if self.number(number_side) is not None and self.reciprocal_of(other) is not None:
                found["scale_form"], number = "max*(1/amax)", self.number(number_side)
                amax = self.reciprocal_of(self.take(other))
        if amax is None:
            raise _Refused(f"the scale {node.name} is not amax / qmax, qmax / amax or amax.reciprocal() * qmax")
        if number != qmax:
            raise _Refused(f"the scale divides by {number:g}, not by the fp8 dtype's largest value {qmax:g}")
        if wide and found["scale_form"] != "amax/max":
            # fp64's quotient of an fp32 amax a and q = 7 * 2^k (one division, or Python's
            # reciprocal and multiply: within 2^-52 of the exact one) rounds to fp32 as the exact
            # quotient does, which is never that near an fp32 rounding midpoint (q / a at least
            # 2^-49 away: a * midpoint has a 49-bit significand and cannot be q; a / q at least
            # 2^-28 away). So q / a is the epilogue's one fp32 division, and a / q its "amax/max"
            # (test_quant_spellings: every bf16 and fp16 amax and a million fp32 ones)
            found["scale_form"] = "max/amax"
        self.take(node)
        amax = self.skip(amax)
        c = self.canon(amax)
        if c is not None and c.prim == "clamp" and c["max"] is None and self.number(c["min"]) is not None:
            if node_dtype(amax) == F64:
                found["amax_min"] = self.number(c["min"])
                self.wide_floor(amax, top, found["amax_min"], found)
            else:
                found["amax_min"] = self.floor(amax, c)
            self.take(amax)
            amax = self.skip(c["input"])
            c = self.canon(amax)
        if c is None or c.prim != "amax":
            raise _Refused(f"the scale is not computed from the amax of |y| ({getattr(amax, 'name', amax)})")
        read = self.magnitude(c["input"])
        if read is None:
            raise _Refused(f"the scale is not computed from the amax of |y| ({amax.name} is not of an abs)")
        measured, steps = read
        ndim = len(node_shape(c["input"]) or ())
        dims = list(c["dim"]) if isinstance(c["dim"], (list, tuple)) else [c["dim"]]
        if dims not in ([-1], [ndim - 1]) or c["keepdim"] is not (self.unsqueezed is None):
            raise _Refused("the amax is not over the last dim with keepdim=True (a per-tensor amax is not "
                           "row-local: the kernel computes one scale per row or group)")
        group = self.rows_of(measured)  # takes its path
        if group is None or group != self.rows_of(values) or not same_shape(node_shape(measured), node_shape(values)):
            raise _Refused("the amax is taken of another value than the one divided by the scale")
        self.take(amax)
        if amax.op == "call_function" and amax.target is operator.getitem:  # max(..., dim)[0]
            self.take(amax.args[0])  # the max whose values it reads, and its indices if nothing reads them
            for item in real_users(amax.args[0]):
                if item.target is operator.getitem and not real_users(item):
                    self.take(item)
        for step in steps:
            self.take(step)
        return found

    # ------------------------------------------------------------------ the whole epilogue

    def read(self, cast: fx.Node) -> QuantMatch:
        dtype = self.dtype = node_dtype(cast)
        qmax = quant_max(dtype)
        found: dict[str, Any] = {"dtype": dtype, "q": cast}
        if getattr(tensor_meta(cast), "requires_grad", False):
            raise _Refused("the graph differentiates through the quantization (autograd records the cast to fp8); "
                           "the epilogue's q is not differentiable: fused in graphs captured without grad "
                           "(inference, torch.no_grad)")
        v = self.canon(cast)["input"]
        c = self.canon(v) if isinstance(v, fx.Node) else None
        if c is not None and c.prim == "clamp":
            low, high = self.number(c["min"]), self.number(c["max"])
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
        inverted, casts = upcasts(self.index, scale)
        if c.prim == "mul" and self.reciprocal_of(inverted) is not None:
            found["apply"] = "mul_reciprocal"
            for node in (*casts, inverted):
                self.take(node)
            scale = self.reciprocal_of(inverted)
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
        for node in self.constants:  # erased with the rest where nothing else reads them
            self.take(node)
        inside = set(self.nodes)
        reads_y = any(u not in inside for n in (self.y, *self.sources) for u in real_users(n))
        return QuantMatch(**found, nodes=tuple(sorted(inside, key=self.index.order.__getitem__)), reads_y=reads_y)

    def check_readers(self, found: dict[str, Any]) -> None:
        """Only the cast and the scale are read outside the epilogue: the call computes the rest."""
        inside = set(self.nodes)
        for node in self.nodes:
            if node in (found["q"], found.get("scale_node")) or node in self.sources or node in self.constants:
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


# --------------------------------------------------------------------------- the part

def _fp32_scale(graph: fx.Graph, scale: fx.Node | None) -> fx.Node | None:
    """A static scale as the kernel takes it, fp32 (the graph's division upcasts a 16-bit one, exactly)."""
    if scale is None or node_dtype(scale) == F32:
        return scale
    upcast = graph.call_method("to", (scale, F32))
    for key in ("val", "example_value"):
        if isinstance(scale.meta.get(key), torch.Tensor):
            upcast.meta[key] = scale.meta[key].to(F32)
    return upcast


def _reshaped(graph: fx.Graph, value: fx.Node, like: fx.Node, shape: tuple) -> fx.Node:
    """``value`` (the call's output, of ``shape``) in the shape of the node it replaces."""
    if same_shape(node_shape(like), tuple(shape)):
        copy_meta(value, like)
        return value
    for key in ("val", "example_value"):
        if isinstance(like.meta.get(key), torch.Tensor):
            value.meta[key] = like.meta[key].reshape(shape)
    out = graph.call_method("reshape", (value, *node_shape(like)))
    copy_meta(out, like)
    return out


class _Quant(FusionPart):
    name = "quant"
    roles = {"quant_scale": "qs"}
    operand_name = "the static scale"

    def find(self, index: GraphIndex, match, in_add=None) -> QuantMatch | None:
        return find_quant(index, match.output)

    def offer(self, ctx, site, found: QuantMatch | None, plan) -> tuple[QuantMatch | None, str | None]:
        if found is None:
            return None, None
        reason = self._refusal(ctx, site, found, plan)
        if reason is None:
            try:
                found.spec(found.static_scale)
            except InvalidOptionError as error:  # options the epilogue does not take together
                reason = str(error)
        return (found, None) if reason is None else (None, reason)

    def _refusal(self, ctx, site, found: QuantMatch, plan) -> str | None:
        if found.reason:
            return found.reason
        if not ctx.config.fuse_quant:
            return "quantizations are not fused (fuse_quant=False)"
        if ctx.as_op:
            return "Inductor's post-grad pass does not write the fp8 epilogue (use backend=\"normfuse\" or optimize)"
        if plan.op == "norm_add":
            return "the norm's output goes into the add after it in the same call (norm_add): no epilogue there"
        if plan.permute is not None:
            return "the call reads its operands permuted (a channel norm): the epilogue quantizes rows of y"
        if plan.exclusive or site.match.group is not None:
            return "a gated, modulated or grouped norm: the epilogue does not quantize its output"
        return None

    def reads(self, found: QuantMatch) -> tuple[fx.Node, ...]:
        return (found.static_scale,) if found.static_scale is not None else ()

    def nodes(self, found: QuantMatch) -> tuple[fx.Node, ...]:
        return found.nodes

    def may_drop(self, found: QuantMatch) -> bool:
        return found.static_scale is not None  # the call without the static scale's late operand

    def call(self, found: QuantMatch, rewriting) -> CallPiece:
        scale = _fp32_scale(rewriting.graph, rewriting.resolve(found.static_scale))
        piece = CallPiece(dict(found.spec(scale).kernel_args(), return_norm=found.reads_y))
        if scale is not None and scale is not found.static_scale:
            piece.inserted.append(scale)
            piece.holds[scale] = found.static_scale
        return piece

    def y_read(self, found: QuantMatch) -> bool:
        return found.reads_y

    def outputs(self, found: QuantMatch, rewriting, call: fx.Node, kernel_shape: tuple, where: dict[str, int]
                ) -> tuple[list[fx.Node], list[tuple[int, fx.Node]]]:
        """The graph's fp8 cast and its dynamic scale replaced by the call's q and scale."""
        from normfuse.kernels.reference import quant_scale_shape

        graph, inserted = rewriting.graph, []
        q = graph.call_function(operator.getitem, (call, where["q"]))
        inserted.append(q)
        q_out = _reshaped(graph, q, found.q, kernel_shape)
        inserted += [q_out] if q_out is not q else []
        rewriting.replace(found.q, q_out)
        stands_for = [(where["q"], found.q)]
        if found.scale_node is not None:
            scale = graph.call_function(operator.getitem, (call, where["scale"]))
            inserted.append(scale)
            scale_out = _reshaped(graph, scale, found.scale_node, quant_scale_shape(kernel_shape, found.group))
            inserted += [scale_out] if scale_out is not scale else []
            rewriting.replace(found.scale_node, scale_out)
            stands_for.append((where["scale"], found.scale_node))
        return inserted, stands_for

    def report(self, record, found: QuantMatch, fused: bool, reason: str | None) -> None:
        record.quant = found.describe()
        record.fused_quant = fused
        if not fused and reason is not None:
            record.quant_reason = reason

    def eager_nodes(self, found: QuantMatch) -> tuple[fx.Node, ...]:
        return found.nodes  # eager reads y back to quantize it

    def fused_bytes(self, found: QuantMatch, y_bytes: int, size) -> tuple[int, int]:
        """q (one byte an element) and a dynamic scale written; y only while still read. No
        backward: a quantized value has no gradient."""
        scale = size.bytes(found.scale_node) if found.scale_node is not None else 0
        return size.numel(found.q) * found.dtype.itemsize + scale - (0 if found.reads_y else y_bytes), 0

    def uses(self, options: dict) -> bool:
        return options.get("quant_dtype") is not None

    def symbolic(self, options: dict, rows: dict, s: list, norm, ops) -> dict[str, list] | None:
        """q and the scale in exact arithmetic: the casts are identities, the clamps and the amax
        are Max/Min. A row of symbols stands for one row, or for one group of a grouped scale."""
        y = norm(s)
        qmax = ops.rational(quant_max(options["quant_dtype"]))
        if rows.get("quant_scale") is not None:
            scale = rows["quant_scale"][0]
        else:
            amax = ops.clamp([ops.max(*[ops.abs(v) for v in y])], options.get("quant_amax_min"), None)[0]
            scale = amax / qmax if options.get("quant_scale_form", "amax/max") == "amax/max" else qmax / amax
            scale = ops.clamp([scale], options.get("quant_scale_min"), None)[0]
        apply = options.get("quant_apply", "div")
        v = [yv / scale if apply == "div" else yv * scale if apply == "mul" else yv * (1 / scale) for yv in y]
        clamp = options.get("quant_clamp")
        q = ops.clamp(v, -clamp, clamp) if clamp is not None else v
        out = scale if options.get("quant_scale_out", "scale") == "scale" else 1 / scale
        return {"q": q, "scale": [out], "y": y, "s": s}

    def check_arguments(self, options: dict, x) -> None:
        if options.get("quant_scale") is not None:  # the kernel takes a static scale in fp32 (an exact upcast)
            options["quant_scale"] = options["quant_scale"].float()


QUANT = _Quant()
