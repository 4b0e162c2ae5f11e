"""Carry the residual pair across block boundaries.

In a Pre-Norm stack the add that ends block i feeds the norm that starts block i+1::

    for block in self.blocks:          # block: h = x + attn(norm1(x)); return h + mlp(norm2(h))
        x = block(x)
    x = self.final_norm(x)

When each block is a region of its own (activation checkpointing, an FSDP2 unit, a
per-block ``torch.compile``, a graph break), that add and that norm are never in one
graph, so no pass can fuse them. This module rewrites the stream so that the add
moves across the boundary: each block returns the un-added operands as a
``ResidualPair(hidden, residual, combine)``, and the next block starts with
``x = combine(hidden, residual)``, which then sits right before its first norm in
its own graph, where the fusion pass turns the two into one ``add_norm``. The final
norm takes the last pair the same way. The adds and norms are the same, with the same
operands, regrouped: the outputs and gradients are bit-identical to eager.

How, generically:
- the stream is a ModuleList/Sequential of blocks of one class (the Post-Norm
  conversion's rule, ``prenorm_model.block_lists``);
- the owner's forward (read from its source) must pass the stream value only from
  block to block, then straight into a norm module: ``x = block(x, ...)`` or
  ``x = checkpoint(block, x, ..., use_reentrant=False)`` (or ``True``) in the loop, ``self.norm(x)``
  next; anything else that reads the value between blocks leaves the stream as it was;
- each block's forward (read from its source) must end by returning a two-operand add:
  ``return a + b``, ``return torch.add(a, b)``, ``h = a + b; return h``, or a call of a
  local two-argument function ``return add(a, b)``. Its copy returns the pair instead,
  and takes ``(hidden, residual, combine, sum_out)`` in place of its first argument;
- the list's elements (the block itself, or the checkpoint/FSDP/compile wrapper in the
  list) unpack a pair into those three positional arguments in their ``__call__``, so
  the pair crosses every wrapper (reentrant checkpoint included) as two tensors;
- only the owner's loop gets pairs: a block called by other code (``model.layers[3](x)``,
  while the owner is not running) returns the sum, as before; so do transformers layers
  while transformers records their outputs (``output_hidden_states=True``).
No module, parameter or buffer is added: ``state_dict`` keys are unchanged.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import operator
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn

from normfuse.passes.prenorm_model import block_lists, blocks_of, is_norm_module
from normfuse.vocabulary import COPY_FILE

__all__ = ["ResidualPair", "StreamRewrite", "crosses_checkpoints", "rewrite_streams", "rewritten_streams",
           "undo_streams"]

_MARK = "_normfuse_stream"            # on the owner of a rewritten stream
_ELEMENT = "_normfuse_stream_element"  # on each of its list elements
_KEY = "_normfuse_stream_key"          # and its key in _Stream.receivers
_RECOMPUTED = "_normfuse_recomputed"  # on a block whose forward a checkpoint may run twice
_HIDDEN, _RESIDUAL, _COMBINE, _SUM_OUT = "nf_hidden", "nf_residual", "nf_combine", "nf_sum_out"


class ResidualPair(NamedTuple):
    """The stream value between two rewritten blocks: ``combine(hidden, residual)``, not yet added."""

    hidden: torch.Tensor
    residual: Optional[torch.Tensor]
    combine: Optional[Callable]


def _outputs_recorded() -> bool:
    """True while a transformers model records layer outputs (``output_hidden_states``,
    ``output_attentions``, ...): its hooks read each layer's output, so the layers return
    it added. transformers sets its collector on every call, to an empty dict when nothing
    is asked for; that case records nothing."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return bool(collected) and any(key != "_hidden_states_layers" for key in collected)


def _recorder_hooked(element: nn.Module) -> bool:
    """Whether transformers' output recorder hooks the block: it installs its hooks the first
    time outputs are asked for. Until then no output can be recorded, and the context variable
    (which dynamo can only read through a graph break, when transformers set it outside the
    traced frame) is not read."""
    return any(_RECORDER_HOOK in getattr(hook, "__qualname__", "")
               for module in (element, _inner_block(element)) for hook in module._forward_hooks.values())


def _pair(hidden: torch.Tensor, residual: torch.Tensor, combine: Callable, sum_out: bool) -> Any:
    """What a rewritten block returns in place of ``combine(hidden, residual)``."""
    if sum_out:
        return combine(hidden, residual)
    return ResidualPair(hidden, residual, combine)


def _pair_reshaped(hidden: torch.Tensor, residual: torch.Tensor, combine: Callable, sum_out: bool,
                   method: str, *shape: Any) -> Any:
    """What a rewritten block returns in place of ``combine(hidden, residual).view(*shape)``:
    the operands reshaped (the same elements, added in the next block), when they have one shape."""
    if sum_out or hidden.shape != residual.shape:
        return getattr(combine(hidden, residual), method)(*shape)
    return ResidualPair(hidden.reshape(*shape), residual.reshape(*shape), combine)


@dataclass(eq=False)
class _Stream:
    """One rewritten stream; its owner and its list elements hold the same object."""

    final_norm: str
    receivers: dict = field(default_factory=dict)  # element key -> the next element (None: the final norm)
    hooks: tuple = ()            # ids of the owner's two hooks and the final norm's pre-hook
    checkpointed: bool = False   # the owner's loop calls the blocks through checkpoint(...)
    reentrant: bool = False      # ... with use_reentrant=True: only the sum goes into a block
    transformers: bool = False   # the blocks are transformers layers (see _outputs_recorded)
    cross_checkpoints: bool = False  # hand pairs into checkpointed blocks too
    entry_add: str | None = None     # where the add right before the owner's loop is (StreamRewrite)
    running: int = 0             # > 0 while the owner's forward runs


