"""Canonicalize: one table from every spelling of a primitive to its canonical form.

Dynamo's torch-level graphs, ``torch.export`` ATen graphs and post-grad graphs spell
the same primitive many ways (``operator.add``, ``torch.add``, ``Tensor.add``,
``iadd``, ``aten.add.Tensor``; ``.to(dtype)``, ``.float()``, ``aten._to_copy``, ...).
Every matcher reads the canonical view built here and never looks at a raw target.
Adding a spelling is one line in ``SPELLINGS``.

The view does not change the graph: ``canonicalize(graph)`` returns a dict
``node -> Canon`` for the nodes whose target is in the table.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from normfuse.vocabulary import LOW_PRECISION, TORCH_NORMS

__all__ = ["real_users", "mutates", "is_check_only", "Canon", "canonicalize", "canonical", "common_subexpressions", "SPELLINGS", "PARAMS", "tensor_meta", "node_dtype",
           "node_shape", "dim_value", "same_dim", "same_shape", "broadcasts_to", "last_dim", "is_exact_upcast", "is_split_piece",
           "unbound_dim", "strided_store", "one_dim", "dim_named"]

aten = torch.ops.aten
prims = torch.ops.prims


def _aten(*names: str) -> list:
    """ATen overloads by 'op.overload' name, skipping those this torch build lacks."""
    found = []
    for name in names:
        op_name, _, overload = name.partition(".")
        packet = getattr(aten, op_name, None)
        if packet is not None and hasattr(packet, overload or "default"):
            found.append(getattr(packet, overload or "default"))
    return found


# Canonical primitive -> its parameter names (how positional args and kwargs are bound).
PARAMS: dict[str, tuple[str, ...]] = {
    "add": ("input", "other", "alpha"),
    "sub": ("input", "other", "alpha"),
    "mul": ("input", "other"),
    "div": ("input", "other"),
    "pow": ("input", "exponent"),
    "square": ("input",),
    "rsqrt": ("input",),
    "sqrt": ("input",),
    "reciprocal": ("input",),
    "mean": ("input", "dim", "keepdim"),
    "sum": ("input", "dim", "keepdim"),
    "einsum": ("equation", "operands"),  # the operands as one tuple (varargs, or ATen's list)
    "var": ("input", "dim", "unbiased", "keepdim"),
    "cast": ("input",),  # the target dtype is read off the node's output metadata
    "view": ("input",),  # reshapes, views, contiguous, clone: same values, maybe another shape
    "permute": ("input", "dims"),  # same values, dims reordered (channels-first <-> channels-last)
    "dropout": ("input", "p", "training"),
    "layer_norm": ("input", "normalized_shape", "weight", "bias", "eps"),
    "rms_norm": ("input", "normalized_shape", "weight", "eps"),
    "linear": ("input", "weight", "bias"),
    "normalize": ("input", "p", "dim", "eps"),  # F.normalize: x / max(||x||_p, eps) over dim
    # read by fusion parts (passes/parts/): amax and clamps of an fp8 scale
    "abs": ("input",),
    "amax": ("input", "dim", "keepdim"),
    "clamp": ("input", "min", "max"),
    "neg": ("input",),
    "unsqueeze": ("input", "dim"),  # a new dim of size 1: x.unsqueeze(d), x[:, None], x[..., None]
    # ... the rotary embedding after q/k norms (fusions/qk_norm_rope.py): halves, rotate_half's cat, heads transpose
    "slice": ("input", "dim", "start", "end", "step"),  # x[..., a:b], aten.slice
    "cat": ("tensors", "dim"),
    "stack": ("tensors", "dim"),  # GPT-J's rotation written out: stack((-x[..., 1::2], x[..., ::2]), -1)
    "transpose": ("input", "dim0", "dim1"),
    # ... torchtitan's complex RoPE: (B, S, H, D) -> (B, S, H, D/2) complex pairs, times freqs_cis, back
    "flatten": ("input", "start_dim", "end_dim"),
    "view_as_complex": ("input",),
    "view_as_real": ("input",),
    # ... and torchtitan's cache gathered at given positions (pure: a table the call reads may move up)
    "expand": ("input", "size"),
    "gather": ("input", "dim", "index"),
    "index": ("input", "indices"),  # x[idx] with a tensor idx (one position per row of the cache)
    "squeeze": ("input", "dim"),
    # ... and activations (passes/parts/)
    "silu": ("input",),
    "tanh": ("input",),  # ... and the elementwise norm replacements (DynamicTanh, Derf): listed, not sites
    "erf": ("input",),
    "sigmoid": ("input",),
    # ... and adaLN's fused multiply-add: input + value * tensor1 * tensor2
    "addcmul": ("input", "tensor1", "tensor2", "value"),
}

# Canonical primitive -> every spelling of it: call_function targets (callables, ATen
# overloads) and call_method names (strings).
SPELLINGS: dict[str, list[Any]] = {
    "add": [operator.add, operator.iadd, torch.add, torch.Tensor.add, "add", "add_", "__add__", "__radd__",
            *_aten("add.Tensor", "add_.Tensor", "add.Scalar", "add_.Scalar")],
    "sub": [operator.sub, operator.isub, torch.sub, torch.Tensor.sub, "sub", "sub_", "__sub__",
            *_aten("sub.Tensor", "sub.Scalar")],
    "mul": [operator.mul, operator.imul, torch.mul, torch.Tensor.mul, "mul", "mul_", "__mul__", "__rmul__",
            *_aten("mul.Tensor", "mul_.Tensor", "mul.Scalar")],
    "div": [operator.truediv, operator.itruediv, torch.div, torch.true_divide, "div", "div_", "true_divide",
            "__truediv__", *_aten("div.Tensor", "div.Scalar")],
    "pow": [operator.pow, torch.pow, "pow", "__pow__", *_aten("pow.Tensor_Scalar")],
    "square": [torch.square, "square", *_aten("square.default")],
    "rsqrt": [torch.rsqrt, "rsqrt", *_aten("rsqrt.default")],
    "sqrt": [torch.sqrt, "sqrt", *_aten("sqrt.default")],
    "reciprocal": [torch.reciprocal, "reciprocal", *_aten("reciprocal.default")],
    "mean": [torch.mean, "mean", *_aten("mean.dim")],
    "sum": [torch.sum, "sum", *_aten("sum.dim_IntList")],
    "einsum": [torch.einsum, torch.functional.einsum, *_aten("einsum.default")],
    "var": [torch.var, "var", *_aten("var.correction", "var.dim")],
    "cast": ["to", "float", "half", "bfloat16", "double", "type", "type_as",
             *_aten("_to_copy.default", "to.dtype", "to.dtype_layout", "to.device", "type_as.default"),
             *([prims.convert_element_type.default] if hasattr(prims, "convert_element_type") else []),
             torch.as_tensor],  # of a tensor, with a dtype (vLLM's as_float32_tensor); of a number: a constant
    "view": ["view", "reshape", "contiguous", "clone", "view_as", "reshape_as", "unflatten", torch.reshape, torch.clone,
             torch.unflatten, *_aten("view.default", "reshape.default", "_unsafe_view.default", "clone.default",
                                     "alias.default", "unflatten.int"),
             *_aten("lift_fresh_copy.default")],  # torch.export's copy of a constant it lifted
    "permute": ["permute", torch.permute, *_aten("permute.default")],
    "dropout": [F.dropout, torch.dropout, "dropout", *_aten("dropout.default")],
    "layer_norm": [F.layer_norm, torch.layer_norm, *_aten("layer_norm.default", "native_layer_norm.default")],
    "linear": [F.linear, *_aten("linear.default")],
    "normalize": [F.normalize],
    "rms_norm": [F.rms_norm, *( [torch.rms_norm] if hasattr(torch, "rms_norm") else []),
                 *_aten("rms_norm.default", "_fused_rms_norm.default")],
    "abs": [torch.abs, "abs", *_aten("abs.default")],
    "amax": [torch.amax, "amax", *_aten("amax.default")],
    "clamp": [torch.clamp, torch.clip, "clamp", "clip", *_aten("clamp.default", "clamp_min.default",
                                                                  "clamp_max.default"),
              *_aten("clamp.Tensor", "clamp_min.Tensor", "clamp_max.Tensor")],  # bounds as tensors
    "neg": [torch.neg, operator.neg, "neg", "__neg__", *_aten("neg.default")],
    "unsqueeze": [torch.unsqueeze, "unsqueeze", *_aten("unsqueeze.default")],
    "slice": [*_aten("slice.Tensor")],  # the getitem spelling: canonical() reads its index
    "cat": [torch.cat, torch.concat, torch.concatenate, *_aten("cat.default")],
    "transpose": [torch.transpose, "transpose", *_aten("transpose.int")],
    "stack": [torch.stack, *_aten("stack.default")],
    "flatten": [torch.flatten, "flatten", *_aten("flatten.using_ints")],
    "view_as_complex": [torch.view_as_complex, *_aten("view_as_complex.default")],
    "view_as_real": [torch.view_as_real, *_aten("view_as_real.default")],
    "expand": ["expand", *_aten("expand.default")],
    "gather": [torch.gather, "gather", *_aten("gather.default")],
    "index": [*_aten("index.Tensor")],  # the getitem spelling: canonical() reads its index
    "squeeze": [torch.squeeze, "squeeze", *_aten("squeeze.dim", "squeeze.dims", "squeeze.default")],
    "silu": [F.silu, "silu", *_aten("silu.default")],
    "tanh": [torch.tanh, F.tanh, "tanh", *_aten("tanh.default")],
    "erf": [torch.erf, torch.special.erf, "erf", *_aten("erf.default")],
    "sigmoid": [torch.sigmoid, F.sigmoid, "sigmoid", *_aten("sigmoid.default")],
    "addcmul": [torch.addcmul, "addcmul", *_aten("addcmul.default")],
}

# Ops returning a tuple of primitives: each ``getitem`` of their result is read as the
# primitive at its index, bound with the op's arguments (Inductor decomposes LayerNorm
# into ``var_mean``).
TUPLE_SPELLINGS: dict[Any, tuple[str, ...]] = {
    torch.var_mean: ("var", "mean"),
    **{op: ("var", "mean") for op in _aten("var_mean.correction", "var_mean.dim")},
    torch.max: ("amax",), "max": ("amax",), **{op: ("amax",) for op in _aten("max.dim")},  # (values, indices)
}

# Defaults of optional parameters, per primitive (only those the matchers read).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "add": {"alpha": 1}, "sub": {"alpha": 1},
    "mean": {"dim": None, "keepdim": False},
    "sum": {"dim": None, "keepdim": False},
    "var": {"dim": None, "unbiased": True, "keepdim": False},
    "dropout": {"p": 0.5, "training": True},
    "layer_norm": {"weight": None, "bias": None, "eps": 1e-5},
    "rms_norm": {"weight": None, "eps": None},
    "normalize": {"p": 2.0, "dim": [1], "eps": 1e-12},
    "amax": {"dim": (), "keepdim": False},
    "clamp": {"min": None, "max": None},
    "slice": {"dim": [0], "start": None, "end": None, "step": 1},
    "cat": {"dim": [0]},
    "stack": {"dim": [0]},
    "flatten": {"start_dim": 0, "end_dim": -1},
    "addcmul": {"value": 1},
}

# ATen spellings whose positional layout differs from the canonical one.
_ATEN_POSITIONAL = {
    "var.correction": ("input", "dim"),  # correction / keepdim are keyword-only
    "var_mean.correction": ("input", "dim"),
    "dropout.default": ("input", "p", "training"),
    "clamp_max.default": ("input", "max"),
    "clamp_max.Tensor": ("input", "max"),
}

_FUNCTION_TABLE: dict[Any, str] = {}
_METHOD_TABLE: dict[str, str] = {}
for _prim, _spellings in SPELLINGS.items():
    for _s in _spellings:
        if isinstance(_s, str):
            _METHOD_TABLE[_s] = _prim
        else:
            _FUNCTION_TABLE[_s] = _prim

# Torch-level spellings whose positional layout differs from the canonical one.
_POSITIONAL_OVERRIDES: dict[Any, tuple[str, ...]] = {
    torch.dropout: ("input", "p", "training"),
    torch.layer_norm: ("input", "normalized_shape", "weight", "bias", "eps"),
}


@dataclass
class Canon:
    """A node seen as a canonical primitive: ``prim`` with its arguments bound by name."""

    prim: str
    args: dict[str, Any] = field(default_factory=dict)
    multi_output: bool = False  # ATen native_layer_norm / _fused_rms_norm return tuples

    def __getitem__(self, name: str) -> Any:
        return self.args.get(name, _DEFAULTS.get(self.prim, {}).get(name))


def _param_node(node: fx.Node, qualname: str) -> fx.Node:
    """A get_attr node for a parameter of the graph's module, created before ``node`` if needed."""
    for n in node.graph.nodes:
        if n.op == "get_attr" and n.target == qualname:
            return n
    with node.graph.inserting_before(node):
        attr = node.graph.get_attr(qualname)
    attr.meta["val"] = node.graph.owning_module.get_parameter(qualname).detach()
    return attr


