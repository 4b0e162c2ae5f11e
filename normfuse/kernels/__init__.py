"""Fused kernels and their custom ops (``torch.ops.normfuse.*``).

    reference.py   the semantics in plain PyTorch (the reference backend)
    triton.py      the Triton kernels and launchers (the Triton backend)
    library.py     the ops' schemas, declared at ``import normfuse`` (saved programs load)
    ops.py         the custom ops, their fakes and autograd, and which path a call runs
    specs.py       the names of the ops' outputs and arguments; add_norm's option groups
    add_norm.py    the functional API (add_norm, norm_add, add_rms_norm, ...)
    norm_linear.py norm_linears: linears on a norm output that is recomputed in backward
    qk_rope.py     qk_norm_rope: per-head RMSNorm of q and k, then RoPE (its semantics, reference and ops)

The functional API is re-exported lazily, so importing this package neither
imports triton nor registers the ops' implementations until a name is used.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    **{name: "normfuse.kernels.add_norm"
       for name in ("add_norm", "fused_add_norm", "add_rms_norm", "add_layer_norm", "norm_add", "rms_norm_add",
                    "layer_norm_add")},
    **{name: "normfuse.kernels.specs" for name in ("Gate", "Fp8Quant", "Dropout", "Modulation")},
    **{name: "normfuse.kernels.reference" for name in ("add_norm_ref", "norm_add_ref", "add_norm_bwd_ref")},
    "dropout_keep_mask": "normfuse.kernels.ops",
    **{name: "normfuse.kernels.qk_rope" for name in ("qk_norm_rope", "qk_norm_rope_ref")},
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'normfuse.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__():
    return sorted(__all__)
