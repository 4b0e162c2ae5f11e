"""The model's source, read and edited: what decides whether a stream fits, and the edited
copies of forwards the rewritten classes run (normfuse/passes/cross_block/__init__.py
explains the rewrite).

Reading: ``_analyze_owner`` finds the owner's loop over its block list in the owner's
forward (a ``_Loop``): the blocks called on the stream, directly, through
``checkpoint(block, x, use_reentrant=...)``, in an if/else, a conditional expression or a
method of the owner, and the stream going straight into a norm module after the loop.
What does not fit raises ``NotFit``, whose message the report shows.

Editing: ``_new_forward`` compiles, once per class, an edited copy of a forward: a block's
"pair" forward (it takes the pair in place of its first argument and returns the operands of
its final add, ``_defer_final_adds``) or the final norm's "entry_add" forward (it first adds
a pair it is given). The copies call the helpers of normfuse/passes/cross_block/runtime.py,
keep their module's globals and, unless dynamo would skip it, their file name, so a fused
site still names the model's line.
"""

from __future__ import annotations

import ast
import copy
import inspect
import operator
import textwrap
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from normfuse.passes.blocks import is_norm_module
from normfuse.passes.cross_block.runtime import _add_if_pair, _combine, _owner_test, _pair, _pair_reshaped
from normfuse.vocabulary import COPY_FILE


class NotFit(Exception):
    """The stream or block does not have the shape the rewrite needs; the message says why."""


# --------------------------------------------------------------------------- reading

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
    checkpointed: bool   # the loop may call the blocks through checkpoint(...)
    reentrant: bool      # with use_reentrant=True: a pair going in would be hidden from autograd
    entry_add: str | None = None  # "file:line" of ``x = a + b`` right before the loop, when it is one
    # when the loop checkpoints, as an expression over the owner (``self``) only, e.g.
    # "self.checkpointing" or "True"; None when the condition reads more than the owner
    checkpoint_if: str | None = None


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
    for stmt, when in _loop_statements(loop.body):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        target = stmt.targets[0].id
        found = _block_calls(owner, stmt.value, block_var, target, raw, when)
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
    stores = [n for n in ast.walk(loop) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)]
    checkpoint_if = None if stores else _checkpoint_condition(calls)
    # The first read of the stream after the loop must be the final norm.
    after = [n for n in _own_nodes(fn_node) if getattr(n, "lineno", 0) > (loop.end_lineno or loop.lineno)]
    after.sort(key=lambda n: (n.lineno, n.col_offset))
    first = next((n for n in after if _is_name(n, stream) and isinstance(n.ctx, ast.Load)), None)
    user = next((n for n in after if isinstance(n, ast.Call) and n.args and n.args[0] is first), None)
    norm = _is_self_attr(user.func) if user is not None else None
    if norm is None or not is_norm_module(getattr(owner, norm, None) or nn.Identity()):
        raise NotFit(f"after the loop over self.{list_attr}, `{stream}` does not go straight into a norm module "
                     f"({_where(raw, first or loop)})")
    # Any later read must see a new value (``x = self.norm(x)``, then ``return x``): the loop's own
    # value is the pair, which only the final norm adds (videoprism also returns the stream as is).
    assigned = [(n.end_lineno, n.end_col_offset) for n in after if isinstance(n, (ast.Assign, ast.AugAssign))
                and n.lineno >= first.lineno and any(_is_name(t, stream) for t in
                                                     (n.targets if isinstance(n, ast.Assign) else [n.target]))]
    # (``self.norm(h) if self.norm is not None else h``: the other side runs only without the norm)
    skipped = {id(n) for side in _sides_without(fn_node, user, owner) for n in ast.walk(side)}
    again = next((n for n in after if _is_name(n, stream) and isinstance(n.ctx, ast.Load) and n is not first
                  and id(n) not in skipped and not any(end <= (n.lineno, n.col_offset) for end in assigned)), None)
    if again is not None:
        raise NotFit(f"after the loop over self.{list_attr}, `{stream}` is read again besides the final norm "
                     f"({_where(raw, again)})")
    return _Loop(stream, list_attr, norm, checkpointed, reentrant, _entry_add(fn_node, raw, loop, stream),
                 checkpoint_if)


