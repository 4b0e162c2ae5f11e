"""The add and its norm, the call every site starts as: ``add_norm(x, residual, w, b, ...)``.

``planning._choose`` plans it (the add the norm reads, when it can be taken, else the norm
alone: ``add_norm(x, None, ...)``); the parts the plan takes extend it (``parts/``: what each
adds to its operands, options and outputs). ``ADD_NORM`` builds the call with them and gives
the checker its formula: the parts' steps on x, the sum, then the norm (or a part's outputs).
Its semantics: ``normfuse.kernels.reference``.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from normfuse.kernels.specs import OP_OUTPUTS, api_outputs
from normfuse.passes.canonical import canonical, node_dtype, node_shape, same_shape
from normfuse.passes.fusions.base import Fusion
from normfuse.passes.graph import copy_meta
from normfuse.passes.parts import PARTS, folded_nodes, taken_parts
from normfuse.passes.step import BuiltCall

__all__ = ["ADD_NORM", "output_names", "output_index"]


def output_names(options: dict, as_op: bool = False) -> tuple[str, ...]:
    """The outputs of a rewritten add_norm call with these keyword options, in order: the
    functional API's (normfuse.kernels.specs.api_outputs), or (``as_op``) the custom op's."""
    if as_op:
        return OP_OUTPUTS["add_norm_fwd"]
    return api_outputs(second_norm=any(options.get(name) is not None for name in ("weight1", "mod1_scale", "mod1_shift")),
                       quantized=options.get("quant_dtype") is not None)


def output_index(options: dict, as_op: bool = False) -> dict[str, int]:
    """Where each output (y, s, y1, q, scale) is among a rewritten add_norm call's outputs."""
    return {name: i for i, name in enumerate(output_names(options, as_op))}


def _add_norm_call(r, p, parts: list, modes: dict) -> BuiltCall:
    """The add_norm call of plan ``p`` (a norm alone: ``add_norm(x, None, ...)``) with what its
    parts add, inserted at the graph's insertion point, its outputs rerouted."""
    m = r.analysis.sites[p.lead].match
    operands = (r.resolve(p.x), r.resolve(p.residual))
    built = BuiltCall(call=None, inserted=[], stands_for=[], old_nodes=[])
    for part, found in parts:
        operands, piece = part.operands(found, operands, (p.x, p.residual), r)
        built.inserted += piece.inserted
        built.holds.update(piece.holds)
    options: dict = {}
    output = m.output  # the original node the call's y replaces
    for part, found in parts:
        piece = part.call(found, r)
        options.update(piece.options)
        built.inserted += piece.inserted
        built.holds.update(piece.holds)
        built.reads.update(part.reads(found))
        built.old_nodes += part.nodes(found)
        output = part.y_output(found, output)
    s_used = p.op == "add_norm" and r.analysis.sites[p.lead].sum_continues  # anything else reads the sum
    sum_dtype = p.residual_dtype if p.widens else p.sum_dtype
    built.call = r.fused_call("add_norm", (*operands, m.weight, m.bias),
                              dict(modes, sum_dtype=sum_dtype, return_sum=s_used, **options))
    built.inserted.append(built.call)
    where = output_index(options, r.as_op)
    add = r.analysis.sites[p.lead].in_add if p.op == "add_norm" else None
    if all(part.y_read(found) for part, found in parts):  # else y was read only by a part's step
        _reroute_y(r, parts, built, where, output, add)
    kernel_shape = node_shape(add.node) if add is not None else node_shape(m.output)
    for part, found in parts:  # the outputs a part adds (a second norm's y1, fp8 q and its scale)
        more, replaced = part.outputs(found, r, built.call, kernel_shape, where)
        built.inserted += more
        built.stands_for += replaced
    if s_used:
        s = r.graph.call_function(operator.getitem, (built.call, where["s"]))
        copy_meta(s, add.total)
        built.inserted.append(s)
        built.stands_for.append((where["s"], add.total))
        r.replace(add.total, _returned(r, parts, "s", s, add.total, where, built))
    if add is not None:
        folded = folded_nodes(p.taken)
        built.old_nodes += [add.node, *add.chain, *folded]
        # the operands' scaling / upcasts that the kernel now does itself
        built.old_nodes += [n for n in add.node.all_input_nodes]
        built.old_nodes += [n for b in folded for n in b.all_input_nodes]
    return built