def _module_norm(node: fx.Node) -> Canon | None:
    """A leaf norm module called by a symbolically traced graph (``call_module``)."""
    owner = node.graph.owning_module
    try:
        mod = owner.get_submodule(node.target) if owner is not None else None
    except AttributeError:
        return None
    if not isinstance(mod, TORCH_NORMS) or not node.args:
        return None
    param = lambda name: _param_node(node, f"{node.target}.{name}") if getattr(mod, name, None) is not None else None
    args = {"input": node.args[0], "normalized_shape": tuple(mod.normalized_shape), "weight": param("weight"),
            "eps": mod.eps}
    if isinstance(mod, torch.nn.LayerNorm):
        return Canon("layer_norm", {**args, "bias": param("bias")})
    return Canon("rms_norm", args)


def _tuple_item(source: fx.Node, index: Any) -> Canon | None:
    """``source[index]`` where ``source`` is a tuple-returning op of TUPLE_SPELLINGS."""
    try:
        prims_out = TUPLE_SPELLINGS.get(source.target) if source.op in ("call_function", "call_method") else None
    except TypeError:  # unhashable target
        return None
    if prims_out is None or not isinstance(index, int) or index >= len(prims_out):
        return None
    prim = prims_out[index]
    if prim == "amax":  # torch.max(x, dim, keepdim)[0] / .values: the maximum over dim
        return Canon("amax", _bind(source, PARAMS["amax"]))
    names = PARAMS["var"]
    if isinstance(source.target, torch._ops.OpOverload):
        names = _ATEN_POSITIONAL.get(f"{source.target._opname}.{source.target._overloadname}", names)
    args = _bind(source, names)
    if prim == "mean":  # mean takes (input, dim, keepdim): no correction
        args = {k: v for k, v in args.items() if k in PARAMS["mean"]}
    return Canon(prim, args)


