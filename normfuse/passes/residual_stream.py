"""A wider residual stream: every fused sum of the stream kept in ``FuseConfig.residual_dtype``.

Runs after the rewrite. Each fused ``add_norm`` with a residual computes and returns its sum
in the wide dtype (``sum_dtype``), and each ``norm_add`` its output (``add_dtype``); the norm
outputs keep the dtype the graph gave them. A wide sum flows as is into the fused calls
that read it as ``x`` or ``residual`` (the next add of the stream); every other reader (a
block output, a view, a return value) gets it rounded back to the dtype the graph had,
so the blocks' outputs stay in the model's dtype.

This changes the function on purpose (the stream is rounded less often); the checker
reports it as by design, with the error against fp64 next to the original's.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from normfuse.kernels.add_norm import add_norm, norm_add
from normfuse.passes.canonical import node_dtype
from normfuse.passes.rewrite import output_index

__all__ = ["widen_stream", "WIDENED_DTYPES"]

# the stream is widened only from these (an fp32 stream is already as wide as the kernels go)
WIDENED_DTYPES = (torch.float16, torch.bfloat16)


def _output(call: fx.Node, index: int) -> fx.Node | None:
    return next((u for u in call.users if u.target is operator.getitem and u.args[1] == index), None)


def _retype(node: fx.Node, dtype: torch.dtype) -> None:
    """The node's fake value with its new dtype (later stages read dtypes off the meta)."""
    for key in ("val", "example_value"):
        value = node.meta.get(key)
        if isinstance(value, torch.Tensor):
            node.meta[key] = value.to(dtype)
    node.meta.pop("tensor_meta", None)


def _takes_wide(call: fx.Node, value: fx.Node, widened: dict, dtype: torch.dtype) -> bool:
    """Whether a fused call can read the wide ``value`` as the add's operand: it must be the
    residual add's x or residual (norm_add: its residual), and the norm's weight and bias must
    keep a dtype the op pairs with its operands (an operand's dtype, or fp32)."""
    x, residual, weight, bias = call.args[:4]
    if residual is None or value not in ((x, residual) if call.target is add_norm else (residual,)):
        return False
    operand_dtypes = {dtype if op in widened else node_dtype(op) for op in (x, residual)}
    return all(p is None or node_dtype(p) in operand_dtypes | {torch.float32} for p in (weight, bias))


def widen_stream(graph: fx.Graph, calls: dict[fx.Node, object], dtype: torch.dtype) -> list[fx.Node]:
    """Widen the stream sums of the fused ``calls`` (call node -> its report Site) to ``dtype``;
    returns the calls changed. ``site.residual_dtype`` is set on the sites that write the wide
    stream and on the fused sites that read it rounded back. Only the functional
    calls are changed (graphs that call the custom ops directly keep their dtypes)."""
    widened: dict[fx.Node, torch.dtype] = {}  # stream output node -> the dtype the graph had
    changed = []
    for call, site in calls.items():
        if call.target is add_norm and call.args[1] is not None:
            key, out_index = "sum_dtype", output_index(False, "weight1" in call.kwargs)["s"]
        elif call.target is norm_add:
            key, out_index = "add_dtype", 0
        else:
            continue
        old = call.kwargs.get(key)
        if old not in WIDENED_DTYPES:
            continue
        call.kwargs = {**call.kwargs, key: dtype}
        site.residual_dtype = str(dtype)
        changed.append(call)
        out = _output(call, out_index)
        if out is not None:
            widened[out] = old
            _retype(out, dtype)
    stream_calls = {c for c in calls if c.target in (add_norm, norm_add)}
    for out, old in widened.items():
        # readers that are not the next fused add of the stream get the graph's dtype back
        others = [u for u in out.users if not (u in stream_calls and _takes_wide(u, out, widened, dtype))]
        if not others:
            continue
        with graph.inserting_after(out):
            narrow = graph.call_method("to", (out, old))
        narrow.meta.update({k: v for k, v in out.meta.items() if k in ("stack_trace", "nn_module_stack")})
        for key in ("val", "example_value"):
            if isinstance(out.meta.get(key), torch.Tensor):
                narrow.meta[key] = out.meta[key].to(old)
        for user in others:
            user.replace_input_with(out, narrow)
            if user in calls:  # a fused site reading the stream rounded back: by design as well
                calls[user].residual_dtype = str(dtype)
    return changed
