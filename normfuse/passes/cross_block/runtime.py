"""What runs inside the model once its streams are rewritten: code dynamo traces together
with the model's own (normfuse/passes/cross_block/__init__.py explains the rewrite).

- ``ResidualPair``, the stream value between two rewritten blocks, and ``_Stream``, the state
  of one rewritten stream, which its owner and its list elements share;
- the owner's hooks, which count its running forwards: only its loop gets pairs;
- what the edited forwards call (normfuse/passes/cross_block/source.py writes them): a block
  starts with ``_combine`` (the add moved there) and ends with ``_pair``; the final norm
  starts with ``_add_if_pair``;
- ``_StreamElement``, the mixin of the list elements: its ``__call__`` unpacks a pair into
  positional tensors, so the pair crosses every wrapper, and decides whether the block hands
  on a pair or the sum;
- ``_add_pair_first``, the final norm's first forward pre-hook.

Nothing here imports the rest of the rewrite. Saved models name ``_Stream``, the hooks and
(inside their swapped class names) ``_StreamElement``: renaming them breaks loading those
models (see normfuse/passes/boundary.py).
"""

from __future__ import annotations

import operator
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn
from torch.nn.modules import module as _nn_module

_MARK = "_normfuse_stream"            # on the owner of rewritten streams: {block list attribute: _Stream}
_ELEMENT = "_normfuse_stream_element"  # on each of its list elements (_StreamElement reads it by name)
_KEY = "_normfuse_stream_key"          # and its key in _Stream.receivers
_RECOMPUTED = "_normfuse_recomputed"  # on a block whose forward a checkpoint may run twice
# nn.Module's global hook tables (hooks are added into them)
_GLOBAL_HOOKS = (_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks,
                 _nn_module._global_backward_hooks, _nn_module._global_backward_pre_hooks)

# What a list element hands on in its owner's loop (_Stream.entry):
HANDS_PAIR = "pair"
HANDS_SUM = "sum"
HANDS_SUM_WITH_GRAD = "sum with grad"     # the next block runs under a checkpoint_wrapper
HANDS_BY_NEXT = "sum if next checkpoints"  # the sum when the next block checkpoints now (training, grad on)
HANDS_BY_LOOP = "sum if the loop checkpoints"  # the sum when the owner's loop checkpoints in this forward


class ResidualPair(NamedTuple):
    """The stream value between two rewritten blocks: ``combine(hidden, residual)``, not yet added."""

    hidden: torch.Tensor
    residual: Optional[torch.Tensor]
    combine: Optional[Callable]