def _reroute_y(r, parts: list, built: BuiltCall, where: dict, output: fx.Node, add) -> None:
    """The call's y, as the parts hand it back, in place of ``output`` (reshaped when the add
    and the norm see the rows in different shapes: a view between them)."""
    y = r.graph.call_function(operator.getitem, (built.call, where["y"]))
    copy_meta(y, output)
    built.inserted.append(y)
    built.stands_for.append((where["y"], output))
    result = _returned(r, parts, "y", y, output, where, built)
    if result is y and add is not None and not same_shape(node_shape(add.node), node_shape(output)):
        result = r.graph.call_method("reshape", (y, *node_shape(output)))
        copy_meta(result, output)
        built.inserted.append(result)
    r.replace(output, result)
    for before in _same_value_before(output):  # another call may read y as the value before a no-op cast
        r.replaced.setdefault(before, result)


def _same_value_before(node: fx.Node) -> list[fx.Node]:
    """The nodes whose value ``node`` is, bit for bit: the inputs of casts to their own dtype (Mochi's
    ``x.to(x_dtype)`` after its scaled norm, which an add reading it looks through), each read by the next only."""
    found = []
    while (c := canonical(node)) is not None and c.prim == "cast" and isinstance(c["input"], fx.Node) \
            and node_dtype(node) is not None and node_dtype(c["input"]) == node_dtype(node) \
            and len(c["input"].users) == 1:
        node = c["input"]
        found.append(node)
    return found


def _returned(r, parts: list, name: str, value: fx.Node, original: fx.Node, where: dict,
              built: BuiltCall) -> fx.Node:
    """The call's output ``name`` as the parts hand it back in place of ``original``."""
    for part, found in parts:
        value, more, dims = part.returned(found, name, value, original, r)
        built.inserted += more
        if dims is not None:
            built.permuted_back[where[name]] = dims
    return value


class _AddNorm(Fusion):
    name = "add_norm"
    ops = ("add_norm", "norm")
    exclusive = False

    def build(self, found, plan, rewriting, modes: dict) -> BuiltCall:
        return _add_norm_call(rewriting, plan, taken_parts(plan.taken), modes)

    # ---------------------------------------------------------------- checker
    def formula(self, options: dict, rows: dict, normalize, ops) -> list:
        """The parts' steps on x before the sum (the add's branch), s = x + residual_scale *
        residual, then y = norm(s) (and s), or the outputs a part in the call gives by its own
        formula."""
        x, r = rows["x"], rows["residual"]
        scale = ops.rational(float(options.get("residual_scale", 1.0)))
        for part in PARTS:
            x = part.symbolic_input(options, rows, x, ops)
        s = x if r is None else ops.elementwise(lambda xv, rv: xv + scale * rv, x, r)
        for part in PARTS:
            by_name = part.symbolic(options, rows, s, normalize, ops) if part.uses(options) else None
            if by_name is not None:
                return [by_name[name] for name in output_names(options)]
        return [normalize(s), s]

    def stream_sum(self, call: fx.Node) -> tuple[int, tuple | None]:
        x, residual = call.args[:2]
        plain = residual is not None and call.kwargs.get("residual_scale", 1.0) == 1.0
        return output_index(call.kwargs)["s"], (x, residual) if plain else None

    def stream_input(self, call: fx.Node):
        return call if call.args[1] is not None else call.args[0]  # the call stands for its sum


ADD_NORM = _AddNorm()
