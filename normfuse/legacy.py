"""What models pickled by normfuse 0.1.0 need to load, and only that.

pickle finds a class or function by the module path it was saved under. Models saved by
0.1.0 (``torch.save`` of an optimized model, or of one whose streams were regrouped across
blocks) name these; the loaded model runs as if optimized now:

- ``normfuse.api.OptimizedForward``: the installed forward, holding the config and the report;
  loaded as a ``ModelForward`` with that config's backend and a fresh log (``OptimizedForward``
  below; ``normfuse.api`` imports it so that its old path resolves).
- ``normfuse.api._NotPickled``: the report's graph list, pickled empty (``_NotPickled`` below).
- ``normfuse.passes.boundary.*``: the objects of the cross-block rewrite, now in
  ``normfuse.passes.cross_block`` (the stream, the owner's and the final norm's hooks, the
  swapped classes); that module re-exports them from there. It does not go through this
  module: a pass module must not reach the checker, which this one reaches through the backend.
  The cross-block runtime reads a 0.1.0 stream's layout itself (an owner marked with one stream,
  a stream without its per-element plan), on its path dynamo traces.
- ``normfuse.zoo``'s ``ToyTransformer`` and its parts, ``normfuse.config.FuseConfig``,
  ``normfuse.reporting``'s ``FusionReport`` and ``Site``: current classes, still at those paths.

tests/data/models_pickled_by_0.1.0.pt holds such models (tests/test_boundary.py loads them).
"""

from __future__ import annotations

import torch.nn as nn

from normfuse.backends import FusingBackend
from normfuse.capture import ModelForward
from normfuse.runs import RunLog

__all__ = ["OptimizedForward", "forward_log"]


class OptimizedForward(ModelForward):
    """The forward of an optimized model as normfuse 0.1.0 pickled it (``normfuse.api.OptimizedForward``
    holding its config and report): loaded, it is a ``ModelForward`` with that config's backend
    and a fresh log, and compiles afresh on its first call."""

    def __setstate__(self, state: dict) -> None:
        if "config" in state:  # the 0.1.0 layout
            config, old_report = state.pop("config"), state.pop("report", None)
            log = RunLog(notes=list(getattr(old_report, "notes", None) or []))
            state.update(make_backend=FusingBackend(config, log, state["module"]), on_warning=log.warn)
        self.__dict__.update(state)
        self._compiled = None


_NotPickled = list  # 0.1.0 pickled its report's graph list as ``normfuse.api._NotPickled()``: an empty list


def forward_log(model: nn.Module) -> RunLog | None:
    """The RunLog a model loaded from a 0.1.0 pickle keeps in its forward's backend (a model
    optimized now keeps it on the model, ``normfuse.api.LOG_ATTR``)."""
    backend = getattr(model.__dict__.get("forward"), "make_backend", None)
    return getattr(backend, "log", None)
