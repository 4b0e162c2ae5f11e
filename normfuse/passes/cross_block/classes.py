"""The swapped classes of a rewritten stream's modules, and how a saved model gets them back.

The rewrite gives a module a new class; the module keeps its parameters, buffers, hooks
and ``state_dict`` keys. The new class subclasses the old one with the ``_StreamElement``
mixin first (the list elements) and/or an edited copy of ``forward`` (a block's "pair"
forward, the final norm's "entry_add" forward; normfuse/passes/cross_block/source.py),
one class per (class, mixins, forward kind), so the blocks of a list keep sharing one class.

A swapped class exists only in memory. Its qualified name encodes how to build it again,
and this module's ``__getattr__`` rebuilds it from that name, which is how a pickled model
finds its classes. Models pickled by normfuse 0.1.0 name them under
normfuse.passes.boundary, which rebuilds them the same way.
"""

from __future__ import annotations

import importlib
import json

import torch.nn as nn

from normfuse.passes.cross_block.runtime import _StreamElement
from normfuse.passes.cross_block.source import _new_forward

_SWAPPED: dict[tuple, type] = {}
_MIXINS = {"_StreamElement": _StreamElement}  # by the names a swapped class's name lists
_SWAPPED_PREFIX = "_nf_swapped_"


def _swapped_class(base: type, mixins: tuple, forward: str) -> type:
    """The subclass of ``base`` with ``mixins`` first and the ``forward`` kind ("pair",
    "entry_add", "" for its own).
    One per (class, mixins, forward): the blocks of a list keep sharing one class. Its
    qualified name encodes how to build it again, so a pickled model loads (see __getattr__)."""
    key = (base, mixins, forward)
    if key not in _SWAPPED:
        spec = json.dumps([base.__module__, base.__qualname__, [m.__name__ for m in mixins], forward])
        attrs = {"__module__": __name__, "__qualname__": _SWAPPED_PREFIX + spec.encode().hex(),
                 "_normfuse_base": base, "_normfuse_mixins": mixins, "_normfuse_forward": forward}
        if forward:  # a class attribute, so module paths in graphs read "blocks.0.norm1"
            attrs["forward"] = _new_forward(base, forward)
        _SWAPPED[key] = type(base.__name__, (*mixins, base), attrs)
    return _SWAPPED[key]


def __getattr__(name: str):
    # unpickling a rewritten model looks its block classes up here
    if not name.startswith(_SWAPPED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _rebuilt_class(name)


def _rebuilt_class(name: str) -> type:
    """The swapped class a ``_nf_swapped_<hex>`` name encodes."""
    module, qualname, mixins, forward = json.loads(bytes.fromhex(name[len(_SWAPPED_PREFIX):]))
    base = importlib.import_module(module)
    for part in qualname.split("."):
        base = getattr(base, part)
    return _swapped_class(base, tuple(_MIXINS[m] for m in mixins), forward)


def _swap_class(module: nn.Module, mixin: type | None = None, forward: str = "") -> None:
    """Give ``module`` its swapped class, adding ``mixin`` and/or a forward kind."""
    cls = type(module)
    base = cls.__dict__.get("_normfuse_base", cls)
    mixins = tuple(m for m in (*cls.__dict__.get("_normfuse_mixins", ()), mixin) if m is not None)
    module.__class__ = _swapped_class(base, mixins, forward or cls.__dict__.get("_normfuse_forward", ""))


def _unswap_class(module: nn.Module) -> None:
    base = type(module).__dict__.get("_normfuse_base")
    if base is not None:
        module.__class__ = base


def _base_class(module: nn.Module) -> type:
    return type(module).__dict__.get("_normfuse_base", type(module))