def _enter_owner(owner: nn.Module, args: tuple) -> None:
    owner.__dict__[_MARK].running += 1


def _leave_owner(owner: nn.Module, args: tuple, output: Any) -> None:
    owner.__dict__[_MARK].running -= 1


def _in_stream(stream: _Stream, first_arg: Any) -> bool:
    """Whether a block was called by its owner's loop (it hands a pair on) or by other code
    (``model.layers[3](x)``: it returns the tensor, as before the rewrite)."""
    if isinstance(first_arg, tuple) or stream.running:
        return True
    # a checkpoint in the owner's loop recomputes block 0 in backward, after the owner returned
    return stream.checkpointed and torch._C._current_graph_task_id() != -1


def _as_pair(value: Any) -> ResidualPair:
    # A checkpoint or wrapper may hand the NamedTuple back as a plain tuple.
    if isinstance(value, tuple) and len(value) == 3 and (value[2] is None or callable(value[2])):
        return ResidualPair(*value)
    return ResidualPair(value, None, None)


def _added(pair: ResidualPair) -> torch.Tensor:
    return _combine(pair.hidden, pair.residual, pair.combine)


def _combine(hidden: torch.Tensor, residual: Optional[torch.Tensor], combine: Optional[Callable],
             block: Optional[nn.Module] = None) -> torch.Tensor:
    """The add moved to the start of the next block (or the final norm)."""
    if residual is None:
        return hidden
    if combine is operator.add:
        return hidden + residual
    if block is not None and (block.__dict__.get(_RECOMPUTED) or getattr(block, "gradient_checkpointing", False)):
        # The block's own add function may add in place (``f += x``). It ran inside the
        # block that made its operands; it now runs on this block's inputs, which a
        # checkpoint keeps and hands over again when it recomputes the block: copies.
        return combine(hidden.clone(), residual.clone())
    return combine(hidden, residual)


def _keeps_inputs(element: nn.Module, stream: _Stream) -> bool:
    """Whether the element runs its block under a checkpoint now, which keeps the block's
    inputs for the recompute: a pair would be kept as two tensors where the sum is one.
    (A checkpoint in the owner's loop decides alike in the forward, which a reentrant one
    runs without grad, and in the recompute.)"""
    return _checkpoints_block(element, stream, now=True) and (stream.checkpointed or torch.is_grad_enabled())


def _checkpoints_block(element: nn.Module, stream: _Stream, now: bool = False) -> bool:
    """Whether the element runs its block under a checkpoint when grad is on (``now``: and
    in the block's current mode; transformers checkpoints in training mode only)."""
    if stream.checkpointed:
        return True
    # plain dictionary reads: this runs inside traced frames, where a getattr that raises
    # (nn.Module.__getattr__) costs dynamo a graph
    module = element
    while module is not None:  # checkpoint_wrapper anywhere in the wrappers
        if "_checkpoint_wrapped_module" in module._modules:
            return True
        module = module._modules.get("_orig_mod")
    block = _inner_block(element)  # transformers' GradientCheckpointingLayer
    return bool(block.__dict__.get("gradient_checkpointing", False)) and (block.training or not now)


def _hands_pair(element: nn.Module, stream: _Stream) -> bool:
    """Whether the element hands its block's pair on, in its owner's loop: not into a block
    that keeps its inputs for a recompute, unless asked (cross_checkpoints); the last block's
    pair goes to the final norm."""
    # by a string key: dynamo would make an int index dynamic (an empty graph per block under
    # FSDP2), and a module held by each element would chain deepcopy's recursion block to block
    receiver = stream.receivers[element.__dict__[_KEY]]
    if receiver is None:
        return True
    if stream.reentrant:  # a reentrant checkpoint's autograd sees only tensor arguments
        return False
    return stream.cross_checkpoints or not _keeps_inputs(receiver, stream)


