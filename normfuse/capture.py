"""Capture: how dynamo takes a model's graphs, for every way in.

- ``ModelForward`` is what ``optimize`` installs as ``model.forward``: the model's own
  forward, compiled by dynamo through a frame of its own with the backend its factory
  makes (``compile_forward``); a failure of dynamo's capture itself falls back to eager.
- ``record_graphs`` captures a model's graphs untouched, each with the inputs of its first
  run for every module it runs for: the "original" the checker holds the rewrite to,
  captured through the same entry as ``optimize``'s (so the graphs line up).
- ``capture_once`` is the one forward under dynamo that the checker (``record_graphs``) and
  the audit (``normfuse.auditing``) make; entered as ``optimize`` enters, it runs through
  ``ModelForward`` and ``compile_forward``, optimize's own entry.

Each graph a backend compiles is noted run by run (``normfuse.runs``): one compiled graph
may run for several modules (the blocks of a stack under FSDP2 or per-block compile).
"""

from __future__ import annotations

import itertools
import logging
import types
import warnings
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.runs import Anchor, find_anchor

__all__ = ["ModelForward", "CAPTURE_CONFIG", "compile_forward", "capture_once", "Recorder", "record_graphs"]

log = logging.getLogger("normfuse")


# Dynamo's settings while it captures an optimized model with grad on:
# - a Python side effect inside an activation-checkpointed region (a block under HF's
#   gradient_checkpointing_enable, torch.utils.checkpoint) runs once, in the forward. Without
#   this, dynamo cannot trace such a region at all (eager would replay the effect in the
#   recompute) and gives up the whole forward: the model ran eagerly. Forward wrappers that
#   set a context variable and reset it on the way out are that case: the `kernels` package,
#   which transformers requires from 5.25 on, wraps the attention's forward so.
# Set for the call and put back after it (plain attribute writes: ``config.patch`` costs a
# millisecond per call); without grad no checkpoint recomputes, and nothing is set.
CAPTURE_CONFIG = {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}

_FRAMES = itertools.count(1)


def own_code(code: types.CodeType, owner: str) -> types.CodeType:
    """A copy of ``code`` that dynamo tells apart from every other: its own cache of
    compiled code, and its own record of which inputs changed between compiles (dynamo keys
    that on the file, first line and name, so the copy's name carries the model's class and a
    number, counted per process). Tracebacks and dynamo's logs show that name
    (``wrapper_LlamaModel_normfuse3``)."""
    return code.replace(co_name=f"{code.co_name}_{owner}_normfuse{next(_FRAMES)}")


def compile_forward(module: nn.Module, forward: Callable, backend: Callable) -> Callable:
    """``forward`` (the module's own, bound to it) compiled by dynamo with ``backend``,
    entering through a code object of its own:

    - dynamo caches compiled code per code object, at most recompile_limit (8) entries:
      with the class's forward as that frame, the 9th optimized instance of a class
      silently ran eagerly. A copy of the forward's code (same argument names, so the graphs
      read as ``torch.compile(model)``'s) gives each model a cache of its own;
    - dynamo keeps what it learned of a frame's inputs (which scalars and sizes changed
      between compiles, and so become graph inputs) per (file, first line, code name),
      not per code object: transformers' forwards share one decorator's code, so a norm's
      eps that differed between two models became a graph input in every later model and
      its norms went unrecognized. The copy is named apart (``own_code``);
    - a forward in ``torch.nn`` (``nn.Sequential``, ``nn.TransformerEncoder``) is in a file
      dynamo skips, so nothing would be captured: it enters through a frame of ours, with
      the model as the local ``self`` (module paths read "layers.0.norm1")."""
    from torch._dynamo import trace_rules

    if not (isinstance(forward, types.MethodType) and forward.__self__ is module):
        return torch.compile(forward, backend=backend)
    func = forward.__func__
    if trace_rules.check(forward):
        def forward_frame(self, *args: Any, **kwargs: Any) -> Any:
            return func(self, *args, **kwargs)

        forward_frame.__code__ = own_code(forward_frame.__code__, type(module).__name__)
        compiled = torch.compile(forward_frame, backend=backend)
        return lambda *args, **kwargs: compiled(module, *args, **kwargs)
    own = types.FunctionType(own_code(func.__code__, type(module).__name__), func.__globals__, func.__name__, func.__defaults__,
                             func.__closure__)
    own.__kwdefaults__, own.__qualname__ = func.__kwdefaults__, func.__qualname__
    return torch.compile(types.MethodType(own, module), backend=backend)


