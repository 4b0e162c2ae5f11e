"""normfuse: fuse residual-add -> LayerNorm/RMSNorm subgraphs of PyTorch models.

    model = normfuse.optimize(model)                 # in place; state_dict keys unchanged
    torch.compile(model, backend="normfuse")         # or as a dynamo backend
    y, s = normfuse.add_rms_norm(x, residual, w)     # or the fused ops directly

The import is lean: no CUDA query, no Triton import, no graph machinery until a
name below is first used.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    # fused ops (normfuse/kernels)
    "add_norm": "normfuse.kernels.add_norm",
    "add_rms_norm": "normfuse.kernels.add_norm",
    "add_layer_norm": "normfuse.kernels.add_norm",
    "norm_add": "normfuse.kernels.add_norm",
    "rms_norm_add": "normfuse.kernels.add_norm",
    "layer_norm_add": "normfuse.kernels.add_norm",
    # model rewriting (normfuse/api.py)
    "optimize": "normfuse.api",
    "fuse_graph": "normfuse.api",
    "NormFusionPass": "normfuse.passes.pipeline",
    "PassResult": "normfuse.passes.pipeline",
    "report": "normfuse.api",
    "prepare": "normfuse.preparation",
    "FuseConfig": "normfuse.config",
    "FusionReport": "normfuse.reporting",
    "Site": "normfuse.reporting",
    # checking and auditing
    "check": "normfuse.verify.check",
    "CheckResult": "normfuse.verify.check",
    "audit": "normfuse.auditing",
    "AuditReport": "normfuse.auditing",
    # errors
    "NormfuseError": "normfuse.errors",
    "UnsupportedDtypeError": "normfuse.errors",
    "ShapeMismatchError": "normfuse.errors",
    "InvalidOptionError": "normfuse.errors",
    "InvalidModelError": "normfuse.errors",
    "TargetError": "normfuse.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'normfuse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