class _StreamElement:
    """Mixin of the stream's list elements: a pair enters as three positional arguments, and
    a fourth says whether the block returns the sum (see _in_stream, _outputs_recorded)."""

    def __call__(self, *args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        else:  # the stream passed by its name, e.g. block(hidden_states=x)
            hidden = kwargs.pop(type(_inner_block(self)).forward.nf_stream_arg)
        stream = self.__dict__[_ELEMENT]
        in_stream = _in_stream(stream, hidden)
        sum_out = (not in_stream or not _hands_pair(self, stream)
                   or (stream.transformers and _recorder_hooked(self) and _outputs_recorded()))
        pair = _as_pair(hidden)
        out = super().__call__(pair.hidden, pair.residual, pair.combine, sum_out, *args, **kwargs)
        return out if sum_out else _as_pair(out)  # a sum goes on as the tensor it is


def _add_pair_first(module: nn.Module, args: tuple):
    """First forward pre-hook of the final norm. Its forward adds the pair itself (so the add
    is in the norm's graph); when other input hooks follow (SequenceParallel wraps the input
    in a DTensor) or the forward could not be copied, the pair is added here, before them.
    FSDP2's pre-forward passes a pair through untouched (it casts and hooks the tensors inside
    the arguments; torchtitan shards the final norm with the output head)."""
    if not (args and isinstance(args[0], tuple)):
        return None
    # plain attribute reads and a count: dynamo traces this hook inside the owner's graph
    others = len(module._forward_pre_hooks) - 1 - hasattr(type(module), "_get_fsdp_state")
    if others > 0 or not getattr(type(module), "_normfuse_forward", ""):  # FSDP2 subclasses the swapped class
        return (_added(_as_pair(args[0])), *args[1:])
    return None


_SWAPPED: dict[tuple, type] = {}
_MIXINS = {"_StreamElement": _StreamElement}
_SWAPPED_PREFIX = "_nf_swapped_"


def _swapped_class(base: type, mixins: tuple, forward: str) -> type:
    """The subclass of ``base`` with ``mixins`` first and the ``forward`` kind ("pair",
    "entry_add", "" for its own).
    One per (class, mixins, forward): the blocks of a list keep sharing one class. Its
    qualified name encodes how to build it again, so a pickled model loads (see __getattr__)."""
    key = (base, mixins, forward)
    if key not in _SWAPPED:
        spec = json.dumps([base.__module__, base.__qualname__, [m.__name__ for m in mixins], forward])
        attrs = {"__module__": __name__, "__qualname__": _SWAPPED_PREFIX + spec.encode().hex(),
                 "_normfuse_base": base, "_normfuse_mixins": mixins, "_normfuse_forward": forward}
        if forward:  # a class attribute, so module paths in graphs read "blocks.0.norm1"
            attrs["forward"] = _new_forward(base, forward)
        _SWAPPED[key] = type(base.__name__, (*mixins, base), attrs)
    return _SWAPPED[key]


def __getattr__(name: str):
    # unpickling a rewritten model looks its block classes up here
    if not name.startswith(_SWAPPED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, qualname, mixins, forward = json.loads(bytes.fromhex(name[len(_SWAPPED_PREFIX):]))
    base = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    return _swapped_class(base, tuple(_MIXINS[m] for m in mixins), forward)


def _swap_class(module: nn.Module, mixin: type | None = None, forward: str = "") -> None:
    """Give ``module`` its swapped class, adding ``mixin`` and/or a forward kind."""
    cls = type(module)
    base = cls.__dict__.get("_normfuse_base", cls)
    mixins = tuple(m for m in (*cls.__dict__.get("_normfuse_mixins", ()), mixin) if m is not None)
    module.__class__ = _swapped_class(base, mixins, forward or cls.__dict__.get("_normfuse_forward", ""))


def _unswap_class(module: nn.Module) -> None:
    base = type(module).__dict__.get("_normfuse_base")
    if base is not None:
        module.__class__ = base


# --------------------------------------------------------------------------- source analysis

class NotFit(Exception):
    """The stream or block does not have the shape the rewrite needs; the message says why."""


def _function_ast(fn: Callable) -> tuple[ast.FunctionDef, Callable]:
    raw = inspect.unwrap(fn)
    try:
        source = textwrap.dedent(inspect.getsource(raw))
        _, first_line = inspect.getsourcelines(raw)
    except (OSError, TypeError) as error:
        raise NotFit(f"the source of {getattr(raw, '__qualname__', raw)} is not available ({error})") from None
    tree = ast.parse(source)
    node = tree.body[0]
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or isinstance(node, ast.AsyncFunctionDef):
        raise NotFit(f"{raw.__qualname__} is not a plain function")
    ast.increment_lineno(tree, first_line - 1)
    return node, raw


def _where(fn: Callable, node: ast.AST) -> str:
    return f"{inspect.getsourcefile(fn)}:{getattr(node, 'lineno', '?')}"


def _own_nodes(fn_node: ast.FunctionDef):
    """Nodes of the function body, not of nested functions or lambdas."""
    stack = list(fn_node.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                stack.append(child)


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def _is_self_attr(node: ast.AST) -> str | None:
    if isinstance(node, ast.Attribute) and _is_name(node.value, "self"):
        return node.attr
    return None


@dataclass
class _Loop:
    stream: str          # the stream variable, e.g. "hidden_states"
    list_attr: str       # self.<list_attr> is the block list
    final_norm: str      # self.<final_norm>(stream) follows the loop
    checkpointed: bool   # the loop calls the blocks through checkpoint(...)
    reentrant: bool      # with use_reentrant=True: a pair going in would be hidden from autograd
    entry_add: str | None = None  # "file:line" of ``x = a + b`` right before the loop, when it is one


def _loop_block(loop: ast.For, list_attr: str) -> str | None:
    """The block variable of ``for block in self.<list_attr>`` (or a slice of it), of
    ``for i, block in enumerate(...)`` over the same, or, for a ModuleDict, of
    ``for block in self.<list_attr>.values()`` and ``for key, block in self.<list_attr>.items()``;
    else None."""
    def over_list(node):
        return _is_self_attr(node) == list_attr or (isinstance(node, ast.Subscript)
                                                   and _is_self_attr(node.value) == list_attr)

    def dict_method(node, name):
        return isinstance(node, ast.Call) and not node.args and isinstance(node.func, ast.Attribute) \
            and node.func.attr == name and _is_self_attr(node.func.value) == list_attr

    target, iterable = loop.target, loop.iter
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    if isinstance(iterable, ast.Call) and _is_name(iterable.func, "enumerate") and len(iterable.args) == 1 and pair:
        target, iterable = target.elts[1], iterable.args[0]
    elif dict_method(iterable, "items") and pair:
        return target.elts[1].id if isinstance(target.elts[1], ast.Name) else None
    if dict_method(iterable, "values"):
        return target.id if isinstance(target, ast.Name) else None
    return target.id if isinstance(target, ast.Name) and over_list(iterable) else None


def _analyze_owner(owner: nn.Module, list_attr: str) -> _Loop:
    """Check that the owner's forward passes the stream value only from block to block,
    then into a norm module."""
    fn_node, raw = _function_ast(type(owner).forward)
    loops = [n for n in _own_nodes(fn_node) if isinstance(n, ast.For) and _loop_block(n, list_attr)]
    if len(loops) != 1:
        raise NotFit(f"{type(owner).__name__}.forward does not loop once over self.{list_attr} "
                     f"({len(loops)} loops found)")
    loop = loops[0]
    block_var = _loop_block(loop, list_attr)
    stream, calls, reads = None, [], []
    for stmt in _loop_statements(loop.body):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        target = stmt.targets[0].id
        found = _block_calls(owner, stmt.value, block_var, target, raw)
        if found is None:
            continue
        if stream is not None and target != stream:
            raise NotFit(f"the loop over self.{list_attr} runs the blocks on `{stream}` and on `{target}` "
                         f"({_where(raw, stmt)})")
        stream = target
        calls += found[0]
        reads += found[1]
    if stream is None:
        raise NotFit(f"no `x = block(x, ...)` statement in the loop over self.{list_attr} ({_where(raw, loop)}): "
                     "the blocks must be called on the stream directly, through checkpoint(block, x, "
                     "use_reentrant=...), in an if/else or conditional expression of those, or through a "
                     "method of the model that returns one of those")
    others = [n for n in ast.walk(loop) if _is_name(n, stream) and isinstance(n.ctx, ast.Load)
              and not any(n is read for read in reads)]
    if others:
        raise NotFit(f"the loop over self.{list_attr} reads `{stream}` other than to call the next block "
                     f"({_where(raw, others[0])})")
    checkpointed = any(c.checkpoint for c in calls)
    reentrant = any(c.reentrant for c in calls)
    # The first read of the stream after the loop must be the final norm.
    after = [n for n in _own_nodes(fn_node) if getattr(n, "lineno", 0) > (loop.end_lineno or loop.lineno)]
    after.sort(key=lambda n: (n.lineno, n.col_offset))
    first = next((n for n in after if _is_name(n, stream) and isinstance(n.ctx, ast.Load)), None)
    user = next((n for n in after if isinstance(n, ast.Call) and n.args and n.args[0] is first), None)
    norm = _is_self_attr(user.func) if user is not None else None
    if norm is None or not is_norm_module(getattr(owner, norm, None) or nn.Identity()):
        raise NotFit(f"after the loop over self.{list_attr}, `{stream}` does not go straight into a norm module "
                     f"({_where(raw, first or loop)})")
    return _Loop(stream, list_attr, norm, checkpointed, reentrant, _entry_add(fn_node, raw, loop, stream))


def _entry_add(fn_node: ast.FunctionDef, raw: Callable, loop: ast.For, stream: str) -> str | None:
    """Where the stream's last value before the loop is made by a two-operand add (OPT's
    ``hidden_states = inputs_embeds + pos_embeds``), or None. That add feeds the first block's
    first norm and stays in the owner's graph: the owner's own forward is not rewritten."""
    for stmts in _bodies(fn_node):
        if loop in stmts:
            for stmt in reversed(stmts[:stmts.index(loop)]):
                if isinstance(stmt, ast.Assign) and any(_is_name(t, stream) for t in stmt.targets):
                    return _where(raw, stmt) if _split_add(fn_node, stmt.value) is not None else None
    return None


@dataclass
class _BlockCall:
    """A call that runs a block on the stream: ``block(x, ...)``, or through a checkpoint."""

    node: ast.Call
    checkpoint: bool = False   # checkpoint(block, x, ..., use_reentrant=<literal>)
    reentrant: bool = False


def _loop_statements(stmts: list):
    """The loop body's statements, with those inside if/else and with-blocks (not nested loops
    or functions: a block run there is not the stream's next block)."""
    for stmt in stmts:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _loop_statements(stmt.body)
            yield from _loop_statements(stmt.orelse)
        elif isinstance(stmt, ast.With):
            yield from _loop_statements(stmt.body)


def _is_block(node: ast.AST, block_var: str) -> bool:
    return _is_name(node, block_var) or (isinstance(node, ast.Attribute) and node.attr == "__call__"
                                         and _is_name(node.value, block_var))


def _block_call(call: ast.AST, block_var: str, stream: str, raw: Callable) -> _BlockCall | None:
    """``block(x, ...)`` or ``checkpoint(block, x, ..., use_reentrant=<literal>)``; None for another call."""
    if not isinstance(call, ast.Call):
        return None
    if _is_block(call.func, block_var) and call.args and _is_name(call.args[0], stream):
        return _BlockCall(call)
    if len(call.args) >= 2 and _is_block(call.args[0], block_var) and _is_name(call.args[1], stream):
        flag = [k.value.value for k in call.keywords if k.arg == "use_reentrant" and isinstance(k.value, ast.Constant)]
        if flag not in ([False], [True]):
            raise NotFit(f"the blocks are called through a function that may hide a pair from autograd "
                         f"({_where(raw, call)}): only checkpointing with a literal use_reentrant passes it")
        return _BlockCall(call, checkpoint=True, reentrant=flag == [True])
    return None


def _block_calls(owner: nn.Module, value: ast.expr, block_var: str, stream: str, raw: Callable
                 ) -> tuple[list[_BlockCall], list[ast.Name]] | None:
    """How ``stream = <value>`` runs the block: the block calls it makes and the reads of the
    stream they make (None when ``value`` runs no block on the stream). ``value`` is a block
    call, a conditional expression of block calls, or ``self.<method>(..., block, x, ...)``
    whose every return is one of those."""
    if isinstance(value, ast.IfExp):
        sides = [_block_calls(owner, side, block_var, stream, raw) for side in (value.body, value.orelse)]
        if all(side is None for side in sides):
            return None
        if any(side is None for side in sides):
            raise NotFit(f"one side of the conditional expression at {_where(raw, value)} does not run the block")
        return [c for side in sides for c in side[0]], [r for side in sides for r in side[1]]
    helper = _helper_calls(owner, value, block_var, stream, raw)
    if helper is not None:
        return helper
    single = _block_call(value, block_var, stream, raw)
    if single is not None:
        arg = single.node.args[1 if single.checkpoint else 0]
        return [single], [arg]
    return None


def _helper_calls(owner: nn.Module, call: ast.expr, block_var: str, stream: str, raw: Callable
                  ) -> tuple[list[_BlockCall], list[ast.Name]] | None:
    """``self.<method>(block, x)`` (the two passed positionally) whose body only runs the block
    on the stream and returns what the block returns."""
    name = _is_self_attr(call.func) if isinstance(call, ast.Call) else None
    if name is None or call.keywords:
        return None
    positions = {arg.id: i for i, arg in enumerate(call.args) if isinstance(arg, ast.Name)}
    if block_var not in positions or stream not in positions:
        return None
    method = inspect.getattr_static(type(owner), name, None)
    if not inspect.isfunction(method):
        return None
    fn_node, helper = _function_ast(method)
    params = [a.arg for a in fn_node.args.args][1:]  # after self
    if len(params) < len(call.args):
        return None
    block_param, stream_param = params[positions[block_var]], params[positions[stream]]
    calls, reads = [], []
    for ret in (n for n in _own_nodes(fn_node) if isinstance(n, ast.Return)):
        found = _block_calls(owner, ret.value, block_param, stream_param, helper) if ret.value is not None else None
        if found is None:
            raise NotFit(f"{type(owner).__name__}.{name} ({_where(helper, ret)}) returns something else than what "
                         f"the block returns")
        calls += found[0]
        reads += found[1]
    others = [n for n in _own_nodes(fn_node) if _is_name(n, stream_param) and isinstance(n.ctx, ast.Load)
              and not any(n is read for read in reads)]
    if not calls or others:
        raise NotFit(f"{type(owner).__name__}.{name} ({_where(helper, others[0] if others else fn_node)}) reads "
                     f"`{stream_param}` other than to call the block")
    return calls, [call.args[positions[stream]]]


def _bodies(fn_node: ast.FunctionDef):
    """Every statement list of the function (not of nested functions)."""
    for node in [fn_node, *_own_nodes(fn_node)]:
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt) \
                    and (node is fn_node or not isinstance(node, (ast.FunctionDef, ast.Lambda))):
                yield stmts
        for handler in getattr(node, "handlers", []):
            yield handler.body


def _split_add(fn_node: ast.FunctionDef, value: ast.expr):
    """(a, b, combine expression, reshape call or None) when ``value`` is a two-operand add,
    or such an add reshaped (``(a + b).view(shape)``, OPT), else None."""
    reshape = None
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
            and value.func.attr in ("view", "reshape") and not value.keywords:
        reshape, value = value, value.func.value
    add = ast.Attribute(value=ast.Name(id="_nf_operator", ctx=ast.Load()), attr="add", ctx=ast.Load())
    if isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add):
        return value.left, value.right, add, reshape
    if isinstance(value, ast.Call) and len(value.args) == 2 and not value.keywords \
            and not any(isinstance(a, ast.Starred) for a in value.args):
        func = value.func
        if isinstance(func, ast.Attribute) and _is_name(func.value, "torch") and func.attr == "add":
            return value.args[0], value.args[1], add, reshape
        # a local two-argument function (``add = lambda a, b: ...``): the next block calls it
        if isinstance(func, ast.Name) and any(isinstance(n, ast.Name) and n.id == func.id
                                              and isinstance(n.ctx, ast.Store) for n in _own_nodes(fn_node)):
            return value.args[0], value.args[1], func, reshape
    return None


def _reads_only_self(node: ast.expr) -> bool:
    """A condition that reads nothing but attributes of ``self`` and constants (a config
    switch such as OPT's ``not self.do_layer_norm_before``): evaluating it again is harmless."""
    allowed = (ast.Attribute, ast.Name, ast.Constant, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Load,
               ast.Not, ast.And, ast.Or, ast.Is, ast.IsNot, ast.Eq, ast.NotEq)
    return all(isinstance(n, allowed) for n in ast.walk(node)) and \
        all(n.id == "self" for n in ast.walk(node) if isinstance(n, ast.Name))


def _switches_before(stmts: list, i: int) -> int:
    """How many ``if <config switch>: ...`` statements (no else, no return, no attribute
    set, so no switch changes another) end right before statement ``i``."""
    k = 0
    while i - k - 1 >= 0:
        stmt = stmts[i - k - 1]
        if not (isinstance(stmt, ast.If) and not stmt.orelse and _reads_only_self(stmt.test)
                and not any(isinstance(n, ast.Return) or (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store))
                            for n in ast.walk(stmt))):
            break
        k += 1
    return k


