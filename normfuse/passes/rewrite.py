"""Rewrite: each safe state becomes one call of a fused op.

- add -> norm      : ``add_norm(x, residual, w, b, ...)``; the sum is an op output when
                     anything else still reads it.
- norm -> add      : ``norm_add(f, stream, w, b, ...)`` for ``x + norm(f)`` (res-post, sandwich).
- a norm alone     : ``add_norm(x, None, w, b, ...)``, one kernel instead of HF's ~8.
- two norms of one value (parallel blocks): one call, the second norm as ``weight1``/``bias1``.
- the add's branch: a second add, a per-sample scale or live dropout just before the add
  become the kernel's ``x1``, ``rowscale``, ``dropout_p`` (``normfuse/passes/branch.py``).

A state that fails a precondition is left exactly as it was, with a reason. Each add is
folded into at most one kernel (the first norm that claims it).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from normfuse.kernels.add_norm import add_norm, norm_add
from normfuse.passes.branch import BranchFold, fold_branch
from normfuse.passes.canonical import mutates, node_dtype, node_shape, real_users, same_shape, tensor_meta
from normfuse.passes.classify import SiteState, stream_operand
from normfuse.passes.find import as_add
from normfuse.passes.graph import GraphIndex
from normfuse.vocabulary import FOLDED_META, KERNEL_DTYPES, LAYOUT_META, ROWS_META

__all__ = ["plan", "apply", "add_reason", "Plan", "is_fused_call", "fused_op_name"]

# What a rewritten graph calls: the functional API (graphs that run eagerly or go through
# AOTAutograd, which traces it into the custom ops) or, in graphs Inductor already
# lowered to ATen (custom post-grad passes), the custom ops themselves.
_FUNCTIONS = {add_norm: "add_norm", norm_add: "norm_add"}


@functools.cache
def _op_overloads() -> dict:
    return {torch.ops.normfuse.add_norm_fwd.default: "add_norm", torch.ops.normfuse.norm_add_fwd.default: "norm_add"}


def fused_op_name(node: fx.Node) -> str | None:
    """"add_norm", "norm_add" or "norm" for a call of a fused op; None for any other node."""
    if node.op != "call_function":
        return None
    family = _FUNCTIONS.get(node.target) or _op_overloads().get(node.target)
    if family == "add_norm" and node.args[1] is None:
        return "norm"
    return family


def is_fused_call(node: fx.Node) -> bool:
    return fused_op_name(node) is not None



class Plan:
    """How one state will be rewritten: which op, on which operands, with which modes."""

    def __init__(self, state: SiteState, op: str, x: Any, residual: Any = None, output_add: fx.Node | None = None,
                 residual_scale: float = 1.0, sum_dtype: torch.dtype | None = None,
                 permute: tuple[int, ...] | None = None, branch: BranchFold | None = None,
                 partner: SiteState | None = None):
        self.state = state
        self.op = op                    # "add_norm" | "norm_add" | "norm"
        self.x = x
        self.residual = residual
        self.output_add = output_add        # the add folded after the norm (norm_add)
        self.residual_scale = residual_scale
        self.sum_dtype = sum_dtype
        self.permute = permute          # the kernel reads x and residual permuted by these dims
        self.branch = branch or BranchFold(x)  # x1 / rowscale / dropout taken from the add's branch (x is branch.x)
        self.partner = partner          # a second norm of the same value, computed by the same call
        self.placement = None           # (first node, late operands' moves), found by plan()


def _same_modes(a: SiteState, b: SiteState) -> bool:
    """Two norms one kernel can compute from one set of row statistics (weights may differ)."""
    m, n = a.match, b.match
    return (m.kind, m.eps, m.weight_offset, m.norm_round_dtype, m.out_dtype, m.hidden_size) == (
        n.kind, n.eps, n.weight_offset, n.norm_round_dtype, n.out_dtype, n.hidden_size)


def _partner(index: GraphIndex, state: SiteState, unavailable: set) -> SiteState | None:
    """Another norm reading the very value this one reads, with the same modes (parallel blocks:
    GPT-NeoX, GPT-J, timm's parallel ViT); both need a weight, since the kernel's second output
    exists when it has one."""
    m = state.match
    if m.weight is None:
        return None
    for other in state.group:
        o = other.match
        if other is state or id(other) in unavailable or o.weight is None or _refusal(other) is not None:
            continue
        if index.order[o.output] < index.order[m.output] or not index.same(o.input, m.input):
            continue
        if (state.in_add is None) != (other.in_add is None) or (
                state.in_add is not None and state.in_add.node is not other.in_add.node):
            continue
        if _same_modes(state, other) and node_dtype(o.weight) is not None:
            return other
    return None


def _refusal(state: SiteState) -> str | None:
    """Why the norm itself cannot become a fused op (None when it can)."""
    m = state.match
    if m.reason:
        return m.reason
    if m.hidden_size is None:
        return "hidden size unknown (no shape metadata on the graph, or a symbolic last dim)"
    dt = node_dtype(m.input)
    if dt not in KERNEL_DTYPES:
        return f"input dtype {dt} is not one the kernels take ({', '.join(map(str, KERNEL_DTYPES))})"
    for t, name in ((m.weight, "weight"), (m.bias, "bias")):
        if t is not None and node_dtype(t) not in KERNEL_DTYPES:
            return f"{name} dtype {node_dtype(t)} is not one the kernels take"
    if m.out_dtype not in KERNEL_DTYPES:
        return f"output dtype {m.out_dtype} is not one the kernels take"
    # DTensor (tensor/sequence parallel) inputs: the rows must be whole (normfuse.kernels.sharding)
    from normfuse.kernels.sharding import refusal as dtensor_refusal
    return dtensor_refusal([n.meta.get("example_value", n.meta.get("val")) for n in (m.input, m.weight, m.bias)
                            if isinstance(n, fx.Node)])


def plan(index: GraphIndex, state: SiteState, claimed: set, reserved: set, config, as_op: bool = False,
         unavailable: set = frozenset()) -> tuple[Plan | None, str | None]:
    """Choose the op for one state; returns (plan, None) or (None, reason).

    ``claimed``: adds already folded into a kernel. ``reserved``: adds that some norm reads;
    those go to that norm (add -> norm) rather than to a norm -> add before it. ``config``:
    the FuseConfig; ``as_op``: the graph is ATen (Inductor's post-grad passes), where the
    rewrite calls the custom op and no seed can be drawn for a folded dropout. ``unavailable``:
    ids of states no call may take as its second norm (excluded, or taken already)."""
    chosen, reason = _plan(index, state, claimed, reserved, config, as_op)
    if chosen is None:
        return None, reason
    if config.pair_norms and chosen.op in ("add_norm", "norm") and chosen.permute is None:
        chosen.partner = _partner(index, state, unavailable)
    reason = _unplaceable(index, chosen)
    if reason and chosen.partner is not None:
        chosen.partner = None  # the second norm's parameters come too late: each its own call
        reason = _unplaceable(index, chosen)
    return (None, reason) if reason else (chosen, None)


def _plan(index: GraphIndex, state: SiteState, claimed: set, reserved: set, config, as_op: bool):
    reason = _refusal(state)
    if reason:
        return None, reason
    m = state.match
    add = state.in_add
    if add is not None:  # refresh: an operand may be an earlier state's add, now replaced by its sum
        fresh = as_add(index, add.node, m.hidden_size)
        add.operands, add.scaled, add.residual_scale = fresh.operands, fresh.scaled, fresh.residual_scale
    out = state.output_add
    if out is not None and out.node.graph is index.graph:
        fresh = as_add(index, out.node, m.hidden_size)
        out.operands, out.scaled, out.residual_scale = fresh.operands, fresh.scaled, fresh.residual_scale
    reshaped = add is not None and add.permute is None and not same_shape(node_shape(add.node),
                                                                          node_shape(m.output))
    static = all(isinstance(d, int) for d in (node_shape(m.output) or (None,)))
    if add is not None and add.reason is None and add.node not in claimed and (static or not reshaped):
        a, b = add.operands
        # s = x + scale * residual: the scaled operand (DeepNorm) is the residual
        if add.scaled is not None:
            x, residual = (b, a) if add.scaled == 0 else (a, b)
        else:
            stream = stream_operand(index, add)
            x, residual = (b, a) if stream == 0 else (a, b)
        branch = None
        if add.permute is None and config.fuse_branch:
            # the kernel draws a rank's mask from its local row index: on DTensors, ranks holding
            # different rows would draw the same pattern, so their dropout stays eager's
            from normfuse.kernels.sharding import is_dtensor
            local_rows = is_dtensor(tensor_meta(add.node))
            modes = dict(second=True, rowscale=True, dropout=config.fuse_dropout and not as_op and not local_rows)
            branch = fold_branch(index, add.node, x, **modes)
            if not branch.folded and add.scaled is None:
                # the stream may be unknown (an operand is an earlier site's fresh output): the
                # other operand may be the branch; x and residual play the same part in the sum
                other = fold_branch(index, add.node, residual, **modes)
                if other.folded:
                    branch, residual = other, x
        return Plan(state, "add_norm", branch.x if branch else x, residual, residual_scale=add.residual_scale,
                    sum_dtype=node_dtype(add.node), permute=add.permute, branch=branch), None
    if config.fuse_output_add and out is not None and out.reason is None and out.node not in claimed \
            and out.node not in reserved and add is None and state.placement in ("res_post", "sandwich") \
            and not state.output_chain:
        stream = stream_operand(index, out)
        ops = out.node.all_input_nodes
        if stream is not None and out.scaled in (None, stream) and same_shape(node_shape(ops[stream]),
                                                                               node_shape(m.output)):
            residual = out.operands[stream]
            return Plan(state, "norm_add", m.input, residual, output_add=out.node,
                        residual_scale=out.residual_scale), None
    return Plan(state, "norm", m.input, None, sum_dtype=node_dtype(m.input)), None


def add_reason(state: SiteState, p: Plan, claimed: set, reserved: set, config) -> str | None:
    """Why the add next to a state is not in the state's kernel (None when the kernel holds an add,
    or no add is next to it). Call before the state's own adds are claimed."""
    if p.op in ("add_norm", "norm_add"):
        return None
    add, out = state.in_add, state.output_add
    if add is not None:
        return add.reason or ("the sum is folded into another norm's kernel" if add.node in claimed
                              else "the add's operands change shape on the way to the norm")
    if out is None:
        return None
    if out.reason is not None:
        return out.reason
    if out.node in claimed or out.node in reserved:
        return "the add after the norm is folded into the kernel of the norm that reads its sum"
    if not config.fuse_output_add:
        return "adds after a norm are not folded (fuse_output_add=False)"
    if state.output_chain:
        return "views or dropout sit between the norm and the add after it"
    if state.placement not in ("res_post", "sandwich"):
        return ("the add after the norm is not a residual add of the norm's output into a stream "
                "(x + norm(F(x))): neither operand descends from the other")
    return "the add after the norm does not keep the stream's shape"


def _copy_meta(dst: fx.Node, src: fx.Node) -> None:
    for key in ("val", "example_value", "tensor_meta", "stack_trace", "nn_module_stack", "source_fn_stack"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def _placement(index: GraphIndex, p: Plan) -> tuple[fx.Node, list[tuple[fx.Node, list[fx.Node] | None]]]:
    """(first, moves): the first node that may read the op's outputs, and for each operand
    computed at or after it, the nodes to move up before it with it (None: they cannot move).

    An operand computed later (Nemotron's LayerNorm1P computes ``weight + 1`` after the
    residual add) moves up together with what it is computed from, when that is pure and
    reads only values computed before it."""
    m = p.state.match
    candidates = list(m.nodes) + [m.output]
    if p.op == "add_norm":
        candidates += [p.state.in_add.node, *p.state.in_add.chain]
    if p.output_add is not None:
        candidates.append(p.output_add)
    if p.partner is not None:
        candidates += [*p.partner.match.nodes, p.partner.match.output]
    first = min(candidates, key=index.order.__getitem__)
    extra = (p.branch.x1, p.branch.rowscale) + (
        (p.partner.match.weight, p.partner.match.bias) if p.partner is not None else ())
    moves = []
    for operand in (p.x, p.residual, m.weight, m.bias, *extra):
        if isinstance(operand, fx.Node) and index.order[operand] >= index.order[first]:
            moves.append((operand, _movable_up(index, operand, first, set(candidates))))
    return first, moves


def _unplaceable(index: GraphIndex, p: Plan) -> str | None:
    """Why the call cannot go where the site starts (None when it can). Keeps the placement
    on the plan: apply, which follows the plan at once, moves what it found."""
    p.placement = _placement(index, p)
    _, moves = p.placement
    stuck = [operand.name for operand, moved in moves if moved is None]
    if not stuck:
        return None
    return (f"operand {stuck[0]} is computed after the site starts and cannot move before it (it reads a "
            "value of the site, is not a pure primitive, or a value it reads is written in place)")


def _insertion_point(index: GraphIndex, p: Plan) -> fx.Node:
    """The first node that may read the op's outputs, with late operands moved up before it."""
    first, moves = p.placement or _placement(index, p)
    for operand, moved in moves:
        if moved is None:  # plan() refuses such sites; reaching here is a bug
            raise RuntimeError(_unplaceable(index, p))
        for i, node in enumerate(moved):  # in graph order: each after what it reads
            first.prepend(node)
            index.order[node] = index.order[first] - 0.9 + i * 1e-4
    return first


def _movable_up(index: GraphIndex, operand: fx.Node, first: fx.Node, site: set) -> list[fx.Node] | None:
    """``operand`` and the nodes it is computed from that come at or after ``first``, in graph
    order, when moving them all before ``first`` keeps every value: each is a get_attr or a
    pure primitive (no in-place write, no random dropout), none is part of the site, and
    nothing writes in place into them or into what they read before the site has read them
    (the fused call reads them at ``first``). None otherwise."""
    start, end = index.order[first], max(index.order[n] for n in site)
    later, stack = set(), [operand]
    while stack:
        node = stack.pop()
        if node in later or index.order[node] < start:
            continue
        if node in site or node.op not in ("get_attr", "call_function", "call_method"):
            return None
        if node.op != "get_attr":
            c = index.view.get(node)
            if c is None or c.multi_output or mutates(node) or c.prim == "dropout":
                return None
        later.add(node)
        stack.extend(node.all_input_nodes)
    values = later | {a for n in later for a in n.all_input_nodes}
    if any(mutates(u) and start <= index.order.get(u, -1) <= end for a in values for u in a.users):
        return None
    return sorted(later, key=index.order.__getitem__)


def _permuted(graph: fx.Graph, value: fx.Node, dims: tuple[int, ...], as_op: bool) -> fx.Node:
    """``value.permute(*dims)``, tagged with ``LAYOUT_META`` so the checker knows the rewrite made it."""
    if as_op:
        node = graph.call_function(torch.ops.aten.permute.default, (value, list(dims)))
    else:
        node = graph.call_method("permute", (value, *dims))
    val = tensor_meta(value)
    for key in ("val", "example_value"):
        if key in value.meta and isinstance(val, torch.Tensor):
            node.meta[key] = val.permute(dims)
    node.meta[LAYOUT_META] = tuple(dims)
    return node


def _fused_call(graph: fx.Graph, family: str, args: tuple, options: dict, as_op: bool) -> fx.Node:
    """One call of the functional API, or (``as_op``) of its custom op with every option
    spelled out and the fake result as its ``val`` (Inductor lowers from that)."""
    if not as_op:
        return graph.call_function(add_norm if family == "add_norm" else norm_add, args, options)
    o = options
    if family == "add_norm":
        target = torch.ops.normfuse.add_norm_fwd.default
        op_args = (*args, o["kind"], o["eps"], o["weight_offset"], o["residual_scale"], o["sum_dtype"],
                   o["norm_round_dtype"], o["out_dtype"], o["return_sum"], True, o.get("x1"), o.get("rowscale"),
                   o.get("weight1"), o.get("bias1"))
    else:
        target = torch.ops.normfuse.norm_add_fwd.default
        op_args = (*args, o["kind"], o["eps"], o["weight_offset"], o["residual_scale"], o["norm_round_dtype"],
                   o["out_dtype"], o["add_dtype"], o["return_norm"])
    call = graph.call_function(target, op_args)
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in op_args]
    fake_mode = torch._guards.detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    if fake_mode is not None:
        with fake_mode:
            call.meta["val"] = target(*vals)
    return call


def output_index(as_op: bool, paired: bool) -> dict[str, int]:
    """Where y, y1 and s are among the outputs of a rewritten call: the functional API returns
    (y, s), or (y, y1, s) with a second norm; the custom op (y, s, mean, rstd, y1)."""
    if as_op:
        return {"y": 0, "s": 1, "y1": 4}
    return {"y": 0, "y1": 1, "s": 2} if paired else {"y": 0, "s": 1}


def _per_row(graph: fx.Graph, scale: fx.Node, shape: tuple, as_op: bool) -> list[fx.Node]:
    """A (B, 1, ..., 1) scale as the kernel's one number per row: reshaped and expanded to
    shape[:-1] (a view; the op reads it as rows)."""
    flat_shape, rows_shape = list(node_shape(scale)[:-1]), list(shape[:-1])
    if as_op:
        flat = graph.call_function(torch.ops.aten.view.default, (scale, flat_shape))
        rows = graph.call_function(torch.ops.aten.expand.default, (flat, rows_shape))
    else:
        flat = graph.call_method("reshape", (scale, *flat_shape))
        rows = graph.call_method("expand", (flat, *rows_shape))
    for key in ("val", "example_value"):
        val = scale.meta.get(key)
        if isinstance(val, torch.Tensor):
            flat.meta[key] = val.reshape(flat_shape)
            rows.meta[key] = flat.meta[key].expand(rows_shape)
    rows.meta[ROWS_META] = True
    return [flat, rows]


def _branch_and_partner_options(graph: fx.Graph, p: Plan, as_op: bool) -> tuple[dict, list[fx.Node]]:
    """The fused call's x1 / rowscale / dropout_p / weight1 / bias1 options (only those in use,
    so a plain site's call reads as before), and the nodes inserted for them."""
    options, inserted = {}, []
    fold = p.branch
    if fold.x1 is not None:
        options["x1"] = fold.x1
    if fold.rowscale is not None:
        inserted = _per_row(graph, fold.rowscale, node_shape(p.state.in_add.node), as_op)
        options["rowscale"] = inserted[-1]
    if fold.dropout_p:
        options["dropout_p"] = fold.dropout_p
    if p.partner is not None:
        options["weight1"], options["bias1"] = p.partner.match.weight, p.partner.match.bias
    return options, inserted


def apply(index: GraphIndex, p: Plan, as_op: bool = False) -> list[fx.Node]:
    """Insert the fused call and reroute users; returns the inserted nodes. ``as_op``: call
    the custom op itself (graphs already lowered to ATen)."""
    graph = index.graph
    m = p.state.match
    p.x, p.residual = index.resolve(p.x), index.resolve(p.residual)
    p.branch.x1 = index.resolve(p.branch.x1)
    first = _insertion_point(index, p)
    modes = dict(kind=m.kind, eps=m.eps, weight_offset=m.weight_offset, residual_scale=p.residual_scale,
                 norm_round_dtype=m.norm_round_dtype, out_dtype=m.out_dtype)
    old_nodes = list(m.nodes)
    with graph.inserting_before(first):
        if p.op == "norm_add":
            post = p.output_add
            y_used = any(u is not post for u in real_users(m.output))
            call = _fused_call(graph, "norm_add", (p.x, p.residual, m.weight, m.bias),
                               dict(modes, add_dtype=node_dtype(post), return_norm=y_used), as_op)
            out = graph.call_function(operator.getitem, (call, 0))
            _copy_meta(out, post)
            inserted = [call, out]
            if y_used:
                y = graph.call_function(operator.getitem, (call, 1))
                _copy_meta(y, m.output)
                inserted.append(y)
            post.replace_all_uses_with(out)
            index.replaced[post] = out
            if y_used:
                m.output.replace_all_uses_with(y)
                index.replaced[m.output] = y
            old_nodes.append(post)
        else:
            add = p.state.in_add if p.op == "add_norm" else None
            s_used = add is not None and any(
                u not in set(add.chain) | set(m.nodes) for node in (add.node, *add.chain) for u in real_users(node))
            x, residual, inserted = p.x, p.residual, []
            if p.permute is not None:  # the add moves through the permute: sum(a, b).permute == a.permute + b.permute
                x, residual = (None if v is None else _permuted(graph, v, p.permute, as_op) for v in (x, residual))
                inserted += [v for v in (x, residual) if v is not None]
            extra, rows = _branch_and_partner_options(graph, p, as_op)
            inserted += rows
            call = _fused_call(graph, "add_norm", (x, residual, m.weight, m.bias),
                               dict(modes, sum_dtype=p.sum_dtype, return_sum=s_used, **extra), as_op)
            where = output_index(as_op, p.partner is not None)
            y = graph.call_function(operator.getitem, (call, where["y"]))
            _copy_meta(y, m.output)
            inserted += [call, y]
            if p.partner is not None:
                partner = p.partner.match
                y1 = graph.call_function(operator.getitem, (call, where["y1"]))
                _copy_meta(y1, partner.output)
                inserted.append(y1)
                partner.output.replace_all_uses_with(y1)
                index.replaced[partner.output] = y1
                old_nodes += partner.nodes
            result = y
            if add is not None and not same_shape(node_shape(add.node), node_shape(m.output)):
                # the add and the norm see the rows in different shapes (a view between them)
                result = graph.call_method("reshape", (y, *node_shape(m.output)))
                _copy_meta(result, m.output)
                inserted.append(result)
            m.output.replace_all_uses_with(result)
            index.replaced[m.output] = result
            if s_used:
                s = graph.call_function(operator.getitem, (call, where["s"]))
                _copy_meta(s, add.node)
                inserted.append(s)
                if p.permute is not None:  # hand the sum back in the add's layout
                    inverse = tuple(sorted(range(len(p.permute)), key=p.permute.__getitem__))
                    s.meta.update({k: v.permute(p.permute) for k, v in s.meta.items()
                                   if k in ("val", "example_value") and isinstance(v, torch.Tensor)})
                    s = _permuted(graph, s, inverse, as_op)
                    _copy_meta(s, add.node)
                    inserted.append(s)
                add.node.replace_all_uses_with(s)
                index.replaced[add.node] = s
            if add is not None:
                old_nodes += [add.node, *add.chain, *p.branch.nodes]
                # the operands' scaling / upcasts that the kernel now does itself
                old_nodes += [n for n in add.node.all_input_nodes]
                old_nodes += [n for b in p.branch.nodes for n in b.all_input_nodes]
    for i, node in enumerate(inserted):  # keep graph order known for later ancestor queries
        index.order[node] = index.order[first] - 0.5 + i * 1e-3
        for user in node.users:  # their arguments changed: refresh their canonical view
            index.refresh(user)
    if p.branch.nodes:
        call.meta[FOLDED_META] = [n.name for n in p.branch.nodes]
    call.meta["stack_trace"] = m.output.meta.get("stack_trace")
    call.meta["nn_module_stack"] = m.output.meta.get("nn_module_stack")
    _erase_dead(graph, old_nodes, index)
    return inserted


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node], index: GraphIndex) -> None:
    """Erase the state's old nodes that nothing reads any more, last first."""
    # the state's own nodes are pure (arithmetic, casts, views, norm calls or norm modules)
    pending = sorted({n for n in nodes if isinstance(n, fx.Node) and n.op in ("call_function", "call_method",
                                                                             "call_module")},
                     key=lambda n: index.order.get(n, -1), reverse=True)
    for node in pending:
        if node.graph is not graph or real_users(node):
            continue
        for check in list(node.users):  # checks of a value that no longer exists
            graph.erase_node(check)
        graph.erase_node(node)
