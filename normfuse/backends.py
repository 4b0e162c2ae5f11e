"""Dynamo backends: ``torch.compile(model, backend="normfuse")`` and ``"normfuse_inductor"``.

Both are registered through the ``torch_dynamo_backends`` entry point, so the names work
without importing normfuse first. Each captured graph goes through one ``NormFusionPass``;
what it did is kept as a ``normfuse.runs.GraphRecord``, noted run by run by the callable
handed back to dynamo. ``optimize`` keeps its records with the model; the registered
backends keep theirs in one process-wide list of weak references (a record lives as long
as dynamo keeps its compiled code, so a long-running process holds no stale graph), from
which ``normfuse.report(model)`` picks the records that ran on the model's parameters.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.config import FuseConfig
from normfuse.reporting import FusionReport
from normfuse.runs import GraphRecord, RunLog, find_anchor, model_report, tracked

__all__ = ["normfuse_backend", "normfuse_inductor_backend", "make_backend", "FusingBackend", "last_report",
           "registered_records", "eager_checkpoints"]

log = logging.getLogger("normfuse")

# the records of the registered backends, weakly: each lives as long as its compiled code
_REGISTERED: list[weakref.ref] = []


def _register(record: GraphRecord) -> None:
    _REGISTERED[:] = [ref for ref in _REGISTERED if ref() is not None]
    _REGISTERED.append(weakref.ref(record))


def registered_records() -> list[GraphRecord]:
    """The records of the graphs the registered backends rewrote whose compiled code is alive."""
    return [record for record in (ref() for ref in _REGISTERED) if record is not None]


def last_report() -> FusionReport:
    """Every graph run of the registered backends in this process whose compiled code is
    alive, module paths relative to each compiled frame (``normfuse.report(model)`` gives
    them whole, for one model)."""
    return model_report(registered_records())


def make_backend(config: FuseConfig | None = None, *, sink: Callable[[GraphRecord], None] = _register,
                 inductor: bool = False, model: Any = None) -> Callable:
    """A dynamo backend that rewrites each captured graph, hands its record to ``sink`` and
    runs the graph eagerly, or with inductor. ``model``: the module the graphs come from
    (the Pre-Norm conversion registers its final norms there)."""
    from normfuse.passes.graph import copy_graph_module
    from normfuse.passes.pipeline import NormFusionPass

    fusion = NormFusionPass(config, model=model)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        # the pass works on copies and falls back by itself; this guard covers the rest
        # (the checker, inductor) so that dynamo always gets a callable. The pass swaps in new
        # graphs and never edits the ones it was given, so those are the graph to fall back to.
        anchor = find_anchor(gm)
        given = {module: module.graph for module in _graph_modules(gm)}
        try:
            original = copy_graph_module(gm) if fusion.config.check else None
            result = fusion(gm)
            report = result.report
            if fusion.config.check:
                from normfuse.verify.graph_check import check_graph_on_first_call
                gm = check_graph_on_first_call(gm, report, example_inputs, original=original)
            if inductor:
                from torch._inductor.compile_fx import compile_fx
                compiled = compile_fx(gm, example_inputs)
            else:
                compiled = eager_checkpoints(gm).forward
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            message = (f"normfuse left this graph unchanged and runs it eagerly: {type(error).__name__}: {error}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log.debug("normfuse backend failure", exc_info=True)
            for module, graph in given.items():
                if module.graph is not graph:
                    module.graph = graph
            gm.__dict__.pop("forward", None)  # the checker's first-call wrapper, if it got that far
            report = FusionReport(graphs=1, warnings=[message], graph_modules=[gm])
            compiled = eager_checkpoints(gm).forward
        record = GraphRecord.of(report, anchor)
        sink(record)
        return tracked(compiled, record)

    backend.normfuse_pass = fusion  # type: ignore[attr-defined]
    return backend


@dataclass
class FusingBackend:
    """Makes the normfuse backend of one optimized model: its graphs' records go to the
    model's log. A plain object, so that a copied or unpickled model gets its own. (Models
    pickled before it moved here name it ``normfuse.api.FusingBackend``, which still resolves.)"""

    config: FuseConfig
    log: RunLog
    model: nn.Module

    def __call__(self):
        return make_backend(self.config, sink=self.log.add, model=self.model)


def _graph_modules(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """``gm`` and the graph modules nested in it (the subgraphs of higher-order ops)."""
    found = [gm]
    for child in gm.children():
        if isinstance(child, fx.GraphModule):
            found += _graph_modules(child)
    return found


# --------------------------------------------------------------------------------------
# Running checkpointed regions eagerly
# --------------------------------------------------------------------------------------
# Dynamo captures torch.utils.checkpoint as a ``tag_activation_checkpoint`` region, written
# to be traced by AOTAutograd. Run eagerly (as the plain backend runs graphs, and as
# torch.compile(backend="eager") does), that op
# * recomputes with preserve_rng_state=False, so a dropout inside draws another mask in the
#   backward than in the forward and the gradients are wrong (HF BERT in training with
#   gradient checkpointing: max |grad difference| 9.4 against the model run without it);
# * interprets the region node by node (torch.fx.Interpreter) under a selective-checkpointing
#   dispatch mode, where the model's own code called the block directly.
# So the regions run through torch.utils.checkpoint itself, as the model's own code did:
# non-reentrant, RNG state kept for the recompute, a selective-checkpointing policy kept.


def _checkpoint_as_eager(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``tag_activation_checkpoint`` run as eager runs ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    kwargs = {**kwargs, "use_reentrant": False, "preserve_rng_state": True}
    if "_checkpoint_context_fn" in body.meta:  # selective checkpointing's policy
        kwargs["context_fn"] = body.meta["_checkpoint_context_fn"]
    return checkpoint(body, *args, **kwargs)


def eager_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the checkpointed regions of ``gm`` (nested ones too) run as eager checkpointing runs
    when ``gm`` runs eagerly; returns ``gm``."""
    region = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    changed = False
    for node in gm.graph.nodes:
        if region is not None and node.op == "call_function" and node.target is region:
            node.target = _checkpoint_as_eager
            changed = True
        if node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            eager_checkpoints(getattr(gm, node.target))
    if changed:
        gm.recompile()
    return gm


def normfuse_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend()(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(inductor=True)(gm, example_inputs)