def _new_dim(index: Any) -> int | None:
    """The dim ``x[index]`` inserts when the index is full slices and one None (``x[:, None]``,
    ``x[..., None]``): an unsqueeze; None for any other index."""
    items = index if isinstance(index, tuple) else (index,)
    full = lambda i: i is Ellipsis or isinstance(i, slice) and i == slice(None)
    if sum(i is None for i in items) != 1 or not all(i is None or full(i) for i in items):
        return None
    at = items.index(None)
    return at - len(items) if Ellipsis in items[:at] else at


def _new_dims(index: Any) -> bool:
    """``x[index]`` only inserts dims: full slices (no Ellipsis) and two or more Nones (a channel
    norm's ``w[:, None, None]``)."""
    items = index if isinstance(index, tuple) else (index,)
    return sum(i is None for i in items) >= 2 and all(
        i is None or isinstance(i, slice) and i == slice(None) for i in items)


def _sliced_dim(index: Any) -> int | None:
    """The dim ``x[index]`` slices when the index is full slices, at most one leading Ellipsis and
    one slice with bounds (``x[..., :d]``, ``x[:, :, :, d:]``); None for any other index."""
    items = index if isinstance(index, tuple) else (index,)
    full = lambda i: isinstance(i, slice) and i == slice(None)
    cut = [k for k, i in enumerate(items) if isinstance(i, slice) and not full(i)]
    if len(cut) != 1 or not all(full(i) or k == cut[0] or (i is Ellipsis and k == 0) for k, i in enumerate(items)):
        return None
    return cut[0] - len(items) if items[0] is Ellipsis else cut[0]


