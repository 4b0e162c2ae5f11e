"""Prepare: what a model's own code needs before its graphs are captured, done in one place.

``prepare(model, config)`` applies, in this order, what the options ask for:

- ``prenorm``: one identity-initialized final norm registered per residual stream, so that
  an optimizer built right after sees it (``normfuse/passes/prenorm_model.py``);
- ``cross_block``: each Pre-Norm stream regrouped to carry the residual pair across its
  blocks (``normfuse/passes/cross_block/``).

It returns a ``Preparation``: what was done (``notes``, one per stream) and ``undo()``, which
puts back what this call changed. ``optimize`` keeps it; ``audit`` undoes it once the graphs
are captured; ``check`` prepares the copy it captures the original's graphs from. Per-block
compile (torchtitan's ``apply_compile``) calls it before compiling the blocks::

    normfuse.prepare(model)
    for block in model.layers.values():
        block.compile(backend="normfuse")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from normfuse.config import FuseConfig, make_config
from normfuse.errors import InvalidModelError

__all__ = ["prepare", "Preparation"]


@dataclass
class Preparation:
    """What ``prepare`` did to one model, and how to put it back."""

    model: nn.Module
    notes: list[str] = field(default_factory=list)  # per stream: regrouped, or left as it was and why
    streams: list[str] = field(default_factory=list)  # owners of the streams this call regrouped
    finals: bool = False                              # this call registered Pre-Norm final norms

    def undo(self) -> None:
        """Put back what this call changed (streams a user or an earlier call rewrote stay)."""
        if self.streams:
            from normfuse.passes.cross_block import undo_streams
            undo_streams(self.model, self.streams)
        if self.finals:
            from normfuse.passes.prenorm_model import unprepare_module
            unprepare_module(self.model)
        self.streams, self.finals = [], False


def prepare(model: nn.Module, config: FuseConfig | None = None, **options: Any) -> Preparation:
    """Prepare ``model``'s code as ``optimize`` does before capture (see the module docstring);
    in place. Returns the ``Preparation`` (its ``notes`` say per stream what was done)."""
    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"prepare takes a torch.nn.Module, got {type(model).__name__}.")
    cfg = make_config(config, **options)
    done = Preparation(model)
    before: set[str] = set()
    try:
        if cfg.prenorm:
            from normfuse.passes.prenorm_model import FINALS_ATTR, prepare_module
            done.finals = FINALS_ATTR not in model.__dict__
            prepare_module(model)
        if cfg.cross_block:
            from normfuse.passes.cross_block import rewrite_streams, rewritten_streams
            before = set(rewritten_streams(model))
            done.notes += [stream.describe() for stream in rewrite_streams(model, cfg.cross_checkpoints)]
            done.streams = [fqn for fqn in rewritten_streams(model) if fqn not in before]
    except Exception as error:  # noqa: BLE001 - the user's model must never break: put it back
        if cfg.cross_block:
            from normfuse.passes.cross_block import rewritten_streams
            done.streams = [fqn for fqn in rewritten_streams(model) if fqn not in before]
        done.undo()
        done.notes.append(f"prepare: failed ({type(error).__name__}: {error}); the model's code is as it was "
                          f"(its graphs are still captured and fused)")
    return done
