"""Dynamo backends: ``torch.compile(model, backend="normfuse")`` and ``"normfuse_inductor"``.

Both are registered through the ``torch_dynamo_backends`` entry point, so the names work
without importing normfuse first.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from normfuse.config import FuseConfig
from normfuse.reporting import FusionReport

__all__ = ["normfuse_backend", "normfuse_inductor_backend", "make_backend", "last_report"]

_LAST: list[FusionReport] = [FusionReport()]


def last_report() -> FusionReport:
    """The report of every graph the registered backends rewrote in this process."""
    return _LAST[0]


def make_backend(config: FuseConfig | None = None, report: FusionReport | None = None, *,
                 inductor: bool = False, model: Any = None) -> Callable:
    """A dynamo backend that rewrites each captured graph, then runs it eagerly or with inductor."""
    from normfuse.passes import pipeline

    config = config or FuseConfig()
    report = report if report is not None else FusionReport()

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        if config.prenorm:
            from normfuse.passes import prenorm
            report.extend(prenorm.convert_graph(gm, config, model=model))
        graph_report = pipeline.run(gm, config)
        graph_report.graph_modules.append(gm)
        report.extend(graph_report)
        if config.check:
            from normfuse.verify.check import check_graph_on_first_call
            gm = check_graph_on_first_call(gm, graph_report, example_inputs)
        if inductor:
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        return gm.forward

    backend.normfuse_report = report  # type: ignore[attr-defined]
    return backend


def normfuse_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0])(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0], inductor=True)(gm, example_inputs)