# Keyword spellings of a parameter: ``self=`` (ATen), numpy's ``axis=`` (ImageGPT's and I-BERT's
# ``torch.mean(t, axis=-1, keepdim=True)``).
_KWARG_ALIASES = {"self": "input", "axis": "dim"}


def _bind(node: fx.Node, names: tuple[str, ...]) -> dict[str, Any]:
    args = dict(zip(names, node.args))
    for key, value in node.kwargs.items():
        args[_KWARG_ALIASES.get(key, key)] = value
    if "correction" in args and "unbiased" not in args:
        args["unbiased"] = args["correction"] != 0
    if isinstance(args.get("dim"), int):
        args["dim"] = [args["dim"]]
    return args


def canonical(node: fx.Node) -> Canon | None:
    """The canonical view of one node, or None when its target is not in the table."""
    if node.op == "call_module":
        return _module_norm(node)
    if node.op == "call_function" and node.target is operator.getitem and _new_dim(node.args[1]) is not None:
        return Canon("unsqueeze", {"input": node.args[0], "dim": _new_dim(node.args[1])})
    if node.op == "call_function" and node.target is operator.getitem and _new_dims(node.args[1]):
        return Canon("view", {"input": node.args[0]})  # x[:, None, None]: the same values, reshaped
    if node.op == "call_function" and node.target is operator.getitem and _sliced_dim(node.args[1]) is not None:
        cut = next(i for i in (node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],))
                   if isinstance(i, slice) and i != slice(None))
        return Canon("slice", {"input": node.args[0], "dim": [_sliced_dim(node.args[1])], "start": cut.start,
                               "end": cut.stop, "step": 1 if cut.step is None else cut.step})
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], fx.Node):
        return Canon("index", {"input": node.args[0], "indices": [node.args[1]]})  # x[idx], idx a tensor
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return _tuple_item(node.args[0], node.args[1])
    if node.op == "call_function":
        try:
            prim = _FUNCTION_TABLE.get(node.target)
        except TypeError:  # unhashable target
            prim = None
    elif node.op == "call_method":
        prim = _METHOD_TABLE.get(node.target)
    else:
        prim = None
    if prim is None:
        return None
    names = _POSITIONAL_OVERRIDES.get(node.target, PARAMS[prim])
    if isinstance(node.target, torch._ops.OpOverload):
        overload = f"{node.target._opname}.{node.target._overloadname}"
        names = _ATEN_POSITIONAL.get(overload, names)
    args = _bind(node, names)
    if prim == "einsum":  # torch.einsum(eq, a, b): the operands as varargs; ATen's einsum takes a list
        args["operands"] = tuple(args["operands"]) if isinstance(node.target, torch._ops.OpOverload) \
            else tuple(node.args[1:])
    if prim == "permute" and len(node.args) > 2:  # x.permute(0, 2, 3, 1): the dims as varargs
        args["dims"] = tuple(node.args[1:])
    if prim == "expand" and len(node.args) > 2:  # x.expand(2, -1): the sizes as varargs
        args["size"] = tuple(node.args[1:])
    if prim == "dropout" and "train" in args:
        args["training"] = args.pop("train")
    identity = _times_one(prim, args)
    if identity is not None:  # x / 1, x * 1: the same values (an attention's rescale_output_factor of 1.0)
        return Canon("cast", {"input": identity})
    whole = _cat_of_slices(node, args) if prim == "cat" else None
    if whole is not None:  # Flux's single-stream blocks split the stream into text and image and join it
        return Canon("view", {"input": whole})
    multi = node.target in _aten("native_layer_norm.default", "_fused_rms_norm.default")
    return Canon(prim, args, multi)


