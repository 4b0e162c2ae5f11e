"""The ways in: ``optimize(model)``, ``fuse_graph(gm)`` and ``report(model)``."""

from __future__ import annotations

import warnings
from typing import Any

import torch.fx as fx
import torch.nn as nn

from normfuse.backends import FusingBackend
from normfuse.capture import ModelForward
from normfuse.config import FuseConfig, make_config
from normfuse.errors import InvalidModelError
# OptimizedForward, _NotPickled: models pickled by 0.1.0 name them at this path (normfuse/legacy.py)
from normfuse.legacy import OptimizedForward, _NotPickled, forward_log  # noqa: F401
from normfuse.preparation import prepare
from normfuse.reporting import FusionReport
from normfuse.runs import RunLog, belongs_to, model_report, norm_module_paths, parameter_paths

__all__ = ["optimize", "fuse_graph", "report", "LOG_ATTR"]

LOG_ATTR = "_normfuse_runs"   # on an optimized model: its RunLog

def _log_of(model: nn.Module) -> RunLog | None:
    """The RunLog of an optimized model (one loaded from a 0.1.0 pickle keeps it in its forward)."""
    run_log = model.__dict__.get(LOG_ATTR)
    return run_log if run_log is not None else forward_log(model)


def fuse_graph(gm: fx.GraphModule, config: FuseConfig | None = None, **options: Any
               ) -> tuple[fx.GraphModule, FusionReport]:
    """Rewrite every safe add->norm site of any GraphModule (dynamo, torch.export ATen,
    AOT/post-grad graphs) in place; returns ``(gm, report)``."""
    if not isinstance(gm, fx.GraphModule):
        raise InvalidModelError(
            f"fuse_graph takes a torch.fx.GraphModule, got {type(gm).__name__}. For an nn.Module use "
            "normfuse.optimize(model); for an ExportedProgram pass ep.graph_module.")
    from normfuse.passes.graph import copy_graph_module
    from normfuse.passes.pipeline import NormFusionPass

    cfg = make_config(config, **options)
    original = copy_graph_module(gm) if cfg.check else None
    result = NormFusionPass(cfg)(gm)
    if cfg.check:  # on the first call's inputs, as the backends check (FuseConfig.check)
        from normfuse.verify.graph_check import check_graph_on_first_call
        check_graph_on_first_call(gm, result.report, [], original=original, defer=True)
    return gm, result.report


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
    installed = model.__dict__.get("forward")
    fusing = isinstance(installed, ModelForward) and isinstance(installed.make_backend, FusingBackend)
    if fusing and installed.module is model:  # already optimized: a no-op
        if installed.make_backend.config != cfg:
            warnings.warn("normfuse.optimize: this model is already optimized, with another config; the new options "
                          "are ignored. Optimize a fresh (unoptimized) copy of the model to use them.",
                          RuntimeWarning, stacklevel=2)
        return model
    log = RunLog()
    object.__setattr__(model, LOG_ATTR, log)
    log.notes += prepare(model, cfg).notes
    if cfg.cross_block:
        from normfuse.passes.cross_block import checkpointed_sharded_blocks
        for block in checkpointed_sharded_blocks(model):  # (their docstring says why)
            if getattr(block, "_compiled_call_impl", None) is not None:  # the caller compiled it: theirs
                name = next(n for n, m in model.named_modules() if m is block)
                log.notes.append(f"{name}: compiled by the caller, left as "
                                 "compiled (an FSDP2 block a checkpointed loop runs is captured only when compiled "
                                 "on its own: its norms are fused when that compile's backend is 'normfuse')")
                continue
            block.compile(backend=FusingBackend(cfg, log, model)())
    model.forward = ModelForward(model, model.forward, FusingBackend(cfg, log, model), log.warn)
    return model


def report(model: nn.Module) -> FusionReport:
    """Everything the pass found and did in ``model`` so far: one entry per graph run, module
    paths whole. Works on a model given to ``optimize``, a model compiled with
    ``torch.compile(model, backend="normfuse")`` (or ``"normfuse_inductor"``), and a model
    whose children were compiled so (torchtitan's per-block compile)."""
    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"report takes the torch.nn.Module the pass ran on, got {type(model).__name__}.")
    from normfuse.backends import registered_records

    owner = model.__dict__.get("_orig_mod", model)  # torch.compile(model)'s wrapper
    run_log = _log_of(owner)
    paths = parameter_paths(owner)
    compiled = [r for r in registered_records() if belongs_to(r, paths)]
    if run_log is None and not compiled:
        raise InvalidModelError(
            "normfuse has not run on this model: call normfuse.optimize(model) (or torch.compile it, or its blocks, "
            "with backend='normfuse') and run it once first.")
    rep = model_report(run_log.records, owner, paths, run_log.notes, run_log.warnings) if run_log is not None else None
    from_backends = model_report(compiled, owner, paths, only_model=True) if compiled else None
    if rep is None:
        rep = from_backends
    elif from_backends is not None:
        rep.extend(from_backends)
    seen = {site.fqn for site in rep.sites}
    rep.uncaptured = [fqn for fqn in norm_module_paths(owner) if fqn not in seen]
    return rep
