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
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn as nn

_MARK = "_normfuse_stream"            # on the owner of a rewritten stream
_ELEMENT = "_normfuse_stream_element"  # on each of its list elements
_KEY = "_normfuse_stream_key"          # and its key in _Stream.receivers
_RECOMPUTED = "_normfuse_recomputed"  # on a block whose forward a checkpoint may run twice


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
    checkpointed: bool = False   # the owner's loop calls the blocks through checkpoint(...)
    reentrant: bool = False      # ... with use_reentrant=True: only the sum goes into a block
    transformers: bool = False   # the blocks are transformers layers (see _outputs_recorded)
    cross_checkpoints: bool = False  # hand pairs into checkpointed blocks too
    entry_add: str | None = None     # where the add right before the owner's loop is (StreamRewrite)
    running: int = 0             # > 0 while the owner's forward runs


# --------------------------------------------------------------------------- the owner

def _enter_owner(owner: nn.Module, args: tuple) -> None:
    owner.__dict__[_MARK].running += 1


def _leave_owner(owner: nn.Module, args: tuple, output: Any) -> None:
    owner.__dict__[_MARK].running -= 1


# --------------------------------------------------------------------------- the edited forwards

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


def _in_stream(stream: _Stream, first_arg: Any) -> bool:
    """Whether a block was called by its owner's loop (it hands a pair on) or by other code
    (``model.layers[3](x)``: it returns the tensor, as before the rewrite)."""
    if isinstance(first_arg, tuple) or stream.running:
        return True
    # a checkpoint in the owner's loop recomputes block 0 in backward, after the owner returned
    return stream.checkpointed and torch._C._current_graph_task_id() != -1


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


def _keeps_inputs(element: nn.Module, stream: _Stream) -> bool:
    """Whether the element runs its block under a checkpoint now, which keeps the block's
    inputs for the recompute: a pair would be kept as two tensors where the sum is one.
    (A checkpoint in the owner's loop decides alike in the forward, which a reentrant one
    runs without grad, and in the recompute.)"""
    return _checkpoints_block(element, stream, now=True) and (stream.checkpointed or torch.is_grad_enabled())


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


def _recorder_hooked(element: nn.Module) -> bool:
    """Whether transformers' output recorder hooks the block: it installs its hooks the first
    time outputs are asked for. Until then no output can be recorded, and the context variable
    (which dynamo can only read through a graph break, when transformers set it outside the
    traced frame) is not read."""
    return any(_RECORDER_HOOK in getattr(hook, "__qualname__", "")
               for module in (element, _inner_block(element)) for hook in module._forward_hooks.values())


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
