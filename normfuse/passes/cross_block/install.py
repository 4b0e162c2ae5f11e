"""Put the rewrite on a model and take it off again (normfuse/passes/cross_block/__init__.py
explains the rewrite).

``rewrite_streams`` checks a stream whole before it changes any of it: the owner's loop
and every block's forward must fit (normfuse/passes/cross_block/source.py), and no forward
hook on the blocks may read a block's output, which would be the pair. It then swaps the
classes (normfuse/passes/cross_block/classes.py), links the list elements through one
``_Stream`` and adds the owner's and the final norm's hooks
(normfuse/passes/cross_block/runtime.py). ``undo_streams`` takes all of it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from normfuse.passes.cross_block.classes import _base_class, _swap_class, _unswap_class
from normfuse.passes.cross_block.runtime import (_ELEMENT, _KEY, _MARK, _RECOMPUTED, _RECORDER_HOOK, _Stream,
                                                 _StreamElement, _add_pair_first, _checkpoints_block, _enter_owner,
                                                 _inner_block, _leave_owner)
from normfuse.passes.cross_block.source import NotFit, _analyze_owner, _new_forward
from normfuse.passes.blocks import block_lists, blocks_of

__all__ = ["StreamRewrite", "checkpointed_sharded_blocks", "crosses_checkpoints", "rewrite_streams",
           "rewritten_streams", "undo_streams"]


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
    checkpoint_if: str | None = None  # the owner's test for checkpointing, decided at run time (e.g. "(self.gc)")

    @property
    def applied(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        text = self._describe()
        if self.applied and self.checkpoint_if and (self.reentrant or not self.cross_checkpoints):
            now = "holds" if self.checkpointed else "does not hold"
            text += (f"; the loop checkpoints when {self.checkpoint_if}, read at each forward ({now} now): while it "
                     f"does, with grad on, each block hands on the sum, otherwise the pair")
        if self.applied and self.checkpointed and self.entry_add:
            text += (f"; the add before the loop ({self.entry_add}) stays outside the first block's checkpoint, so "
                     "the first block's first norm is fused without it (the owner's own forward is not rewritten)")
        return text

    def _describe(self) -> str:
        if self.applied and self.checkpointed and self.reentrant:
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


# Forward hooks known to take a pair as the block's output: FSDP2's post-forward (it only
# registers backward hooks on the output's tensors) and transformers' output recorder
# (the blocks return the added stream while it records, see runtime._outputs_recorded).
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
    block boundaries (see normfuse/passes/cross_block/__init__.py); an owner may hold several
    (a vision model looping over spatial, then temporal blocks), each its own stream. Streams
    that do not fit, or whose rewrite fails, are left as they were, with the reason.
    Idempotent; a second call sets ``cross_checkpoints`` (hand pairs into checkpointed blocks
    too, see runtime._Stream.entry)."""
    results = []
    owner_of = {name: mod for name, mod in model.named_modules()}
    for fqn in block_lists(model):
        result = StreamRewrite(fqn)
        results.append(result)
        parent_fqn, _, attr = fqn.rpartition(".")
        owner = owner_of.get(parent_fqn, model) if fqn else model
        stream = _marked_streams(owner).get(attr)
        if stream is not None:
            stream.cross_checkpoints = cross_checkpoints
            stream.index(blocks_of(owner.get_submodule(attr)))
            _describe(result, stream, blocks_of(owner.get_submodule(attr)), owner, parent_fqn)
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
        try:
            stream = _install(owner, attr, loop, elements, cross_checkpoints)
        except Exception as error:  # noqa: BLE001 - the model must not break: put back what was changed
            _uninstall(owner, attr, elements, getattr(owner, loop.final_norm))
            result.reason = f"not rewritten ({type(error).__name__}: {error}); the stream is as it was"
            continue
        _describe(result, stream, elements, owner, parent_fqn)
    return results


