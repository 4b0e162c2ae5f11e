"""Sequence parallel: let the residual add reach its norm through ``DTensor.from_local``.

Under torchtitan's TP plan the residual stream is made of plain local tensors (the
sequence shard of each rank: ``RowwiseParallel(output_layouts=Shard(1))`` hands back a
local tensor) and each ``SequenceParallel`` norm wraps its input back into a DTensor in an
input hook. Dynamo's graph then reads::

    x = add(h, r)                     # local tensors
    d = from_local(x, mesh, (S(1),))  # the norm's input hook
    y = rms_norm(d, ...)              # DTensor
    ... x also continues the stream ...

so the add does not feed the norm directly. ``hoist_from_local`` rewrites it into the
same computation with the wrap moved onto the operands::

    d = add(from_local(h, ...), from_local(r, ...))   # the add on DTensors: each rank adds its rows
    y = rms_norm(d, ...)
    x = d.to_local()                                  # for the stream

which the pass then fuses like any add -> norm. Values and gradients are unchanged:
``from_local``/``to_local`` of a shard are views of the same local rows.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from normfuse.passes.canonical import canonical

__all__ = ["hoist_from_local"]



def _from_local_target():
    try:
        from torch.distributed.tensor import _api
    except ImportError:  # pragma: no cover - builds without DTensor
        return None
    return getattr(_api, "from_local", None)


def _is_tensor_node(arg) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("example_value"), torch.Tensor)


def hoist_from_local(graph: fx.Graph) -> int:
    """Rewrite every ``from_local(add(a, b), ...)`` of ``graph`` as above; returns how many."""
    target = _from_local_target()
    if target is None:
        return 0
    count = 0
    for wrap in [n for n in graph.nodes if n.op == "call_function" and n.target is target]:
        add = wrap.args[0] if wrap.args else None
        c = canonical(add) if isinstance(add, fx.Node) else None
        if c is None or c.prim != "add" or c["alpha"] != 1 or not all(_is_tensor_node(c[k]) for k in ("input", "other")):
            continue
        a, b = c["input"], c["other"]
        if a.meta["example_value"].shape != b.meta["example_value"].shape:
            continue  # a broadcasting add: its operands are not shards of the same rows
        with graph.inserting_before(wrap):
            wrapped = []
            for operand in (a, b):
                node = graph.call_function(target, (operand, *wrap.args[1:]), dict(wrap.kwargs))
                node.meta = dict(wrap.meta)
                wrapped.append(node)
            dadd = graph.call_function(operator.add, tuple(wrapped))
            dadd.meta = dict(wrap.meta)
        with graph.inserting_after(dadd):
            local = graph.call_method("to_local", (dadd,))
            local.meta = dict(add.meta)
        wrap.replace_all_uses_with(dadd)
        add.replace_all_uses_with(local)
        graph.erase_node(wrap)
        graph.erase_node(add)
        count += 1
    return count