@dataclass(eq=False)
class _Stream:
    """One rewritten stream; its owner and its list elements hold the same object."""

    final_norm: str
    receivers: dict = field(default_factory=dict)  # element key -> the next element (None: the final norm)
    hooks: tuple = ()            # ids of the owner's two hooks and the final norm's pre-hook
    checkpointed: bool = False   # the owner's loop may call the blocks through checkpoint(...)
    reentrant: bool = False      # ... with use_reentrant=True: only the sum goes into a block
    # when the loop checkpoints, an expression over the owner (source.py, _Loop.checkpoint_if);
    # None: not known before the call, so a checkpointing loop is taken to checkpoint always
    checkpoint_if: str | None = None
    loop_checkpoints: bool = True  # checkpoint_if's value in the owner's running forward
    transformers: bool = False   # the blocks are transformers layers (see _outputs_recorded)
    cross_checkpoints: bool = False  # hand pairs into checkpointed blocks too
    entry_add: str | None = None     # where the add right before the owner's loop is (StreamRewrite)
    running: int = 0             # > 0 while the owner's forward runs
    # element key -> what _StreamElement.__call__ reads, as one entry (``entry``): dynamo traces
    # that for every block, and each helper it inlines or attribute it reads costs it time.
    # Set per stream by ``index``; a stream loaded from a pickle of normfuse 0.1.0 starts empty.
    plan: ClassVar[Mapping[str, tuple]] = MappingProxyType({})

    def index(self, elements: list) -> None:
        """Fill ``plan`` for the list elements (install time)."""
        self.plan = {key: self.entry(element, key) for key, element in zip(self.receivers, elements)}

    def entry(self, element: nn.Module, key: str) -> tuple:
        """(What the element hands on in its owner's loop, the next block when that block's flags
        decide, whether the element's class calls like nn.Module, its hook tables, its block.)
        The element hands its block's pair on, but not into a block that keeps its inputs for a
        recompute, unless asked (cross_checkpoints); the last block's pair goes to the final norm."""
        # by a string key: dynamo would make an int index dynamic (an empty graph per block under
        # FSDP2), and a module held by each element would chain deepcopy's recursion block to block
        receiver = self.receivers[key]
        nxt = None
        if receiver is None:
            hands = HANDS_PAIR
        elif self.reentrant:  # a reentrant checkpoint's autograd sees only tensor arguments
            hands = HANDS_SUM if self.checkpoint_if is None else HANDS_BY_LOOP
        elif self.cross_checkpoints:
            hands = HANDS_PAIR
        elif self.checkpointed:
            hands = HANDS_SUM if self.checkpoint_if is None else HANDS_BY_LOOP
        elif _wraps_checkpoint(receiver):
            hands = HANDS_SUM_WITH_GRAD
        elif hasattr(_inner_block(receiver), "gradient_checkpointing"):  # transformers' GradientCheckpointingLayer
            hands, nxt = HANDS_BY_NEXT, _inner_block(receiver)
        else:
            hands = HANDS_PAIR
        hooks = (element._forward_hooks, element._forward_pre_hooks, element._backward_hooks,
                 element._backward_pre_hooks)  # the tables hooks are added into
        return hands, nxt, _calls_like_module(element), hooks, _inner_block(element)


@torch._dynamo.assume_constant_result
def _fixed(element: nn.Module) -> tuple[str, str, bool, bool]:
    """What the element's ``__call__`` takes as fixed: (its key in the stream, what it hands on,
    whether it may call forward directly as nn.Module's ``__call__`` does for a module without
    hooks, whether transformers' output recorder hooks its block). Dynamo calls this once per
    trace and does not trace it: it guards on module hooks no more than it does for any module
    (a hook added after compiling is not seen until a recompile), and each attribute of a
    module it reads costs it time, for every block."""
    own = element.__dict__
    stream, key = own[_ELEMENT], own[_KEY]
    entry = stream.plan.get(key)
    if entry is None:  # a stream loaded from a pickle of normfuse 0.1.0
        entry = stream.entry(element, key)
        stream.plan = {**stream.plan, key: entry}
    hands, _, calls_like_module, hooks, block = entry
    direct = calls_like_module and not any(hooks) and not any(_GLOBAL_HOOKS)
    recorder = stream.transformers and _recorder_hooked(element, block)
    return key, hands, direct, recorder


@torch._dynamo.assume_constant_result
def _fast_path(element: nn.Module) -> bool | None:
    """Whether ``__call__`` may hand a pair straight to the block's forward: None when it may
    not (hooks, a wrapper's own ``__call__``, transformers' recorder, a hand-off other than
    the pair), False when it may, True when it may only with grad off (the next block checks
    whether it checkpoints). Read once per trace, as ``_fixed``."""
    _, hands, direct, recorder = _fixed(element)
    if not direct or recorder or hands not in (HANDS_PAIR, HANDS_BY_NEXT):
        return None
    return hands == HANDS_BY_NEXT


# --------------------------------------------------------------------------- the owner

def _owner_streams(owner: nn.Module):
    """The streams of an owner: by block list (normfuse 0.1.0 marked an owner with its one stream)."""
    mark = owner.__dict__[_MARK]
    return mark.values() if isinstance(mark, dict) else (mark,)


def _enter_owner(owner: nn.Module, args: tuple) -> None:
    for stream in _owner_streams(owner):
        stream.running += 1
        if stream.checkpoint_if is not None:
            # whether the loop checkpoints in this forward: its own test (a flag, training mode)
            # and the grad mode, read once before the first block hands anything on (a reentrant
            # checkpoint runs its block with grad off: the block must still hand on the sum)
            stream.loop_checkpoints = torch.is_grad_enabled() and bool(_owner_test(stream.checkpoint_if)(owner))