def _defer_final_adds(fn_node: ast.FunctionDef, raw: Callable) -> int:
    """Make every ``return a + b`` (or ``h = a + b; return h``) return ``ResidualPair(a, b, add)``;
    other returns stay (their value travels as a pair with no residual). Returns how many.

    Config switches between the add and ``return h`` (OPT: ``if not self.do_layer_norm_before:
    h = norm(h)``) keep their code on the path where one of them is on; the pair is
    returned where all are off."""
    rewritten = 0
    for stmts in list(_bodies(fn_node)):
        for i in range(len(stmts) - 1, -1, -1):
            ret = stmts[i]
            if not isinstance(ret, ast.Return) or ret.value is None:
                continue
            value, first = ret.value, i
            if isinstance(ret.value, ast.Name):
                switches = _switches_before(stmts, i)
                before = stmts[i - switches - 1] if i - switches >= 1 else None
                if isinstance(before, ast.Assign) and len(before.targets) == 1 \
                        and _is_name(before.targets[0], ret.value.id):
                    value, first = before.value, i - switches - 1
            split = _split_add(fn_node, value)
            if split is None:
                continue
            a, b, combine, reshape = split
            sum_out = ast.Name(id=_SUM_OUT, ctx=ast.Load())
            if reshape is None:
                pair = ast.Call(func=ast.Name(id="_nf_pair", ctx=ast.Load()), args=[a, b, combine, sum_out], keywords=[])
            else:
                pair = ast.Call(func=ast.Name(id="_nf_pair_reshaped", ctx=ast.Load()),
                                args=[a, b, combine, sum_out, ast.Constant(reshape.func.attr), *reshape.args],
                                keywords=[])
            tail = stmts[first:i + 1]
            switches = [stmt.test for stmt in tail[1:-1]]
            new = [ast.Return(value=pair)]
            if switches:  # the original tail where a switch is on
                test = switches[0] if len(switches) == 1 else ast.BoolOp(op=ast.Or(), values=switches)
                new.insert(0, ast.If(test=test, body=tail, orelse=[]))
            for stmt in new:
                ast.copy_location(stmt, ret)
                ast.fix_missing_locations(stmt)
            stmts[first:i + 1] = new
            rewritten += 1
    if not rewritten:
        raise NotFit(f"{raw.__qualname__} does not return a two-operand add (`return a + b`, "
                     f"`h = a + b; return h`, `return torch.add(a, b)`)")
    return rewritten


