"""Post-Norm -> Pre-Norm, the model side: the block lists of a model and the final norm each
converted residual stream ends in (registered on the model, so it trains, saves and loads).

``prepare_module(model)`` runs before capture (``optimize(model, prenorm=True)``); the graph
conversion (normfuse/passes/prenorm.py) decides which registered final norms a converted
stream uses, and the others are dropped again.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from normfuse.passes.blocks import block_lists, blocks_of, is_norm_module
from normfuse.reporting import FusionReport
from normfuse.vocabulary import FINAL_NORM_NAME

__all__ = ["prepare_module", "unprepare_module", "final_norms", "final_norm_like", "register_final",
           "drop_unused_finals", "FINALS_ATTR"]

FINALS_ATTR = "_normfuse_prenorm_final"  # model attribute: {block list fqn: final norm fqn}
_KEPT_ATTR = "_normfuse_prenorm_kept"     # model attribute: final norms a converted stream uses
_HOOK_ATTR = "_normfuse_prenorm_hook"     # model attribute: the load_state_dict hook prepare_module added


def _eps_of(m: nn.Module) -> float | None:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(m, attr, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def final_norm_like(template: nn.Module | None, kind: str | None = None, hidden: int | None = None,
                     eps: float | None = None, like: torch.Tensor | None = None) -> nn.Module:
    """A fresh norm of the model's kind, initialized to identity (weight 1, bias 0)."""
    if template is not None:
        w = getattr(template, "weight", None)  # None: a norm without affine (its weight, if any, comes after it)
        shape = getattr(template, "normalized_shape", None)
        hidden = w.shape[0] if w is not None else shape[-1] if shape else hidden
        like = w if w is not None else next(template.buffers(), like)
        eps = _eps_of(template) if _eps_of(template) is not None else eps
        if isinstance(template, nn.LayerNorm):
            kind = "layer_norm"
        elif isinstance(template, nn.RMSNorm) or "rms" in type(template).__name__.lower():
            kind = "rms_norm"
        else:
            kind = "layer_norm" if isinstance(getattr(template, "bias", None), nn.Parameter) else "rms_norm"
    factory = dict(device=like.device, dtype=like.dtype) if like is not None else {}
    if kind == "layer_norm":
        has_bias = template is None or getattr(template, "bias", None) is not None
        affine = template is None or getattr(template, "weight", None) is not None
        return nn.LayerNorm(hidden, eps=eps if eps is not None else 1e-5, elementwise_affine=affine,
                            bias=has_bias and affine, **factory)
    affine = template is None or getattr(template, "weight", None) is not None
    return nn.RMSNorm(hidden, eps=eps, elementwise_affine=affine, **factory)


def register_final(model: nn.Module, parent_fqn: str, attr: str, module: nn.Module) -> str:
    parent = model.get_submodule(parent_fqn) if parent_fqn else model
    name, k = attr, 1
    while hasattr(parent, name):
        name, k = f"{attr}_{k}", k + 1
    parent.add_module(name, module)
    return f"{parent_fqn}.{name}" if parent_fqn else name


def prepare_module(model: nn.Module) -> dict[str, str]:
    """Register one identity-initialized final norm per block list of ``model``; returns
    ``{block list fqn: final norm fqn}``. Calling it again changes nothing.

    A block list is an outermost ``ModuleList``/``Sequential`` of >= 2 modules of one class
    that contain a norm (``encoder.layer`` in BERT; ``encoder.layers`` and ``decoder.layers``
    in BART, so an encoder-decoder gets two). Its final norm is registered next to it, as
    ``<parent>.normfuse_final_norm``, with the kind, size, eps and dtype of the last norm
    of the last block. A model with norms but no block list gets one at its root. It must
    exist before the first call so that an optimizer built right after ``optimize`` sees it;
    the first call removes it again when its stream is not converted.
    """
    done = getattr(model, FINALS_ATTR, None)
    if done is not None:
        return done
    object.__setattr__(model, _KEPT_ATTR, set())
    hook = model.register_load_state_dict_post_hook(_pending_finals_are_optional)
    object.__setattr__(model, _HOOK_ATTR, hook)
    mapping: dict[str, str] = {}
    lists = block_lists(model)
    if not lists and any(is_norm_module(m) for m in model.modules()):
        lists = [""]
    for fqn in lists:
        scope = model.get_submodule(fqn) if fqn else model
        last = blocks_of(scope)[-1] if fqn else scope
        norms = [m for m in last.modules() if is_norm_module(m)]
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        mapping[fqn] = register_final(model, parent, FINAL_NORM_NAME, final_norm_like(norms[-1]))
    object.__setattr__(model, FINALS_ATTR, mapping)
    return mapping


def unprepare_module(model: nn.Module) -> None:
    """Undo ``prepare_module``: remove the final norms it registered (those still there)."""
    mapping = model.__dict__.pop(FINALS_ATTR, None) or {}
    model.__dict__.pop(_KEPT_ATTR, None)
    hook = model.__dict__.pop(_HOOK_ATTR, None)
    if hook is not None:
        hook.remove()
    for final in mapping.values():
        parent, _, attr = final.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        if attr in owner._modules:
            delattr(owner, attr)


def _pending_finals_are_optional(model: nn.Module, incompatible) -> None:
    """Before the first call a final norm is registered for every block list; the first call
    removes those of streams it did not convert. So a state_dict saved after that call may lack
    them: loading it into a freshly optimized twin is not missing anything."""
    mapping = getattr(model, FINALS_ATTR, None) or {}
    kept = getattr(model, _KEPT_ATTR, set())
    pending = tuple(f"{fqn}." for fqn in mapping.values() if fqn not in kept)
    if pending:
        incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(pending)]


def drop_unused_finals(model: nn.Module, site_fqns: list[str], used: set, report: FusionReport) -> None:
    """Remove the final norms registered before the first call for block lists this graph holds
    but whose streams it did not convert: a final norm exists only for a converted stream."""
    mapping = getattr(model, FINALS_ATTR, None)
    kept = getattr(model, _KEPT_ATTR, None)
    if mapping is None or kept is None:
        return
    kept |= used
    for lst, final in list(mapping.items()):
        here = any(f and (lst == "" or f.startswith(lst + ".")) for f in site_fqns)
        if final in kept or not here:
            continue
        parent, _, attr = final.rpartition(".")
        delattr(model.get_submodule(parent) if parent else model, attr)
        del mapping[lst]
        report.notes.append(f"Pre-Norm: final norm {final} removed: no stream of {lst or 'the model'} was converted")


def final_norms(model: nn.Module) -> dict[str, nn.Module]:
    """The final norms registered on ``model``: ``{fqn: module}``."""
    mapping = getattr(model, FINALS_ATTR, None) or getattr(getattr(model, "_orig_mod", None), FINALS_ATTR, {})
    owner = getattr(model, "_orig_mod", model)
    return {fqn: owner.get_submodule(fqn) for fqn in mapping.values()}


