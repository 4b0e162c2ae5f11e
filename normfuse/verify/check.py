"""Did the rewrite keep the model? ``normfuse.check``.

    res = normfuse.check(model, *example_args, **example_kwargs)
    res.ok                  # every output, gradient and rewritten site passed
    res.outputs             # per output / gradient: error vs fp64, the original's error, the bound
    res.sites               # per rewritten site: numeric check vs its original subgraph, symbolic proof
    res.first_divergence    # the first failing site in graph order (id, fqn, source) or None

Three runs on the same inputs: the original model, the optimized one and an fp64 copy of
the original (``numeric.Fp64Mode`` widens the casts in its code). Each output and each
gradient (floating inputs, every parameter) passes when
``err(optimized, fp64) <= m * err(original, fp64) + atol`` (``normfuse.tolerances``).
Each rewritten site is then held to the subgraph it replaced (``graph_check.py``), on the
values that reached it in a run of the original graph (captured as ``optimize`` captures,
``capture.record_graphs``), so a failure names the site instead of a far-away output.
The result types are in ``result.py``; the command line (``normfuse check``) in ``normfuse/cli.py``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.nn as nn

from normfuse.api import optimize, report
from normfuse.capture import record_graphs
from normfuse.errors import InvalidModelError, NormfuseError
from normfuse.preparation import prepare
from normfuse.verify.graph_check import check_sites, compare_all, result_of, unpaired_graphs
from normfuse.verify.numeric import Fp64Mode, flatten, fp64_copy, model_copy, tensors_with_history, to_fp64
from normfuse.verify.result import CheckResult, SiteCheck

__all__ = ["check", "CheckResult", "SiteCheck"]


# --------------------------------------------------------------------------- runs

def _inputs_with_grad(args: tuple, kwargs: dict, backward: bool) -> tuple[tuple, dict, list[tuple[str, torch.Tensor]]]:
    """Fresh copies of the floating inputs (requiring grad when ``backward``) and their names."""
    leaves: list[tuple[str, torch.Tensor]] = []

    def fresh(name, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            value = value.detach().clone().requires_grad_(backward)
            leaves.append((name, value))
        return value

    new_args = tuple(fresh(f"input[{i}]", a) for i, a in enumerate(args))
    new_kwargs = {k: fresh(f"input.{k}", v) for k, v in kwargs.items()}
    return new_args, new_kwargs, leaves


def _named_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name.removeprefix("_orig_mod."), p) for name, p in model.named_parameters() if p.requires_grad]


def _run(model: nn.Module, args: tuple, kwargs: dict, backward: bool, seed: int, fp64: bool = False,
         input_grads: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """Forward (and backward) of one model: (outputs by name, gradients by name).

    The backward pulls a fixed random cotangent (drawn in fp64 from ``seed``, then cast to
    each output's dtype) through every floating output; ``input_grads``: the floating inputs'
    gradients too, besides the parameters'."""
    args, kwargs, leaves = _inputs_with_grad(args, kwargs, backward and input_grads)
    leaves = leaves if input_grads else []
    # the fp64 mode covers backward too: checkpointed regions recompute their forward there
    with torch.set_grad_enabled(backward), (Fp64Mode() if fp64 else contextlib.nullcontext()):
        return _forward_backward(model, args, kwargs, leaves, backward, seed, fp64)


def _forward_backward(model: nn.Module, args: tuple, kwargs: dict, leaves: list, backward: bool, seed: int,
                      fp64: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    out = model(*args, **kwargs)
    outputs = dict(flatten(out))
    grads: dict[str, torch.Tensor | None] = {}
    if backward:
        cotangents = _cotangents(outputs, seed)
        differentiable = [(k, v) for k, v in outputs.items() if v.requires_grad and v.is_floating_point()]
        wrt = leaves + _named_parameters(model)
        if differentiable and wrt:
            grad = Fp64Mode.grad if fp64 else functools.partial(torch.autograd.grad, allow_unused=True)
            got = grad([v for _, v in differentiable], [t for _, t in wrt],
                       [cotangents[k].to(v.dtype) for k, v in differentiable])
            grads = {f"grad:{name}": g for (name, _), g in zip(wrt, got)}
    return {k: v.detach() for k, v in outputs.items()}, grads


def _cotangents(outputs: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g, dtype=torch.float64).to(v.device)
            for k, v in outputs.items() if v.is_floating_point()}


# --------------------------------------------------------------------------- the API

def _progress(callback: Callable[[str], None] | None, message: str) -> None:
    if callback is not None:
        callback(message)


def check(model: nn.Module, *example_args: Any, optimized: nn.Module | None = None, backward: bool = True,
          seed: int = 0, progress: Callable[[str], None] | None = None, **example_kwargs: Any) -> CheckResult:
    """Check that ``optimized`` (default: ``normfuse.optimize`` of a deep copy of ``model``) computes
    what ``model`` computes, output by output, gradient by gradient and site by site.

    example_args / example_kwargs: the inputs; made for transformers models and
    ``zoo.ToyTransformer`` when none are given. backward: also compare the gradients of
    floating inputs and of every parameter. progress: called with a line per stage.
    ``model`` itself is never changed.
    """
    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"check takes the original torch.nn.Module, got {type(model).__name__}.")
    if optimized is not None and not isinstance(optimized, nn.Module):
        raise InvalidModelError(f"optimized must be an nn.Module optimized by normfuse, got "
                                f"{type(optimized).__name__}.")
    args, kwargs = example_args, example_kwargs
    if not args and not kwargs:
        from normfuse.targets import make_inputs
        try:
            args, kwargs = make_inputs(model)
        except NormfuseError as error:
            raise InvalidModelError(f"no example inputs given and none can be made: {error} Pass them: "
                                    "normfuse.check(model, *args, **kwargs).") from error
    notes: list[str] = []
    if model.training:
        notes.append("the model is in training mode: dropout makes runs differ; call model.eval() first")
    cached = tensors_with_history(model)
    if optimized is None:
        _progress(progress, "optimizing a deep copy")
        optimized = optimize(model_copy(model))
    model64 = fp64_copy(model)  # before the first run: the copies start from the model's state as given
    regrouped = _regrouped_copy(model, optimized)
    # capture first too, so that the original's graphs come from the state the copies start
    # from (a model filling a cache on its first call traces another graph once it is filled).
    # Sites of a regrouped stream are held to the regrouped model's graphs, which have the
    # same cut between blocks; the regrouping itself is compared with the original below.
    _progress(progress, "capturing the original graph to localize")
    originals = record_graphs(regrouped or model, args, kwargs, backward)
    _progress(progress, "running the original, the optimized model and the fp64 reference")
    rng = _rng_states()
    input_grads = True
    try:
        out_orig, grad_orig = _run(model, args, kwargs, backward, seed)
    except RuntimeError as error:
        if not backward or isinstance(error, torch.OutOfMemoryError) \
                or not _inputs_with_grad(args, kwargs, True)[2]:
            raise  # not an input read as data: no floating input was made to require grad
        # an input the model reads as data, not as a value to differentiate (HunyuanVideo's float
        # mask summed to an int): the parameters' gradients are compared, the inputs' are not
        with _replaying(rng):
            out_orig, grad_orig = _run(model, args, kwargs, backward, seed, input_grads=False)
        input_grads = False
        notes.append("the inputs are not differentiated: the model fails with its floating inputs requiring grad "
                     f"({(str(error).splitlines() or [type(error).__name__])[0][:160]}); the parameters' "
                     "gradients are compared")
    regrouping_ok = True
    if regrouped is not None:
        with _replaying(rng):  # the same dropout masks as the original's run
            got = _run(regrouped, args, kwargs, backward, seed, input_grads=input_grads)
        regrouping_ok, note = _regrouping(regrouped, got, (out_orig, grad_orig))
        notes.append(note)
    out_new, grad_new = _run(optimized, args, kwargs, backward, seed, input_grads=input_grads)
    out_ref, grad_ref = _run(model64, to_fp64(args), to_fp64(kwargs), backward, seed, fp64=True,
                             input_grads=input_grads)
    rep = report(optimized)
    notes += [f"pass: {w}" for w in rep.warnings]
    if not rep.fused:
        notes.append("the pass rewrote no site: the optimized model runs the original graph")
    if cached:
        # the copies hold these detached: a gradient that reaches a parameter only through
        # them exists in the original alone, and is not a difference the rewrite made
        only_original = sorted(k for k, g in grad_orig.items() if g is not None and grad_new.get(k) is None
                               and grad_ref.get(k) is None)
        for k in only_original:
            del grad_orig[k]
        notes.append(f"the model holds tensors with autograd history ({', '.join(list(cached)[:3])}: a cache built "
                     "from parameters?); the optimized and fp64 copies hold them detached, so gradients through them "
                     f"are not compared ({', '.join(only_original) or 'none'})")
    outputs = compare_all({**out_orig, **grad_orig}, {**out_new, **grad_new}, {**out_ref, **grad_ref})

    if unpaired_graphs(rep, originals):  # e.g. ``optimized`` compiled with torch.compile(backend="normfuse")
        originals += record_graphs(model, args, kwargs, backward, like_optimize=False)
    unverified_why: list[str] = []
    if not originals:
        unverified_why.append("dynamo captured no graph of the original model (recompile limit reached? call "
                              "torch._dynamo.reset())")
    _progress(progress, f"checking {len(rep.fused)} rewritten sites (numeric and symbolic)")
    sites = check_sites(rep, originals, unverified_why) if originals else []
    return result_of(outputs, sites, rep, notes, unverified_why, regrouping_ok)