_FORWARDS: dict[tuple[type, str], Callable] = {}


def _base_class(module: nn.Module) -> type:
    return type(module).__dict__.get("_normfuse_base", type(module))


def _new_forward(cls: type, kind: str) -> Callable:
    """The "pair" forward of a block class, or the "entry_add" forward of a norm class; once per class."""
    if (cls, kind) not in _FORWARDS:
        _FORWARDS[cls, kind] = _FORWARD_BUILDERS[kind](cls)
    return _FORWARDS[cls, kind]


def _build_pair_forward(cls: type) -> Callable:
    """A copy of the block's forward that takes (hidden, residual, combine, sum_out) for its
    first argument and returns the final add's operands as a ResidualPair (their sum when
    sum_out)."""
    fn_node, raw = _function_ast(cls.forward)
    if raw.__code__.co_freevars:  # (super() needs __class__, ...)
        raise NotFit(f"{raw.__qualname__} uses enclosing variables {raw.__code__.co_freevars}")
    args = fn_node.args
    if len(args.args) < 2 or args.posonlyargs:
        raise NotFit(f"{raw.__qualname__} takes no positional stream argument")
    stream = args.args[1].arg
    _defer_final_adds(fn_node, raw)
    args.args[1:2] = [ast.arg(arg=n) for n in (_HIDDEN, _RESIDUAL, _COMBINE, _SUM_OUT)]
    # x = combine(hidden, residual): the moved add, right at the start of the block
    entry = ast.parse(f"{stream} = _nf_combine({_HIDDEN}, {_RESIDUAL}, {_COMBINE}, {args.args[0].arg})").body[0]
    ast.copy_location(entry, fn_node.body[0])
    ast.fix_missing_locations(entry)
    fn_node.body.insert(0, entry)
    forward = _compile_function(fn_node, raw, {"_nf_pair": _pair, "_nf_pair_reshaped": _pair_reshaped,
                                               "_nf_operator": operator, "_nf_combine": _combine})
    forward.nf_stream_arg = stream
    return forward