def _cat_of_slices(node: fx.Node, args: dict) -> fx.Node | None:
    """The tensor ``x`` of ``cat([x[..., a:b], x[..., b:c], ...], dim)`` when the slices tile x
    along that dim in order (so the cat is x's values again); else None."""
    tensors, ndim = args.get("tensors"), len(node_shape(node) or ())
    dim = one_dim(args) if "dim" in args else None
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or dim is None or not ndim:
        return None
    source, end = None, 0
    for t in tensors:
        c = canonical(t) if isinstance(t, fx.Node) else None
        if c is None or c.prim != "slice" or c["step"] != 1 or not isinstance(c["input"], fx.Node):
            return None
        if source is None:
            source = c["input"]
        d = one_dim(c, ndim)
        if c["input"] is not source or d is None or d != dim % ndim \
                or (c["start"] or 0) != end or c["end"] is None and t is not tensors[-1]:
            return None
        end = c["end"]
    size = (node_shape(source) or (None,) * ndim)[dim % ndim]
    return source if end is None or (isinstance(size, int) and end == size) else None


def _times_one(prim: str, args: dict) -> fx.Node | None:
    """The tensor of ``x / 1`` or ``x * 1`` (either order), which every float keeps exactly; else None."""
    def one(v):
        return type(v) in (int, float) and v == 1
    if prim == "div" and isinstance(args.get("input"), fx.Node) and one(args.get("other")):
        return args["input"]
    if prim == "mul":
        a, b = args.get("input"), args.get("other")
        if isinstance(a, fx.Node) and one(b):
            return a
        if isinstance(b, fx.Node) and one(a):
            return b
    return None