def _regrouped_copy(model: nn.Module, optimized: nn.Module) -> nn.Module | None:
    """A copy of ``model`` with the streams that ``optimized`` carries across blocks regrouped
    the same way (normfuse.passes.cross_block), or None when it carries none."""
    from normfuse.passes.cross_block import crosses_checkpoints, rewritten_streams

    if not rewritten_streams(optimized):
        return None
    regrouped = model_copy(model)
    prepare(regrouped, cross_checkpoints=crosses_checkpoints(optimized))
    return regrouped


def _rng_states() -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []


@contextlib.contextmanager
def _replaying(states: tuple):
    """Run with the random states ``states``, then go on from the states before."""
    cpu, cuda = states
    with torch.random.fork_rng(devices=range(len(cuda))):
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
        yield


def _regrouping(regrouped: nn.Module, got: tuple[dict, dict], want: tuple[dict, dict]) -> tuple[bool, str]:
    """The regrouping moves adds across block boundaries and changes no operand: its outputs
    and gradients must equal the original's bit for bit. (Whether they do, and the note.)"""
    from normfuse.passes.cross_block import rewritten_streams

    streams = ", ".join(fqn or type(regrouped).__name__ for fqn in rewritten_streams(regrouped))
    (out, grad), (out_want, grad_want) = got, want
    values, wanted = {**out, **grad}, {**out_want, **grad_want}
    differ = [name for name in wanted if not _same(values.get(name), wanted[name])]
    if differ:
        return False, (f"cross-block: the regrouped model differs from the original ({streams}) in "
                       f"{len(differ)} values: {', '.join(differ[:4])}")
    return True, (f"cross-block: the residual pairs carried across the blocks of {streams}: the regrouped model "
                  f"equals the original bit for bit in all {len(wanted)} outputs and gradients")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a is None and b is None