def _install(owner: nn.Module, attr: str, loop, elements: list, cross_checkpoints: bool) -> _Stream:
    """Swap the classes of the list's elements, blocks and final norm, and hook the owner."""
    stream = _Stream(loop.final_norm, checkpointed=loop.checkpointed, reentrant=loop.reentrant,
                     entry_add=loop.entry_add, checkpoint_if=loop.checkpoint_if,
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
    stream.index(elements)
    norm = getattr(owner, loop.final_norm)
    try:
        _swap_class(norm, forward="entry_add")
    except NotFit:
        pass  # the pre-hook adds the pair
    streams = owner.__dict__.get(_MARK)
    if isinstance(streams, dict) and streams:  # the owner's hooks count for all its streams
        owner_hooks = next(iter(streams.values())).hooks[1:]
    else:
        owner_hooks = (owner.register_forward_pre_hook(_enter_owner, prepend=True).id,
                       owner.register_forward_hook(_leave_owner, always_call=True).id)
        object.__setattr__(owner, _MARK, {})
    # first of its pre-hooks: a SequenceParallel (or other) input hook then sees a tensor
    stream.hooks = (norm.register_forward_pre_hook(_add_pair_first, prepend=True).id, *owner_hooks)
    owner.__dict__[_MARK][attr] = stream
    return stream


def _marked_streams(owner: nn.Module) -> dict:
    """The owner's rewritten streams by block list attribute. (normfuse 0.1.0 marked an owner
    with its one stream, which pickled models still hold: found through its list's elements.)"""
    mark = owner.__dict__.get(_MARK)
    if isinstance(mark, _Stream):
        return {name: mark for name, child in owner.named_children()
                if any(m.__dict__.get(_ELEMENT) is mark for m in child.children())}
    return dict(mark or {})


def _uninstall(owner: nn.Module, attr: str, elements: list, norm: nn.Module, stream: _Stream | None = None) -> None:
    """Take one stream off: its classes, marks and hooks (the owner's hooks go with its last stream)."""
    streams = owner.__dict__.get(_MARK)
    if isinstance(streams, dict):
        stream = streams.pop(attr, stream)
    if stream is not None:
        if stream.hooks:  # (norm pre-hook, owner pre-hook, owner hook)
            norm._forward_pre_hooks.pop(stream.hooks[0], None)
        if not streams:  # the last (or a 0.1.0 owner's only) stream: the owner's hooks and mark too
            owner.__dict__.pop(_MARK, None)
            for hook_id in stream.hooks[1:]:
                owner._forward_pre_hooks.pop(hook_id, None)
                owner._forward_hooks.pop(hook_id, None)
                owner._forward_hooks_always_called.pop(hook_id, None)
    _unswap_class(norm)
    for element in elements:
        element.__dict__.pop(_ELEMENT, None)
        element.__dict__.pop(_KEY, None)
        _inner_block(element).__dict__.pop(_RECOMPUTED, None)
        _unswap_class(_inner_block(element))
        _unswap_class(element)


def _describe(result: StreamRewrite, stream: _Stream, elements: list, owner: nn.Module, parent_fqn: str) -> None:
    result.blocks = len(elements)
    result.final_norm = f"{parent_fqn + '.' if parent_fqn else ''}{stream.final_norm}"
    result.checkpointed = any(_checkpoints_block(e, stream, owner) for e in elements)
    if stream.checkpointed and stream.checkpoint_if not in (None, "True"):
        result.checkpoint_if = stream.checkpoint_if
    result.cross_checkpoints, result.reentrant = stream.cross_checkpoints, stream.reentrant
    result.entry_add = stream.entry_add


def rewritten_streams(model: nn.Module) -> list[str]:
    """The owners of ``model``'s rewritten streams, by module path."""
    return [fqn for fqn, module in model.named_modules() if _marked_streams(module)]


def checkpointed_sharded_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``'s rewritten streams that FSDP2 shards and the owner's loop may run
    through ``torch.utils.checkpoint``. FSDP2's hooks break the owner's graph before each block,
    and the checkpoint then runs its block with dynamo disabled: such a block is captured only
    when it is compiled on its own (as torchtitan compiles each block)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return []
    return [block for owner in model.modules() for attr, stream in _marked_streams(owner).items()
            if stream.checkpointed for block in blocks_of(owner.get_submodule(attr)) if isinstance(block, FSDPModule)]


def crosses_checkpoints(model: nn.Module) -> bool:
    """Whether a rewritten stream of ``model`` hands pairs into checkpointed blocks."""
    return any(stream.cross_checkpoints for m in model.modules() for stream in _marked_streams(m).values())


def undo_streams(model: nn.Module, owners: Optional[list[str]] = None) -> None:
    """Put every rewritten stream of ``model`` back as it was (or those of ``owners``, module
    paths as ``rewritten_streams`` gives them)."""
    for fqn in block_lists(model):
        parent_fqn, _, attr = fqn.rpartition(".")
        if owners is not None and parent_fqn not in owners:
            continue
        owner = model.get_submodule(parent_fqn) if parent_fqn else model
        stream = _marked_streams(owner).get(attr)
        if stream is not None:
            _uninstall(owner, attr, blocks_of(owner.get_submodule(attr)), getattr(owner, stream.final_norm), stream)