def canonicalize(graph: fx.Graph) -> dict[fx.Node, Canon]:
    """The canonical view of a whole graph: every node whose target the table knows."""
    view = {}
    for node in graph.nodes:
        canon = canonical(node)
        if canon is not None:
            view[node] = canon
    return view


# In-place spellings write into their input: a value read by one is not pure, and two
# equal-looking expressions on either side of the write may differ.
_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


# Ops that split a tensor into a tuple of pieces (views of it, no arithmetic): diffusion
# transformers chunk one timestep projection into the pieces their blocks modulate with.
UNBIND_SPELLINGS = frozenset([torch.unbind, torch.Tensor.unbind, "unbind", *_aten("unbind.int")])
SPLIT_SPELLINGS = UNBIND_SPELLINGS | frozenset([torch.chunk, torch.split, torch.Tensor.chunk, torch.Tensor.split,
                                                "chunk", "split",
                                                *_aten("chunk.default", "split.Tensor", "split_with_sizes.default")])


def _spelled(node: fx.Node, spellings: frozenset) -> bool:
    try:
        return node.op in ("call_function", "call_method") and node.target in spellings
    except TypeError:  # unhashable target
        return False


def unbound_dim(node: fx.Node) -> Any:
    """The dim ``x.unbind(dim)`` / ``torch.unbind(x, dim)`` unbinds (as written), None for any other node."""
    if not _spelled(node, UNBIND_SPELLINGS):
        return None
    return node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)


def dim_named(dims: Any, ndim: int | None = None) -> int | None:
    """The one dim ``dims`` names (an int, or a list of one int: a cat's, a slice's, a reduction's),
    counted from 0 when ``ndim`` is given (None when outside it); None when it names none or several."""
    if isinstance(dims, (list, tuple)):
        dims = dims[0] if len(dims) == 1 else None
    if not isinstance(dims, int) or isinstance(dims, bool):
        return None
    if not ndim:
        return dims
    return dims % ndim if -ndim <= dims < ndim else None


def one_dim(c: "Canon", ndim: int | None = None) -> int | None:
    """The one dim a canonical op's ``dim`` names (``dim_named``)."""
    return dim_named(c["dim"], ndim)


def strided_store(node: fx.Node) -> tuple[fx.Node, int, int, Any] | None:
    """(target, start, step, value) of ``target[..., start::step] = value`` (every step-th column of
    the last dim from start, as Wan's RoPE stores its pairs), None for any other node."""
    if node.op != "call_function" or node.target is not operator.setitem or not isinstance(node.args[0], fx.Node):
        return None
    where = node.args[1]
    k = where[1] if isinstance(where, tuple) and len(where) == 2 and where[0] is Ellipsis else None
    if not isinstance(k, slice) or k.stop is not None or not isinstance(k.step, int) \
            or not isinstance(k.start, int) or not 0 <= k.start < k.step:
        return None
    return node.args[0], k.start, k.step, node.args[2]


def is_split_piece(node: fx.Node) -> bool:
    """A split of a tensor into pieces (``chunk``, ``split``, ``unbind``), or one piece of one:
    pure views, as a canonical primitive is pure arithmetic."""
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return _spelled(node, SPLIT_SPELLINGS)


def mutates(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.endswith("__")
    if node.op != "call_function":
        return False
    if node.target in _IN_PLACE:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _frozen(value: Any, rep: dict[fx.Node, fx.Node]) -> Any:
    """A hashable key for an argument; nodes stand for their representative."""
    if isinstance(value, fx.Node):
        return ("node", rep.get(value, value))
    if isinstance(value, (list, tuple, torch.Size)):
        return (type(value).__name__, tuple(_frozen(v, rep) for v in value))
    if isinstance(value, torch.Tensor):  # compared by identity: == on tensors is elementwise
        return ("tensor", id(value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _frozen(v, rep)) for k, v in value.items())))
    try:
        hash(value)
    except TypeError:
        return ("repr", repr(value))
    return (type(value).__name__, value)


