"""Count a model's norms and the adds feeding them in an eager run, without normfuse.

A norm is a call of ``F.layer_norm`` / ``F.rms_norm`` (any spelling that reaches torch's
function dispatch), or a call of a module whose class name says it is a LayerNorm or RMSNorm
and that made no such call itself (a norm written out by hand: HF ``LlamaRMSNorm``, T5,
Cohere). A norm's input "is an add" when the tensor it receives is the very object an add
returned (``x + y``, ``torch.add``, ``+=``); dropout in eval and no-op casts return their input,
so those count too, while a reshape in between does not.

This is deliberately simpler than normfuse's matcher (no graph, no canonical forms): the zoo
asserts both counts, so a difference is visible in the expected table.
"""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_NORM_FUNCTIONS = {F.layer_norm, F.rms_norm, torch.layer_norm, torch.rms_norm, torch.native_layer_norm}
_ADD_FUNCTIONS = {torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__, torch.Tensor.__radd__,
                  torch.Tensor.__iadd__}
# LayerNorm, RMSNorm, LlamaRMSNorm, T5LayerNorm, LayerNorm2d, CohereLayerNorm, ... (not Batch/Group norms)
NORM_CLASS = re.compile(r"(LayerNorm|RMSNorm|RmsNorm)(2d|Fp32|Gated)?$", re.IGNORECASE)


@dataclass
class EagerCounts:
    norms: int = 0          # norm calls in one forward
    input_is_add: int = 0   # of those, the ones whose input is an add's result
    modules: list = field(default_factory=list)  # module paths of the norm modules that ran, in call order

    def as_dict(self) -> dict[str, int]:
        return {"norms": self.norms, "input_is_add": self.input_is_add}


class _Counter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts = EagerCounts()
        self.sums: dict[int, weakref.ref] = {}  # id -> the add's result (ids of dead tensors get reused)
        self.frames: list[list[int]] = []  # norm calls made inside each open norm module

    def note_norm(self, x) -> None:
        self.counts.norms += 1
        seen = self.sums.get(id(x))
        self.counts.input_is_add += seen is not None and seen() is x
        if self.frames:
            self.frames[-1][0] += 1

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NORM_FUNCTIONS:
            self.note_norm(args[0] if args else (kwargs or {}).get("input"))
        elif func in _ADD_FUNCTIONS and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.sums[id(out)] = weakref.ref(out)
        return out


def count_eager(model: nn.Module, args: tuple, kwargs: dict) -> EagerCounts:
    """Norm calls and add-fed norm calls in one forward of ``model`` (no grad, eager)."""
    counter = _Counter()
    handles = []
    names = {module: name for name, module in model.named_modules()}

    def enter(module, inputs):
        counter.frames.append([0])

    def leave(module, inputs, output):
        if names[module] not in counter.counts.modules:
            counter.counts.modules.append(names[module])
        inner = counter.frames.pop()[0]
        if inner == 0:  # written out by hand: the module itself is the norm
            counter.note_norm(inputs[0] if inputs else None)
        elif counter.frames:
            counter.frames[-1][0] += inner

    for module in model.modules():
        if NORM_CLASS.search(type(module).__name__) and not isinstance(module, (nn.BatchNorm2d, nn.GroupNorm)):
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    try:
        with torch.no_grad(), counter:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return counter.counts
