"""Dynamo backends: ``torch.compile(model, backend="normfuse")`` and ``"normfuse_inductor"``.

Both are registered through the ``torch_dynamo_backends`` entry point, so the names work
without importing normfuse first. Each captured graph goes through one ``NormFusionPass``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch.fx as fx

from normfuse.config import FuseConfig
from normfuse.reporting import FusionReport

__all__ = ["normfuse_backend", "normfuse_inductor_backend", "make_backend", "last_report"]

_LAST: list[FusionReport] = [FusionReport()]

log = logging.getLogger("normfuse")


def last_report() -> FusionReport:
    """The report of every graph the registered backends rewrote in this process."""
    return _LAST[0]


def make_backend(config: FuseConfig | None = None, report: FusionReport | None = None, *,
                 inductor: bool = False, model: Any = None) -> Callable:
    """A dynamo backend that rewrites each captured graph, then runs it eagerly or with inductor."""
    from normfuse.passes.pipeline import NormFusionPass, copy_graph_module

    fusion = NormFusionPass(config, model=model, report=report)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        # the pass works on copies and falls back by itself; this guard covers the rest
        # (the checker, inductor) so that dynamo always gets a callable
        original = copy_graph_module(gm)
        try:
            result = fusion(gm)
            if fusion.config.check:
                from normfuse.verify.check import check_graph_on_first_call
                gm = check_graph_on_first_call(gm, result.report, example_inputs, original=original)
            if inductor:
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(gm, example_inputs)
            return gm.forward
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            message = (f"normfuse left this graph unchanged and runs it eagerly: {type(error).__name__}: {error}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            fusion.report.warnings.append(message)
            log.debug("normfuse backend failure", exc_info=True)
            return original.forward

    backend.normfuse_report = fusion.report  # type: ignore[attr-defined]
    backend.normfuse_pass = fusion  # type: ignore[attr-defined]
    return backend


def normfuse_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0])(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0], inductor=True)(gm, example_inputs)
