"""Dynamo backends: ``torch.compile(model, backend="normfuse")`` and ``"normfuse_inductor"``.

Both are registered through the ``torch_dynamo_backends`` entry point, so the names work
without importing normfuse first.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx

from normfuse.config import FuseConfig
from normfuse.reporting import FusionReport

__all__ = ["normfuse_backend", "normfuse_inductor_backend", "make_backend", "last_report", "run_pass"]

_LAST: list[FusionReport] = [FusionReport()]

log = logging.getLogger("normfuse")


def _snapshot(gm: fx.GraphModule) -> fx.GraphModule:
    """The untouched graph to run when anything after this point fails."""
    from normfuse.passes.pipeline import copy_graph_module
    return copy_graph_module(gm)


def last_report() -> FusionReport:
    """The report of every graph the registered backends rewrote in this process."""
    return _LAST[0]


def run_pass(gm: fx.GraphModule, config: FuseConfig) -> FusionReport:
    """``pipeline.run``, and when the pass failed and left the graph unchanged, the sites it
    would have rewritten, each with the failure as its reason (found again on a copy)."""
    from normfuse.passes import pipeline
    from normfuse.passes.dtensor_graph import hoist_from_local  # sequence parallel: add -> from_local -> norm

    hoist_from_local(gm)
    report = pipeline.run(gm, config)
    if report.sites or not report.warnings:
        return report
    failure = report.warnings[-1]
    try:
        index, states = pipeline.analyze(_snapshot(gm).graph)
        report.sites = [pipeline._site_record(index, st, i) for i, st in enumerate(states)]
    except Exception:  # noqa: BLE001 - the failure was in finding the sites: none to list
        log.debug("normfuse: sites not listed after a pass failure", exc_info=True)
        return report
    for site in report.sites:
        site.reason = failure
    return report


def make_backend(config: FuseConfig | None = None, report: FusionReport | None = None, *,
                 inductor: bool = False, model: Any = None) -> Callable:
    """A dynamo backend that rewrites each captured graph, then runs it eagerly or with inductor."""
    config = config or FuseConfig()
    report = report if report is not None else FusionReport()

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        # the pass works on copies and falls back by itself; this guard covers the rest
        # (Pre-Norm conversion, the checker, inductor) so that dynamo always gets a callable
        original = _snapshot(gm)
        try:
            if config.prenorm:
                from normfuse.passes import prenorm
                report.extend(prenorm.convert_graph(gm, config, model=model))
            graph_report = run_pass(gm, config)
            graph_report.graph_modules.append(gm)
            report.extend(graph_report)
            if config.check:
                from normfuse.verify.check import check_graph_on_first_call
                gm = check_graph_on_first_call(gm, graph_report, example_inputs, original=original)
            if inductor:
                from torch._inductor.compile_fx import compile_fx
                return compile_fx(gm, example_inputs)
            return gm.forward
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            message = (f"normfuse left this graph unchanged and runs it eagerly: {type(error).__name__}: {error}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            report.warnings.append(message)
            log.debug("normfuse backend failure", exc_info=True)
            return original.forward

    backend.normfuse_report = report  # type: ignore[attr-defined]
    return backend


def normfuse_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0])(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0], inductor=True)(gm, example_inputs)