def _sides_without(fn_node: ast.FunctionDef, call: ast.Call, owner: nn.Module) -> list[ast.expr]:
    """The other sides of the conditional expressions around ``call`` whose test reads only the
    owner and holds for it now (``self.norm(h) if self.norm is not None else h``)."""
    sides = []
    for node in _own_nodes(fn_node):
        if isinstance(node, ast.IfExp) and any(n is call for n in ast.walk(node.body)) \
                and _reads_only_self(node.test):
            try:
                holds = bool(_owner_test(ast.unparse(node.test))(owner))
            except Exception:  # noqa: BLE001 - a test that cannot be evaluated now: not taken as holding
                holds = False
            if holds:
                sides.append(node.orelse)
    return sides


def _checkpoint_condition(calls: list[_BlockCall]) -> str | None:
    """When the loop runs a block under a checkpoint, as one expression over the owner: the
    conditions of its checkpoint calls joined by ``or`` ("True" for a call made always, "False"
    when there is none); None when one of them reads more than the owner (a loop variable, a
    local), so that it cannot be evaluated before the next block is called."""
    sides = []
    for call in calls:
        if not call.checkpoint:
            continue
        if not all(_reads_only_self(test) for test in call.when):
            return None
        sides.append(_joined("and", [ast.unparse(test) for test in call.when]) or "True")
    return _joined("or", sides) or "False"


def _joined(op: str, terms: list[str]) -> str:
    return terms[0] if len(terms) == 1 else f" {op} ".join(f"({term})" for term in terms)


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
    when: tuple[ast.expr, ...] = ()  # the tests (all true) under which the code makes this call


def _negated(test: ast.expr) -> ast.expr:
    return ast.UnaryOp(op=ast.Not(), operand=test)


def _loop_statements(stmts: list, when: tuple[ast.expr, ...] = ()):
    """The loop body's statements, with those inside if/else and with-blocks (not nested loops
    or functions: a block run there is not the stream's next block), each with the tests under
    which it runs. After ``if c: ... return`` (no else), what follows runs when ``not c``."""
    for stmt in stmts:
        yield stmt, when
        if isinstance(stmt, ast.If):
            yield from _loop_statements(stmt.body, (*when, stmt.test))
            yield from _loop_statements(stmt.orelse, (*when, _negated(stmt.test)))
            if not stmt.orelse and stmt.body and isinstance(stmt.body[-1], (ast.Return, ast.Continue, ast.Break)):
                when = (*when, _negated(stmt.test))
        elif isinstance(stmt, ast.With):
            yield from _loop_statements(stmt.body, when)


def _is_block(node: ast.AST, block_var: str) -> bool:
    return _is_name(node, block_var) or (isinstance(node, ast.Attribute) and node.attr == "__call__"
                                         and _is_name(node.value, block_var))


def _block_call(call: ast.AST, block_var: str, stream: str, raw: Callable, when: tuple = ()) -> _BlockCall | None:
    """``block(x, ...)`` or ``checkpoint(block, x, ..., use_reentrant=<literal>)``; None for another call."""
    if not isinstance(call, ast.Call):
        return None
    if _is_block(call.func, block_var) and call.args and _is_name(call.args[0], stream):
        return _BlockCall(call, when=when)
    if len(call.args) >= 2 and _is_block(call.args[0], block_var) and _is_name(call.args[1], stream):
        flag = [k.value.value for k in call.keywords if k.arg == "use_reentrant" and isinstance(k.value, ast.Constant)]
        if flag not in ([False], [True]):
            raise NotFit(f"the blocks are called through a function that may hide a pair from autograd "
                         f"({_where(raw, call)}): only checkpointing with a literal use_reentrant passes it")
        return _BlockCall(call, checkpoint=True, reentrant=flag == [True], when=when)
    return None


def _block_calls(owner: nn.Module, value: ast.expr, block_var: str, stream: str, raw: Callable,
                 when: tuple = ()) -> tuple[list[_BlockCall], list[ast.Name]] | None:
    """How ``stream = <value>`` runs the block: the block calls it makes and the reads of the
    stream they make (None when ``value`` runs no block on the stream). ``value`` is a block
    call, a conditional expression of block calls, or ``self.<method>(..., block, x, ...)``
    whose every return is one of those. ``when``: the tests under which the code evaluates
    ``value``; each call found carries them, and those of the branches that lead to it."""
    if isinstance(value, ast.IfExp):
        sides = [_block_calls(owner, side, block_var, stream, raw, (*when, test))
                 for side, test in ((value.body, value.test), (value.orelse, _negated(value.test)))]
        if all(side is None for side in sides):
            return None
        if any(side is None for side in sides):
            raise NotFit(f"one side of the conditional expression at {_where(raw, value)} does not run the block")
        return [c for side in sides for c in side[0]], [r for side in sides for r in side[1]]
    helper = _helper_calls(owner, value, block_var, stream, raw, when)
    if helper is not None:
        return helper
    single = _block_call(value, block_var, stream, raw, when)
    if single is not None:
        arg = single.node.args[1 if single.checkpoint else 0]
        return [single], [arg]
    return None


