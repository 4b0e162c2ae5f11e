"""Errors raised when a user asks for something normfuse cannot do.

Every message names the problem and the fix. Failures *inside* the pass never
raise into the user's forward: they fall back to the untouched graph instead.
"""

from __future__ import annotations

import difflib

__all__ = [
    "NormfuseError",
    "UnsupportedDtypeError",
    "ShapeMismatchError",
    "InvalidOptionError",
    "InvalidModelError",
    "TargetError",
]


class NormfuseError(Exception):
    """Base class of every error normfuse raises on purpose."""


class UnsupportedDtypeError(NormfuseError, TypeError):
    """A tensor's dtype is not one the fused ops take."""


class ShapeMismatchError(NormfuseError, ValueError):
    """Tensors passed together do not have matching shapes."""


class InvalidOptionError(NormfuseError, ValueError):
    """An option that does not exist, or a value it cannot take."""


class InvalidModelError(NormfuseError, TypeError):
    """Something that is not a model was passed where a model is needed."""


class TargetError(NormfuseError, ValueError):
    """An audit/check target (hf:<type>, file.py:factory, module:factory) that cannot be loaded."""


def closest(name: str, choices) -> str:
    """' Did you mean X?' for a misspelt name, or '' when nothing is close."""
    match = difflib.get_close_matches(name, list(choices), n=1)
    return f" Did you mean {match[0]!r}?" if match else ""
