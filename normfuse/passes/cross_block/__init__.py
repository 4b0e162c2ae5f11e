"""Carry the residual pair across block boundaries.

In a Pre-Norm stack the add that ends block i feeds the norm that starts block i+1::

    for block in self.blocks:          # block: h = x + attn(norm1(x)); return h + mlp(norm2(h))
        x = block(x)
    x = self.final_norm(x)

When each block is a region of its own (activation checkpointing, an FSDP2 unit, a
per-block ``torch.compile``, a graph break), that add and that norm are never in one
graph, so no pass can fuse them. This package rewrites the stream so that the add
moves across the boundary: each block returns the un-added operands as a
``ResidualPair(hidden, residual, combine)``, and the next block starts with
``x = combine(hidden, residual)``, which then sits right before its first norm in
its own graph, where the fusion pass turns the two into one ``add_norm``. The final
norm takes the last pair the same way. The adds and norms are the same, with the same
operands, regrouped: the outputs and gradients are bit-identical to eager.

How, generically:
- the stream is a ModuleList/Sequential/ModuleDict of blocks of one class (the Post-Norm
  conversion's rule, ``prenorm_model.block_lists``);
- the owner's forward (read from its source) must pass the stream value only from
  block to block, then straight into a norm module: ``x = block(x, ...)`` or
  ``x = checkpoint(block, x, ..., use_reentrant=False)`` (or ``True``) in the loop (or an
  if/else, a conditional expression or a method of the owner made of those; whether it
  checkpoints is read at each forward from its test, source.py ``_Loop.checkpoint_if``), ``self.norm(x)``
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

The modules, each importing only those listed before it:
- ``runtime``: what runs inside the rewritten model, traced by dynamo with the model's own
  code: the pair, the list elements' ``__call__``, the owner's and the final norm's hooks,
  and the helpers the edited forwards call;
- ``source``: reading the owner's loop and the blocks' forwards from their source, and
  compiling the edited copies of the forwards;
- ``classes``: the swapped classes that carry those copies and the mixin, and how an
  unpickled model gets them back;
- ``install``: ``rewrite_streams`` and ``undo_streams``.
Models pickled by normfuse 0.1.0 name some of these objects under normfuse.passes.boundary,
which re-exports them.
"""

from normfuse.passes.cross_block.install import (StreamRewrite, checkpointed_sharded_blocks, crosses_checkpoints,
                                                 rewrite_streams, rewritten_streams, undo_streams)
from normfuse.passes.cross_block.runtime import ResidualPair

__all__ = ["ResidualPair", "StreamRewrite", "checkpointed_sharded_blocks", "crosses_checkpoints", "rewrite_streams",
           "rewritten_streams", "undo_streams"]