def _traced_file_name(raw: Callable) -> str:
    """The file name of an edited copy of ``raw``: its own, so a site names the model's line,
    unless dynamo skips frames of that file (torch.nn's norms and layers): a frame started
    there is never captured, so a final ``nn.RMSNorm`` called from a frame dynamo gave up on
    (FSDP2's hooks break the owner's loop) would run eagerly, unfused and unreported."""
    from torch._dynamo import trace_rules

    path = inspect.getsourcefile(raw) or "<normfuse>"
    if trace_rules.check_verbose(raw).skipped:
        return COPY_FILE.format(path=path)  # provenance.source_of reads the original path back
    return path


def _compile_function(fn_node: ast.FunctionDef, raw: Callable, helpers: dict) -> Callable:
    """Compile an edited copy of ``raw`` under its own file name and module globals."""
    fn_node.decorator_list = []  # decorators (HF's kwarg renames) are not re-applied
    # Built inside a factory so the helpers are closure cells: the function keeps the
    # module's own globals (dynamo resolves globals through the module).
    factory = ast.FunctionDef(name="_nf_factory", args=ast.arguments(
        posonlyargs=[], args=[ast.arg(arg=name) for name in helpers], kwonlyargs=[], kw_defaults=[], defaults=[]),
        body=[fn_node, ast.Return(value=ast.Name(id=fn_node.name, ctx=ast.Load()))],
        decorator_list=[], returns=None, type_params=[])
    ast.copy_location(factory, fn_node)
    ast.fix_missing_locations(factory)
    code = compile(ast.Module(body=[factory], type_ignores=[]), _traced_file_name(raw), "exec")
    namespace: dict = {}
    exec(code, raw.__globals__, namespace)
    new = namespace["_nf_factory"](*helpers.values())
    new.__qualname__ = raw.__qualname__
    return new


