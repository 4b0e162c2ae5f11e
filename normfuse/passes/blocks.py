"""The model side of the pass: its block lists and its norm modules, read from the module tree.

A block list is an outermost ``ModuleList``/``Sequential``/``ModuleDict`` of >= 2 modules of one
class that contain a norm (``encoder.layer`` in BERT, ``layers`` in llama and torchtitan). The
Post-Norm conversion registers a final norm per block list, the cross-block rewrite carries
the residual pair along one, and the report lists the norm modules no graph held.
"""

from __future__ import annotations

import torch.nn as nn

from normfuse.vocabulary import TORCH_NORMS

__all__ = ["BLOCK_CONTAINERS", "blocks_of", "block_lists", "is_norm_module"]


def is_norm_module(m: nn.Module) -> bool:
    """A norm module of the model: torch's, or model code's (a ``...Norm`` class with a 1-D
    weight: HF ``LlamaRMSNorm``, T5's ``T5LayerNorm``); not batch, group or local response norms."""
    if isinstance(m, TORCH_NORMS):
        return True
    if isinstance(m, (nn.GroupNorm, nn.modules.batchnorm._NormBase, nn.LocalResponseNorm)):
        return False
    w = getattr(m, "weight", None)
    return type(m).__name__.endswith("Norm") and isinstance(w, nn.Parameter) and w.ndim == 1


BLOCK_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def blocks_of(container: nn.Module) -> list[nn.Module]:
    """The blocks of a block list, in order (a ModuleDict's values: torchtitan keys its layers "0", "1", ...).
    A list may hold ``None`` where a model has no module (x-transformers' ``layer_integrators``,
    a block's norms without a post-branch norm): the entries are returned as they are."""
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def block_lists(model: nn.Module) -> list[str]:
    """Outermost ModuleLists/Sequentials/ModuleDicts of >= 2 modules of one class that contain norms;
    a list holding anything but modules (``None`` entries) is not one."""
    found: list[str] = []
    for name, mod in model.named_modules():
        if any(name == f or name.startswith(f + ".") for f in found if f):
            continue
        blocks = blocks_of(mod) if isinstance(mod, BLOCK_CONTAINERS) else []
        if len(blocks) >= 2 and all(isinstance(c, nn.Module) for c in blocks) and len({type(c) for c in blocks}) == 1 \
                and any(is_norm_module(m) for m in blocks[0].modules()):
            found.append(name)
    return found