_OWNER_TESTS: dict[str, Callable] = {}


def _owner_test(expression: str) -> Callable:
    """``lambda self: <expression>`` for a test of the owner read from its source (when its loop
    checkpoints, whether its final norm exists), compiled once per expression (the stream keeps
    the text, which pickles)."""
    test = _OWNER_TESTS.get(expression)
    if test is None:
        test = _OWNER_TESTS[expression] = eval(f"lambda self: {expression}", {"__builtins__": {}})  # noqa: S307
    return test


def _leave_owner(owner: nn.Module, args: tuple, output: Any) -> None:
    for stream in _owner_streams(owner):
        stream.running -= 1


# --------------------------------------------------------------------------- the edited forwards

def _pair(hidden: torch.Tensor, residual: torch.Tensor, combine: Callable, sum_out: bool) -> Any:
    """What a rewritten block returns in place of ``combine(hidden, residual)``: inside the owner's
    loop a plain tuple (the list element hands a caller outside the loop a ResidualPair)."""
    if sum_out:
        return combine(hidden, residual)
    return hidden, residual, combine


def _pair_reshaped(hidden: torch.Tensor, residual: torch.Tensor, combine: Callable, sum_out: bool,
                   method: str, *shape: Any) -> Any:
    """What a rewritten block returns in place of ``combine(hidden, residual).view(*shape)``:
    the operands reshaped (the same elements, added in the next block), when they have one shape."""
    if sum_out or hidden.shape != residual.shape:
        return getattr(combine(hidden, residual), method)(*shape)
    return hidden.reshape(*shape), residual.reshape(*shape), combine


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


def _added(pair: ResidualPair) -> torch.Tensor:
    return _combine(pair.hidden, pair.residual, pair.combine)


def _as_pair(value: Any) -> ResidualPair:
    # A checkpoint or wrapper may hand the NamedTuple back as a plain tuple.
    if isinstance(value, tuple) and len(value) == 3 and (value[2] is None or callable(value[2])):
        return ResidualPair(*value)
    return ResidualPair(value, None, None)


def _add_if_pair(x: Any) -> Any:
    return _added(_as_pair(x)) if isinstance(x, tuple) else x


# --------------------------------------------------------------------------- the list elements

def _inner_block(element: nn.Module) -> nn.Module:
    """The block under its wrappers (torch.compile's OptimizedModule, checkpoint_wrapper)."""
    for attr in ("_orig_mod", "_checkpoint_wrapped_module"):  # submodules of the wrapper
        inner = element._modules.get(attr)
        if inner is not None:
            return _inner_block(inner)
    return element


def _calls_like_module(element: nn.Module) -> bool:
    """Whether nn.Module's ``__call__`` is the one under _StreamElement's (not a wrapper's own,
    e.g. torch.compile's OptimizedModule)."""
    mro = type(element).__mro__
    for cls in mro[mro.index(_StreamElement) + 1:]:
        if "__call__" in vars(cls):
            return cls is nn.Module
    return False


def _wraps_checkpoint(element: nn.Module) -> bool:
    """Whether a checkpoint_wrapper is among the element's wrappers."""
    # plain dictionary reads: this may run inside traced frames, where a getattr that raises
    # (nn.Module.__getattr__) costs dynamo a graph
    module = element
    while module is not None:
        if "_checkpoint_wrapped_module" in module._modules:
            return True
        module = module._modules.get("_orig_mod")
    return False


def _checkpoints_block(element: nn.Module, stream: _Stream, owner: nn.Module | None = None) -> bool:
    """Whether the element runs its block under a checkpoint when grad is on (transformers'
    GradientCheckpointingLayer: in training mode only; an owner's loop whose test is known:
    when that test holds for ``owner`` now)."""
    if stream.checkpointed and (stream.checkpoint_if is None or owner is None
                                or _owner_test(stream.checkpoint_if)(owner)):
        return True
    if _wraps_checkpoint(element):
        return True
    return bool(_inner_block(element).__dict__.get("gradient_checkpointing", False))