def _add_if_pair(x: Any) -> Any:
    return _added(_as_pair(x)) if isinstance(x, tuple) else x


def _build_entry_add_forward(cls: type) -> Callable:
    """A copy of the final norm's forward that first adds a pair it is given. (A copy, not a
    wrapper: its frames keep the norm's own file, so the site still names the model's line,
    and the add is in the norm's graph even when dynamo compiles the norm's frame alone,
    as under FSDP2, whose hooks break the owner's loop.)"""
    fn_node, raw = _function_ast(cls.forward)
    if raw.__code__.co_freevars or len(fn_node.args.args) < 2:
        raise NotFit(f"{raw.__qualname__} cannot take the pair")
    name = fn_node.args.args[1].arg
    fn_node.args.args[1] = ast.arg(arg=_HIDDEN)
    entry = ast.parse(f"{name} = _nf_add_if_pair({_HIDDEN})").body[0]
    ast.copy_location(entry, fn_node.body[0])
    ast.fix_missing_locations(entry)
    fn_node.body.insert(0, entry)
    return _compile_function(fn_node, raw, {"_nf_add_if_pair": _add_if_pair})


_FORWARD_BUILDERS = {"pair": _build_pair_forward, "entry_add": _build_entry_add_forward}


# --------------------------------------------------------------------------- install

