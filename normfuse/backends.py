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
            return keep_rng_in_checkpoints(gm).forward
        except Exception as error:  # noqa: BLE001 - the user's model must never break
            message = (f"normfuse left this graph unchanged and runs it eagerly: {type(error).__name__}: {error}. "
                       "Please report it with the model that triggers it.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            fusion.report.warnings.append(message)
            log.debug("normfuse backend failure", exc_info=True)
            return keep_rng_in_checkpoints(original).forward

    backend.normfuse_report = fusion.report  # type: ignore[attr-defined]
    backend.normfuse_pass = fusion  # type: ignore[attr-defined]
    return backend


# --------------------------------------------------------------------------------------
# Running checkpointed regions eagerly
# --------------------------------------------------------------------------------------
# Dynamo captures torch.utils.checkpoint as a ``tag_activation_checkpoint`` region, written
# to be traced by AOTAutograd: run eagerly (as the plain backend runs graphs) it recomputes
# with preserve_rng_state=False, so a dropout inside draws another mask in the backward than
# in the forward and the gradients are wrong (torch.compile(backend="eager") does the same:
# HF BERT in training with gradient checkpointing, max |grad difference| 9.4 against the
# model run without checkpointing). Regions that draw random numbers run through
# torch.utils.checkpoint with the RNG state restored for the recompute, as eager does.

_RANDOM_NAMES = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "poisson", "exponential",
                 "geometric", "cauchy")


def _draws_random(node: fx.Node, module: torch.nn.Module) -> bool:
    if node.op == "get_attr":
        body = getattr(module, node.target, None)
        return isinstance(body, fx.GraphModule) and any(_draws_random(n, body) for n in body.graph.nodes)
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.kwargs.get("dropout_p"):  # a fused add_norm drawing its dropout mask
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return any(word in name.lower() for word in _RANDOM_NAMES)


def _checkpoint_keeping_rng(body: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
    """``tag_activation_checkpoint`` run eagerly with the RNG state kept for the recompute."""
    from torch.utils.checkpoint import checkpoint

    kwargs = {**kwargs, "use_reentrant": False, "preserve_rng_state": True}
    if "_checkpoint_context_fn" in body.meta:  # selective checkpointing's policy
        kwargs["context_fn"] = body.meta["_checkpoint_context_fn"]
    return checkpoint(body, *args, **kwargs)


def keep_rng_in_checkpoints(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the checkpointed regions of ``gm`` that draw random numbers recompute with the forward's
    random numbers when ``gm`` runs eagerly; returns ``gm``."""
    region = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    changed = False
    for node in gm.graph.nodes:
        if region is not None and node.op == "call_function" and node.target is region \
                and _draws_random(node.args[0], gm):
            node.target = _checkpoint_keeping_rng
            changed = True
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), fx.GraphModule):
            keep_rng_in_checkpoints(getattr(gm, node.target))
    if changed:
        gm.recompile()
    return gm


def normfuse_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0])(gm, example_inputs)


def normfuse_inductor_backend(gm: fx.GraphModule, example_inputs: list[Any]):
    return make_backend(report=_LAST[0], inductor=True)(gm, example_inputs)
