"""The ways in: ``optimize(model)``, ``fuse_graph(gm)`` and ``report(model)``."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.config import FuseConfig, make_config
from normfuse.errors import InvalidModelError
from normfuse.reporting import FusionReport

__all__ = ["optimize", "fuse_graph", "report"]

_REPORT_ATTR = "_normfuse_report"
_CONFIG_ATTR = "_normfuse_config"


def fuse_graph(gm: fx.GraphModule, config: FuseConfig | None = None, **options: Any
               ) -> tuple[fx.GraphModule, FusionReport]:
    """Rewrite every safe add->norm site of any GraphModule (dynamo, torch.export ATen,
    AOT/post-grad graphs) in place; returns ``(gm, report)``."""
    if not isinstance(gm, fx.GraphModule):
        raise InvalidModelError(
            f"fuse_graph takes a torch.fx.GraphModule, got {type(gm).__name__}. For an nn.Module use "
            "normfuse.optimize(model); for an ExportedProgram pass ep.graph_module.")
    from normfuse.passes import pipeline
    cfg = make_config(config, **options)
    if cfg.prenorm:
        from normfuse.passes import prenorm
        rep = prenorm.convert_graph(gm, cfg)
        rep.extend(pipeline.run(gm, cfg))
        return gm, rep
    return gm, pipeline.run(gm, cfg)


def optimize(model: nn.Module, config: FuseConfig | None = None, **options: Any) -> nn.Module:
    """Optimize ``model`` in place and return it.

    The first call of the model captures its graph(s) with dynamo, rewrites every safe
    site into a fused op and runs the result; later calls reuse it. ``state_dict`` keys
    are unchanged. Calling it again on an optimized model changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(
            f"optimize takes a torch.nn.Module, got {type(model).__name__}. "
            "Wrap a function in an nn.Module, or use torch.compile(fn, backend='normfuse').")
    cfg = make_config(config, **options)
    if getattr(model, _CONFIG_ATTR, None) is not None:
        return model  # already optimized: a no-op
    object.__setattr__(model, _REPORT_ATTR, FusionReport())
    object.__setattr__(model, _CONFIG_ATTR, cfg)
    if cfg.prenorm:
        from normfuse.passes import prenorm
        prenorm.prepare_module(model)
    from normfuse.backends import make_backend
    model.compile(backend=make_backend(cfg, getattr(model, _REPORT_ATTR), model=model))
    return model


def report(model: nn.Module) -> FusionReport:
    """Everything the pass found and did in ``model`` so far (one entry per captured graph)."""
    rep = getattr(model, _REPORT_ATTR, None)
    if rep is None:
        orig = getattr(model, "_orig_mod", None)
        rep = getattr(orig, _REPORT_ATTR, None) if orig is not None else None
    if rep is None:
        raise InvalidModelError(
            "this model was not optimized by normfuse: call normfuse.optimize(model) and run it once first.")
    return rep