@dataclass
class StreamRewrite:
    """What ``rewrite_streams`` did to one block list."""

    fqn: str
    blocks: int = 0
    final_norm: str | None = None
    reason: str | None = None     # why the stream was left as it was
    checkpointed: bool = False    # the blocks run under checkpoints (as the rewrite found them)
    cross_checkpoints: bool = False
    reentrant: bool = False       # ... reentrant ones, in the owner's loop
    entry_add: str | None = None  # "file:line" of the add right before the loop (it feeds the first block)

    @property
    def applied(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        text = self._describe()
        if self.applied and self.checkpointed and self.entry_add:
            text += (f"; the add before the loop ({self.entry_add}) stays outside the first block's checkpoint, so "
                     "the first block's first norm is fused without it (the owner's own forward is not rewritten)")
        return text

    def _describe(self) -> str:
        if self.applied and self.reentrant:
            return (f"cross-block: {self.fqn}: the last of {self.blocks} checkpointed blocks hands the residual pair "
                    f"to {self.final_norm}; the others hand on the sum (a reentrant checkpoint would hide a pair "
                    f"from autograd)")
        if self.applied and self.checkpointed and not self.cross_checkpoints:
            return (f"cross-block: {self.fqn}: the last of {self.blocks} checkpointed blocks hands the residual pair "
                    f"to {self.final_norm}; the others hand on the sum, which their checkpoints keep as one tensor "
                    f"(cross_checkpoints=True hands pairs into them too: every add fused, one more activation "
                    f"per block kept)")
        if self.applied:
            return (f"cross-block: {self.fqn}: {self.blocks} blocks hand the residual pair to the next block "
                    f"and the last to {self.final_norm}")
        return f"cross-block: {self.fqn}: left as it was: {self.reason}"


def _inner_block(element: nn.Module) -> nn.Module:
    """The block under its wrappers (torch.compile's OptimizedModule, checkpoint_wrapper)."""
    for attr in ("_orig_mod", "_checkpoint_wrapped_module"):  # submodules of the wrapper
        inner = element._modules.get(attr)
        if inner is not None:
            return _inner_block(inner)
    return element


# Forward hooks known to take a pair as the block's output: FSDP2's post-forward (it only
# registers backward hooks on the output's tensors) and transformers' output recorder
# (the blocks return the added stream while it records, see _outputs_recorded).
_RECORDER_HOOK = "output_capturing_hook"
_PAIR_SAFE_HOOKS = ("FSDPState._post_forward", _RECORDER_HOOK)


def _check_output_hooks(element: nn.Module, fqn: str) -> None:
    for module in {element, _inner_block(element)}:
        for hook in module._forward_hooks.values():
            name = getattr(hook, "__qualname__", type(hook).__name__)
            if not any(safe in name for safe in _PAIR_SAFE_HOOKS):
                raise NotFit(f"a forward hook on the blocks of {fqn} ({name}) reads a block's output, "
                             f"which would be the un-added pair")


def rewrite_streams(model: nn.Module, cross_checkpoints: bool = False) -> list[StreamRewrite]:
    """Rewrite every Pre-Norm block stream of ``model`` to carry the residual pair across
    block boundaries (see the module docstring). Streams that do not fit are left as they
    were, with the reason. Idempotent; a second call sets ``cross_checkpoints`` (hand pairs
    into checkpointed blocks too, see _hands_pair)."""
    results = []
    owner_of = {name: mod for name, mod in model.named_modules()}
    for fqn in block_lists(model):
        result = StreamRewrite(fqn)
        results.append(result)
        parent_fqn, _, attr = fqn.rpartition(".")
        owner = owner_of.get(parent_fqn, model) if fqn else model
        if getattr(owner, _MARK, None):
            stream = owner.__dict__[_MARK]
            stream.cross_checkpoints = cross_checkpoints
            _describe(result, stream, blocks_of(owner.get_submodule(attr)), parent_fqn)
            continue
        try:
            if not fqn:
                raise NotFit("the model is itself the block list; there is no loop to carry a pair through")
            loop = _analyze_owner(owner, attr)
            elements = blocks_of(owner.get_submodule(attr))
            for element in elements:  # every block must fit before any is changed
                _new_forward(_base_class(_inner_block(element)), "pair")
                _check_output_hooks(element, fqn)
        except NotFit as why:
            result.reason = str(why)
            continue
        except Exception as error:  # noqa: BLE001 - reading unusual source must not break the model
            result.reason = f"not analysed ({type(error).__name__}: {error})"
            continue
        stream = _Stream(loop.final_norm, checkpointed=loop.checkpointed, reentrant=loop.reentrant,
                         entry_add=loop.entry_add,
                         transformers=_base_class(_inner_block(elements[0])).__module__.startswith("transformers."),
                         cross_checkpoints=cross_checkpoints)
        for index, element in enumerate(elements):
            inner = _inner_block(element)
            _swap_class(inner, forward="pair")
            if loop.checkpointed or hasattr(element, "_checkpoint_wrapped_module"):
                inner.__dict__[_RECOMPUTED] = True
            _swap_class(element, _StreamElement)
            element.__dict__[_ELEMENT], element.__dict__[_KEY] = stream, str(index)
            stream.receivers[str(index)] = elements[index + 1] if index + 1 < len(elements) else None
        norm = getattr(owner, loop.final_norm)
        try:
            _swap_class(norm, forward="entry_add")
        except NotFit:
            pass  # the pre-hook adds the pair
        # first of its pre-hooks: a SequenceParallel (or other) input hook then sees a tensor
        stream.hooks = (norm.register_forward_pre_hook(_add_pair_first, prepend=True).id,
                        owner.register_forward_pre_hook(_enter_owner, prepend=True).id,
                        owner.register_forward_hook(_leave_owner, always_call=True).id)
        object.__setattr__(owner, _MARK, stream)
        _describe(result, stream, elements, parent_fqn)
    return results


def _describe(result: StreamRewrite, stream: _Stream, elements: list, parent_fqn: str) -> None:
    result.blocks = len(elements)
    result.final_norm = f"{parent_fqn + '.' if parent_fqn else ''}{stream.final_norm}"
    result.checkpointed = any(_checkpoints_block(e, stream) for e in elements)
    result.cross_checkpoints, result.reentrant = stream.cross_checkpoints, stream.reentrant
    result.entry_add = stream.entry_add


def rewritten_streams(model: nn.Module) -> list[str]:
    """The owners of ``model``'s rewritten streams, by module path."""
    return [fqn for fqn, module in model.named_modules() if _MARK in module.__dict__]


def crosses_checkpoints(model: nn.Module) -> bool:
    """Whether a rewritten stream of ``model`` hands pairs into checkpointed blocks."""
    return any(_MARK in m.__dict__ and m.__dict__[_MARK].cross_checkpoints for m in model.modules())


def undo_streams(model: nn.Module, owners: Optional[list[str]] = None) -> None:
    """Put every rewritten stream of ``model`` back as it was (or those of ``owners``, module
    paths as ``rewritten_streams`` gives them)."""
    for fqn in block_lists(model):
        parent_fqn, _, attr = fqn.rpartition(".")
        if owners is not None and parent_fqn not in owners:
            continue
        owner = model.get_submodule(parent_fqn) if parent_fqn else model
        stream = owner.__dict__.pop(_MARK, None)
        if stream is None:
            continue
        norm = getattr(owner, stream.final_norm)
        for hooks in (norm._forward_pre_hooks, owner._forward_pre_hooks, owner._forward_hooks):
            for hook_id in stream.hooks:
                hooks.pop(hook_id, None)
        owner._forward_hooks_always_called.pop(stream.hooks[2], None)
        _unswap_class(norm)
        for element in blocks_of(owner.get_submodule(attr)):
            element.__dict__.pop(_ELEMENT, None)
            element.__dict__.pop(_KEY, None)
            _inner_block(element).__dict__.pop(_RECOMPUTED, None)
            _unswap_class(_inner_block(element))
            _unswap_class(element)