class ModelForward:
    """A model's forward compiled with a backend: installed as the instance attribute
    ``model.forward`` (not ``model.compile``, whose compiled call ``nn.Module.__getstate__``
    drops: a deep copy would silently run eagerly; this attribute is copied with the model,
    and the copy compiles its own forward, on its own parameters, on its first call).

    ``make_backend()`` gives the dynamo backend, once, at the first call. A failure of
    dynamo's capture itself (``InternalTorchDynamoError``, ``BackendCompilerFailed``, a
    fake-tensor error) is not the user's error: the call is repeated eagerly. When that
    succeeds the model runs eagerly from then on, with one warning (also passed to
    ``on_warning``); when it raises too, the error was the user's own and propagates as in
    eager. Hooks of the model run outside the compiled region, as with ``torch.compile(model)``.
    """

    def __init__(self, module: nn.Module, forward: Callable, make_backend: Callable[[], Callable],
                 on_warning: Callable[[str], None] | None = None):
        self.module = module
        self.forward = forward            # the model's own forward, bound to it
        self.__wrapped__ = forward        # inspect.signature(model.forward) shows the model's signature
        self.make_backend = make_backend
        self.on_warning = on_warning
        self.eager_reason: str | None = None
        self._compiled: Any = None        # built on the first call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None or torch.compiler.is_compiling():
            # inside another torch.compile region the outer compiler traces the plain forward
            return self.forward(*args, **kwargs)
        if self._compiled is None:
            self._compiled = compile_forward(self.module, self.forward, self.make_backend())
        try:
            if not torch.is_grad_enabled():
                return self._compiled(*args, **kwargs)
            config = torch._dynamo.config
            before = {name: getattr(config, name) for name in CAPTURE_CONFIG}
            for name, value in CAPTURE_CONFIG.items():
                setattr(config, name, value)
            try:
                return self._compiled(*args, **kwargs)
            finally:
                for name, value in before.items():
                    setattr(config, name, value)
        except torch._dynamo.exc.TorchDynamoException as error:
            log.debug("normfuse: capture failed", exc_info=True)
            result = self.forward(*args, **kwargs)  # the user's own error raises here, as in eager
            text = str(error).strip()
            self.eager_reason = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
            message = (f"normfuse runs {type(self.module).__name__} eagerly (unoptimized): dynamo could not capture "
                       f"its forward ({self.eager_reason}). The model's results are unchanged; run "
                       "torch.compile(model, backend='eager') to see the capture error, and report it with the model.")
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            if self.on_warning is not None:
                self.on_warning(message)
            return result

    def __getstate__(self) -> dict:
        # a copy or a loaded model compiles afresh (compiled code neither copies nor pickles)
        state = dict(self.__dict__)
        state["_compiled"] = None
        return state


# --------------------------------------------------------------------------- the untouched graphs

class Recorder:
    """A dynamo backend that keeps each captured graph untouched and, for every module it
    runs for, the inputs of its first run there: ``graphs`` lists (graph copy, inputs) in
    the order the runs started, as the pass's report lists its graph runs."""

    def __init__(self):
        self.graphs: list[list] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]):
        from normfuse.passes.graph import copy_graph_module

        untouched = copy_graph_module(gm)
        anchor: Anchor | None = find_anchor(gm)
        seen: dict[int, Any] = {}

        def forward(*args):
            param = args[anchor.position] if anchor is not None else None
            if id(param) not in seen or seen[id(param)] is not param:
                seen[id(param)] = param
                self.graphs.append([untouched, [a.detach() if isinstance(a, torch.Tensor) else a for a in args]])
            return gm.forward(*args)

        return forward


def capture_once(model: nn.Module, args: tuple, kwargs: dict, backend: Callable, *, grad: bool,
                 like_optimize: bool = True, dynamic: bool | None = None) -> Any:
    """Call ``model(*args, **kwargs)`` once under dynamo with ``backend``, in grad mode ``grad``,
    and return its output. ``like_optimize``: entered as ``optimize`` enters (a ``ModelForward``
    installed for the call, so ``compile_forward``'s frame, the model's own hooks running around
    it; the model's forward attribute is put back after); else as ``torch.compile(model,
    dynamic=dynamic)`` enters.

    ``optimize`` itself does not call this: its ``ModelForward`` stays installed, compiles on
    the model's first call and serves every later one. The audit enters as ``torch.compile``
    does because it must see dynamo's errors (``ModelForward`` turns them into an eager run
    and a warning): a meta-device forward that builds tensors of its own is captured again,
    accepting them. The checker's and the audit's backends differ too: the checker's
    (``Recorder``) keeps an untouched copy of each graph and the inputs of its first run per
    module, to run them against fp64; the audit's keeps each graph as dynamo gave it with the
    modules it runs for, since the pass only analyses it and no numbers are compared."""
    with torch.set_grad_enabled(grad):
        if not like_optimize:
            return torch.compile(model, backend=backend, dynamic=dynamic)(*args, **kwargs)
        before = model.__dict__.get("forward")
        model.forward = ModelForward(model, model.forward, lambda: backend)
        try:
            return model(*args, **kwargs)
        finally:
            del model.forward
            if before is not None:
                model.forward = before


def record_graphs(model: nn.Module, args: tuple, kwargs: dict, grad: bool, like_optimize: bool = True
                  ) -> list[tuple[fx.GraphModule, list[Any]]]:
    """The model's graphs, untouched, with each run's first inputs; captured the way
    ``optimize`` captures (``like_optimize``) or the way ``torch.compile(model)`` does
    (``capture_once``), in the grad mode the optimized model ran in
    (``nn.TransformerEncoderLayer`` takes a fused fast path without grad: another graph)."""
    recorder = Recorder()
    capture_once(model, args, kwargs, recorder, grad=grad, like_optimize=like_optimize)
    return [(gm, inputs) for gm, inputs in recorder.graphs]