def _helper_calls(owner: nn.Module, call: ast.expr, block_var: str, stream: str, raw: Callable,
                  when: tuple = ()) -> tuple[list[_BlockCall], list[ast.Name]] | None:
    """``self.<method>(block, x)`` (the two passed positionally) whose body only runs the block
    on the stream and returns what the block returns. Its ``self`` is the owner, so the tests
    in its body are tests of the owner too."""
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
    returns = [(stmt, (*when, *tests)) for stmt, tests in _loop_statements(fn_node.body)
               if isinstance(stmt, ast.Return)]
    if len(returns) != sum(isinstance(n, ast.Return) for n in _own_nodes(fn_node)):
        raise NotFit(f"{type(owner).__name__}.{name} ({_where(helper, fn_node)}) returns from inside a loop or a try")
    for ret, tests in returns:
        found = _block_calls(owner, ret.value, block_param, stream_param, helper, tests) \
            if ret.value is not None else None
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


# --------------------------------------------------------------------------- editing

# the names the edited forwards give what they take in place of the stream (a block's
# forward takes all four, the final norm's the first)
_HIDDEN, _RESIDUAL, _COMBINE, _SUM_OUT = "nf_hidden", "nf_residual", "nf_combine", "nf_sum_out"


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
    """Make every ``return a + b`` (or ``h = a + b; return h``) return the pair ``(a, b, add)``
    unless asked for the sum; another return hands its value on as a pair with no residual.
    Returns how many adds.

    Config switches between the add and ``return h`` (OPT: ``if not self.do_layer_norm_before:
    h = norm(h)``) keep their code on the path where one of them is on; the pair is
    returned where all are off."""
    rewritten, pairs = 0, set()
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
            if reshape is None and isinstance(combine, ast.Attribute):
                # a plain add, written out: `(a + b) if sum_out else (a, b, add)`: no call for
                # dynamo to inline (the list element makes the tuple a ResidualPair for callers
                # outside the owner's loop)
                pair = ast.IfExp(test=sum_out, body=ast.BinOp(left=a, op=ast.Add(), right=b),
                                 orelse=ast.Tuple(elts=[copy.deepcopy(a), copy.deepcopy(b), combine], ctx=ast.Load()))
            elif reshape is None:
                pair = ast.Call(func=ast.Name(id="_nf_pair", ctx=ast.Load()), args=[a, b, combine, sum_out], keywords=[])
            else:
                pair = ast.Call(func=ast.Name(id="_nf_pair_reshaped", ctx=ast.Load()),
                                args=[a, b, combine, sum_out, ast.Constant(reshape.func.attr), *reshape.args],
                                keywords=[])
            tail = stmts[first:i + 1]
            switches = [stmt.test for stmt in tail[1:-1]]
            new = [ast.Return(value=pair)]
            pairs.add(id(new[0]))
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
    for node in list(_own_nodes(fn_node)):  # `v if sum_out else (v, None, None)`
        if isinstance(node, ast.Return) and node.value is not None and id(node) not in pairs:
            none = ast.Constant(value=None)
            node.value = ast.IfExp(test=ast.Name(id=_SUM_OUT, ctx=ast.Load()), body=node.value,
                                   orelse=ast.Tuple(elts=[copy.deepcopy(node.value), none, copy.deepcopy(none)],
                                                    ctx=ast.Load()))
            ast.fix_missing_locations(node)
    return rewritten


_FORWARDS: dict[tuple[type, str], Callable] = {}


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
    # x = combine(hidden, residual): the moved add, right at the start of the block (a plain add
    # written out, _combine called only for the block's own add function)
    entry = ast.parse(f"{stream} = {_HIDDEN} if {_RESIDUAL} is None else ({_HIDDEN} + {_RESIDUAL} if {_COMBINE} is "
                      f"_nf_operator.add else _nf_combine({_HIDDEN}, {_RESIDUAL}, {_COMBINE}, {args.args[0].arg}))"
                      ).body[0]
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