def common_subexpressions(graph: fx.Graph, view: dict[fx.Node, Canon]) -> dict[fx.Node, fx.Node]:
    """node -> an earlier node computing the same value, for every duplicated pure expression.

    Dynamo does not eliminate common subexpressions, so model code that writes ``x - mean``
    twice (Cohere's LayerNorm) gives two nodes. Two nodes are one value when they are the
    same canonical primitive (so ``x.float()`` and ``x.to(torch.float32)`` agree) of the
    same arguments, up to representatives, with the same dtype and shape; parameters read
    twice are one. Nodes touched by an in-place op are never merged. The graph is unchanged.
    """
    rep: dict[fx.Node, fx.Node] = {}
    seen: dict[Any, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            key: Any = ("get_attr", node.target)
        else:
            c = view.get(node)
            if c is None or c.multi_output or mutates(node) or (c.prim == "dropout" and not (
                    c["training"] is False or c["p"] == 0)):
                continue
            if any(mutates(u) for p in node.all_input_nodes for u in p.users):
                continue
            shape = node_shape(node)
            key = (c.prim, _frozen(c.args, rep), node_dtype(node), None if shape is None else repr(shape))
        try:
            first = seen.setdefault(key, node)
        except TypeError:  # an argument hashes but cannot be compared (e.g. a tensor constant)
            continue
        if first is not node:
            rep[node] = first
    return rep


# Nodes that read a value only to check it (torch.export inserts them): they are not
# users that keep a value alive or make it escape a site.
CHECK_ONLY = set(_aten("_assert_tensor_metadata.default", "_assert_scalar.default", "sym_constrain_range_for_size.default"))


def is_check_only(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in CHECK_ONLY


def real_users(node: fx.Node) -> list[fx.Node]:
    """The users of a node, without the check-only ones."""
    return [u for u in node.users if not is_check_only(u)]


# --- metadata: dynamo puts fake tensors in meta["example_value"], ATen graphs in meta["val"]

def tensor_meta(node: Any):
    if not isinstance(node, fx.Node):
        return None
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            return value
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "dtype"):
        return tm
    return None


def node_dtype(node: Any) -> torch.dtype | None:
    meta = tensor_meta(node)
    return getattr(meta, "dtype", None)


def dim_value(d: Any) -> Any:
    """A dim as an int when it is static or a symbol the capture fixed (dynamo replaces a
    symbol that a guard pinned); a ``SymInt`` when it is truly symbolic."""
    if isinstance(d, torch.SymInt):
        known = d.node.maybe_as_int()
        return known if known is not None else d
    return d


def node_shape(node: Any) -> tuple | None:
    meta = tensor_meta(node)
    return tuple(dim_value(d) for d in meta.shape) if meta is not None else None


def is_exact_upcast(src: torch.dtype | None, dst: torch.dtype | None) -> bool:
    """A cast that changes no value: same dtype, or a wider float that holds every value of src."""
    if src is None or dst is None:
        return False
    if src == dst:
        return True
    return src in LOW_PRECISION and dst in (torch.float32, torch.float64) or (
        src == torch.float32 and dst == torch.float64)


def same_dim(a, b) -> bool:
    """Equal dims, symbolic ones included, known without adding a guard to a traced graph."""
    a, b = dim_value(a), dim_value(b)
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, (int, torch.SymInt)) and isinstance(b, (int, torch.SymInt)):
        from torch.fx.experimental.symbolic_shapes import statically_known_true
        return statically_known_true(a == b)
    return False


def same_shape(a, b) -> bool:
    """Equal shapes, symbolic dims included, without adding guards to a traced graph."""
    return a is not None and b is not None and len(a) == len(b) and all(same_dim(x, y) for x, y in zip(a, b))


def broadcasts_to(a, b) -> bool:
    """Shape ``a`` broadcasts to shape ``b`` without widening it: each dim of ``a``, aligned from the
    last, is 1 or ``b``'s (symbolic dims included, without adding guards)."""
    return a is not None and b is not None and len(a) <= len(b) and \
        all(same_dim(d, 1) or same_dim(d, e) for d, e in zip(reversed(tuple(a)), reversed(tuple(b))))


def last_dim(node) -> Any:
    """The last dim: an int, a ``SymInt`` when it is symbolic (the kernels take any size), None
    without metadata."""
    shape = node_shape(node)
    if not shape or not isinstance(shape[-1], (int, torch.SymInt)):
        return None
    return shape[-1]
