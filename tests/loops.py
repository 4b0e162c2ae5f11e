"""The loop spellings models use to run their blocks under a checkpoint: ``CheckpointedStack``
(``torch.utils.checkpoint`` without reentrance) and its subclasses for the other ways users
checkpoint (``CHECKPOINT_WAYS``, ``checkpointed_stack(wrap)``: reentrant, checkpoint_wrapper);
then loops that checkpoint or not, a flag of the model deciding: an if/else statement, a
conditional expression, a method of the model, and a method that returns early.
``FLAGGED_LOOPS`` names them; ``flagged_loop(name, checkpointing)`` builds one
(``CheckpointedStack``'s blocks, tok, final_norm and head). benchmarks/bench_wrapped.py
imports them from here too."""

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from normfuse.zoo import ToyTransformer


class CheckpointedStack(nn.Module):
    """``ToyTransformer``'s Pre-Norm blocks run by this class's own loop under
    ``torch.utils.checkpoint(..., use_reentrant=False)``, as research code writes it; the other
    ways users checkpoint are its subclasses (``checkpointed_stack``). Each loop is written out
    as such: the cross-block rewrite reads the owner's loop from its source."""

    def __init__(self, depth=2, kind="rms_norm", add_order="x+f", hidden=32):
        super().__init__()
        torch.manual_seed(0)
        toy = ToyTransformer(placement="pre", kind=kind, spelling="llama" if kind == "rms_norm" else "module",
                             hidden=hidden, depth=depth, add_order=add_order)
        self.tok, self.blocks, self.final_norm, self.head = toy.tok, toy.blocks, toy.final_norm, toy.head

    def embed(self, ids):
        return self.tok(ids)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.final_norm(x))


class _ReentrantStack(CheckpointedStack):
    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True)
        return self.head(self.final_norm(x))


class _WrappedStack(CheckpointedStack):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        self.blocks = nn.ModuleList(checkpoint_wrapper(b) for b in self.blocks)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


CHECKPOINT_WAYS = {"non_reentrant": CheckpointedStack, "reentrant": _ReentrantStack,
                   "checkpoint_wrapper": _WrappedStack}


def checkpointed_stack(wrap: str, **kwargs) -> CheckpointedStack:
    """A ``CheckpointedStack`` whose loop checkpoints its blocks the way ``wrap`` names
    (CHECKPOINT_WAYS); ``kwargs`` go to its constructor."""
    return CHECKPOINT_WAYS[wrap](**kwargs)


class IfElseLoop(CheckpointedStack):
    checkpointing = True

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            if self.checkpointing:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return self.head(self.final_norm(x))


class ConditionalExpressionLoop(CheckpointedStack):
    checkpointing = True

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing else layer(x)
        return self.head(self.final_norm(x))


class HelperMethodLoop(CheckpointedStack):
    checkpointing = True

    def run_layer(self, layer, hidden):
        if self.checkpointing:
            return checkpoint(layer, hidden, use_reentrant=False)
        return layer(hidden)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            x = self.run_layer(layer, x)
        return self.head(self.final_norm(x))


class EarlyReturnLoop(HelperMethodLoop):
    """HF's older spelling: checkpoint only while training, decided before the plain call."""

    def run_layer(self, layer, hidden):
        if not (self.checkpointing and self.training):
            return layer(hidden)
        return checkpoint(layer, hidden, use_reentrant=False)


FLAGGED_LOOPS = {"if_else": IfElseLoop, "conditional_expression": ConditionalExpressionLoop,
                 "helper_method": HelperMethodLoop, "early_return": EarlyReturnLoop}


def flagged_loop(name: str, checkpointing: bool, **kwargs) -> CheckpointedStack:
    model = FLAGGED_LOOPS[name](**kwargs)
    model.checkpointing = checkpointing
    return model


class ReentrantIfElseLoop(IfElseLoop):
    """A reentrant checkpoint behind the flag: a pair going into it would be hidden from autograd."""

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.blocks:
            if self.checkpointing:
                x = checkpoint(layer, x, use_reentrant=True)
            else:
                x = layer(x)
        return self.head(self.final_norm(x))
