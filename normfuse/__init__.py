"""normfuse: fuse residual-add -> LayerNorm/RMSNorm subgraphs of PyTorch models.

    model = normfuse.optimize(model)                 # in place; state_dict keys unchanged
    torch.compile(model, backend="normfuse")         # or as a dynamo backend
    y, s = normfuse.add_rms_norm(x, residual, w)     # or the fused ops directly

The import is lean: no CUDA query, no Triton import, no graph machinery until a
name below is first used. It declares the ``torch.ops.normfuse`` operators (their
schemas; the implementations load on first use), so that a program normfuse rewrote and
``torch.export.save`` or AOTInductor packaged loads and runs in a process that only
imported normfuse: at once when torch is imported, else right after torch's import.
"""

from __future__ import annotations

import importlib
import sys

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
    "Gate": "normfuse.kernels.specs",
    "Fp8Quant": "normfuse.kernels.specs",
    "Dropout": "normfuse.kernels.specs",
    "Modulation": "normfuse.kernels.specs",
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


# --------------------------------------------------------------------------------------
# The operators' declarations (normfuse/kernels/library.py), which need torch
# --------------------------------------------------------------------------------------

def _declare_ops() -> None:
    try:
        from normfuse.kernels import library
        library.declare()
    except Exception as error:  # noqa: BLE001 - `import normfuse` (and torch's import) must not fail on it
        import warnings
        warnings.warn(f"normfuse could not declare its torch.ops.normfuse operators ({type(error).__name__}: "
                      f"{error}); the fused ops and programs saved with them will not load in this process.",
                      RuntimeWarning, stacklevel=3)


class _AfterTorchLoader:
    """torch's own loader, then the declarations (once torch is whole)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader  # torch keeps its own loader
        _declare_ops()


class _AfterTorchImport:
    """A one-shot import hook for when normfuse is imported before torch: it leaves finding and
    loading torch to the other finders and adds the declarations after torch's import
    (importing torch here would cost every ``import normfuse`` about 1.5 s)."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        from importlib.util import find_spec

        spec = find_spec(name)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _AfterTorchLoader(spec.loader)
        return spec


if "torch" in sys.modules:
    _declare_ops()
elif not any(isinstance(finder, _AfterTorchImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AfterTorchImport())
