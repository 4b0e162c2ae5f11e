"""The ways in: ``optimize(model)``, ``fuse_graph(gm)`` and ``report(model)``."""

from __future__ import annotations

import copy
import logging
import types
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.config import FuseConfig, make_config
from normfuse.errors import InvalidModelError
from normfuse.reporting import FusionReport

__all__ = ["optimize", "fuse_graph", "report", "OptimizedForward"]

_REPORT_ATTR = "_normfuse_report"
_CONFIG_ATTR = "_normfuse_config"

log = logging.getLogger("normfuse")


class OptimizedForward:
    """The forward of an optimized model: ``model.forward`` compiled with the normfuse backend.

    It is installed as the instance attribute ``model.forward`` (not ``model.compile``):
    - dynamo only sees a frame it traces: for a model whose forward lives in ``torch.nn``
      (``nn.Sequential``, ``nn.TransformerEncoder``) ``nn.Module.compile`` captures nothing;
      and dynamo's cache is per code object, so instances sharing a class share 8 entries.
      Each model enters through a frame of its own (see ``_compile``);
    - ``nn.Module.__getstate__`` drops ``model.compile``'s compiled call, so a deep copy would
      silently run eagerly; this attribute is copied with the model and the copy compiles
      its own forward (on its own parameters) on its first call;
    - a failure of dynamo's capture itself (``InternalTorchDynamoError``, ``BackendCompilerFailed``,
      a fake-tensor error) is not the user's error: the call is repeated eagerly. When that
      succeeds the model runs eagerly from then on, with one warning and the reason in the
      report; when it raises too, the error was the user's own and propagates as in eager.
    Hooks of the model run outside the compiled region, as with ``torch.compile(model)``.
    """

    def __init__(self, module: nn.Module, forward: Any, config: FuseConfig, report: FusionReport):
        self.module = module
        self.forward = forward            # the model's own forward, bound to it
        self.__wrapped__ = forward        # inspect.signature(model.forward) shows the model's signature
        self.config = config
        self.report = report
        self.eager_reason: str | None = None
        self._compiled: Any = None        # built on the first call

    def _backend(self) -> Any:
        from normfuse.backends import make_backend
        return make_backend(self.config, self.report, model=self.module)

    def _compile(self) -> Any:
        from torch._dynamo import trace_rules

        backend = self._backend()  # the checker records through the same entry (verify/check.py)
        fn = self.forward
        if not (isinstance(fn, types.MethodType) and fn.__self__ is self.module):
            return torch.compile(fn, backend=backend)
        # Dynamo caches compiled code per code object of the frame it enters, at most
        # recompile_limit (8) entries: with the class's forward as that frame, the 9th
        # optimized instance of a class silently ran eagerly. So each model enters through
        # a code object of its own: a copy of its forward (same names, so its graphs read
        # as torch.compile(model)'s: the checker matches them by their inputs).
        func = fn.__func__
        if trace_rules.check(fn):
            # a forward in torch.nn (nn.Sequential, nn.TransformerEncoder): dynamo skips
            # that file, so nothing was captured; enter through a frame of ours instead. The
            # model stays the local `self`: module paths read "layers.0.norm1".
            def forward_frame(self, *args: Any, **kwargs: Any) -> Any:
                return func(self, *args, **kwargs)

            forward_frame.__code__ = forward_frame.__code__.replace()  # a cache of its own
            compiled = torch.compile(forward_frame, backend=backend)
            return lambda *args, **kwargs: compiled(self.module, *args, **kwargs)
        own = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                                 func.__closure__)
        own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
        return torch.compile(types.MethodType(own, self.module), backend=backend)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None or torch.compiler.is_compiling():
            # inside another torch.compile region the outer compiler traces the plain forward
            return self.forward(*args, **kwargs)
        if self._compiled is None:
            self._compiled = self._compile()
        try:
            return self._compiled(*args, **kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            log.debug("normfuse: capture failed", exc_info=True)
            result = self.forward(*args, **kwargs)  # the user's own error raises here, as in eager
            text = str(error).strip()
            self.eager_reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
            message = (f"normfuse runs {type(self.module).__name__} eagerly (unoptimized): dynamo could not capture "
                       f"its forward ({self.eager_reason}). The model's results are unchanged; run "
                       "torch.compile(model, backend='eager') to see the capture error, and report it with the model.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            self.report.warnings.append(message)
            return result

    def __deepcopy__(self, memo: dict) -> "OptimizedForward":
        # the model's copy gets its own forward, compiled afresh on its first call, and a
        # report of its own graphs
        report = copy.deepcopy(self.report, memo)
        _reset(report)
        return OptimizedForward(copy.deepcopy(self.module, memo), copy.deepcopy(self.forward, memo),
                                self.config, report)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_compiled"] = None  # compiled code does not pickle; recompiled after loading
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _reset(self.report)  # the loaded model captures its graphs afresh: a report of its own


class _NotPickled(list):
    """The report's rewritten graph modules: they live with the compiled code, so a pickled
    (``torch.save(model)``) or copied model does not carry them: the loaded model captures
    and rewrites its graphs afresh, and its report describes those."""

    def __reduce__(self):
        return (_NotPickled, ())


def _reset(report: FusionReport) -> None:
    report.sites.clear(), report.warnings.clear(), report.notes.clear(), report.graph_modules.clear()
    report.graphs = 0


def fuse_graph(gm: fx.GraphModule, config: FuseConfig | None = None, **options: Any
               ) -> tuple[fx.GraphModule, FusionReport]:
    """Rewrite every safe add->norm site of any GraphModule (dynamo, torch.export ATen,
    AOT/post-grad graphs) in place; returns ``(gm, report)``."""
    if not isinstance(gm, fx.GraphModule):
        raise InvalidModelError(
            f"fuse_graph takes a torch.fx.GraphModule, got {type(gm).__name__}. For an nn.Module use "
            "normfuse.optimize(model); for an ExportedProgram pass ep.graph_module.")
    from normfuse.passes.pipeline import NormFusionPass
    result = NormFusionPass(make_config(config, **options))(gm)
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
    if isinstance(installed, OptimizedForward) and installed.module is model:  # already optimized: a no-op
        if installed.config != cfg:
            warnings.warn("normfuse.optimize: this model is already optimized, with another config; the new options "
                          "are ignored. Optimize a fresh (unoptimized) copy of the model to use them.",
                          RuntimeWarning, stacklevel=2)
        return model
    rep = FusionReport(graph_modules=_NotPickled())
    object.__setattr__(model, _REPORT_ATTR, rep)
    object.__setattr__(model, _CONFIG_ATTR, cfg)
    if cfg.prenorm:
        from normfuse.passes.prenorm_model import prepare_module
        prepare_module(model)
    if cfg.cross_block:  # normfuse.passes.boundary: carry the residual pair across block boundaries
        from normfuse.passes.boundary import rewrite_streams
        rep.notes += [s.describe() for s in rewrite_streams(model, cfg.cross_checkpoints)]
    model.forward = OptimizedForward(model, model.forward, cfg, rep)
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
