"""Dynamo backends: ``torch.compile(model, backend="normfuse")`` and ``"normfuse_inductor"``.

Both are registered through the ``torch_dynamo_backends`` entry point, so the names work
without importing normfuse first. Each captured graph goes through one ``NormFusionPass``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import torch
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
            return eager_checkpoints(gm).forward
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            message = (f"normfuse left this graph unchanged and runs it eagerly: {type(error).__name__}: {error}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            fusion.report.warnings.append(message)
            log.debug("normfuse backend failure", exc_info=True)
            return eager_checkpoints(original).forward

    backend.normfuse_report = fusion.report  # type: ignore[attr-defined]
    backend.normfuse_pass = fusion  # type: ignore[attr-defined]
    return backend


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
    return make_backend(report=_LAST[0])(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0], inductor=True)(gm, example_inputs)