# transformers' output recorder: the qualified name of the forward hook it puts on each layer
_RECORDER_HOOK = "output_capturing_hook"


def _outputs_recorded() -> bool:
    """True while a transformers model records layer outputs (``output_hidden_states``,
    ``output_attentions``, ...): its hooks read each layer's output, so the layers return
    it added. transformers sets its collector on every call, to an empty dict when nothing
    is asked for; that case records nothing."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    collected = collector.get() if collector is not None else None
    return bool(collected) and any(key != "_hidden_states_layers" for key in collected)


def _recorder_hooked(element: nn.Module, block: nn.Module) -> bool:
    """Whether transformers' output recorder hooks the element or its block: it installs its
    hooks the first time outputs are asked for. Until then no output can be recorded, and the
    context variable (which dynamo can only read through a graph break, when transformers set
    it outside the traced frame) is not read."""
    return any(_RECORDER_HOOK in getattr(hook, "__qualname__", "")
               for module in (element, block) for hook in module._forward_hooks.values())


class _StreamElement:
    """Mixin of the stream's list elements: a pair enters as three positional arguments, and
    a fourth says whether the block returns the sum (see _Stream.entry, _outputs_recorded)."""

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() and args and type(args[0]) is tuple and len(args[0]) == 3:
            # a pair in the owner's loop (a plain tuple: blocks hand callers outside it a
            # ResidualPair), under dynamo: what the general path below decides for it, in the
            # fewest steps and guards (dynamo traces this for every block; it is most of what
            # the rewrite costs at capture)
            grad_off = _fast_path(self)
            if grad_off is not None and not (grad_off and torch.is_grad_enabled()):
                return self.forward(*args[0], False, *args[1:], **kwargs)
        key, hands, direct, recorder = _fixed(self)
        stream = self._normfuse_stream_element
        if args:
            hidden, args = args[0], args[1:]
        else:  # the stream passed by its name, e.g. block(hidden_states=x)
            hidden = kwargs.pop(type(_inner_block(self)).forward.nf_stream_arg)
        if isinstance(hidden, tuple) and len(hidden) == 3:  # a pair (a checkpoint may hand it back as a tuple)
            hidden, residual, combine = hidden
            sum_out = False
        else:
            residual = combine = None
            # called by other code (``model.layers[3](x)``) the block returns the sum, as before the
            # rewrite; a checkpoint in the owner's loop recomputes block 0 in backward, after the
            # owner returned
            sum_out = not (stream.running > 0 or (stream.checkpointed and torch._C._current_graph_task_id() != -1))
        if not sum_out and hands != HANDS_PAIR:
            if hands == HANDS_SUM:
                sum_out = True
            elif hands == HANDS_BY_LOOP:
                sum_out = stream.loop_checkpoints
            elif torch.is_grad_enabled():
                nxt = stream.plan[key][1]
                sum_out = hands == HANDS_SUM_WITH_GRAD or bool(nxt.gradient_checkpointing and nxt.training)
        if not sum_out and recorder and _outputs_recorded():
            sum_out = True
        if direct and torch.compiler.is_compiling():
            # dynamo takes this shortcut for a module whose class keeps nn.Module's __call__ (and
            # would otherwise inline nn.Module's whole call machinery under this override)
            out = self.forward(hidden, residual, combine, sum_out, *args, **kwargs)
        else:
            out = super().__call__(hidden, residual, combine, sum_out, *args, **kwargs)
            if not sum_out and not (isinstance(out, tuple) and len(out) == 3):  # a wrapper changed the pair
                out = tuple(_as_pair(out))
        if sum_out:
            return out  # a sum goes on as the tensor it is
        # the edited forward returns a plain tuple (see source._defer_final_adds), which the
        # owner's loop hands on; a caller outside it gets a ResidualPair
        return out if stream.running > 0 else ResidualPair(*out)


# --------------------------------------------------------------------------- the final norm

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
