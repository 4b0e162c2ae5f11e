"""The ``torch.ops.normfuse.*`` operators declared before their implementations are imported.

A program normfuse rewrote names its ops: ``torch.export.save`` writes
``torch.ops.normfuse.add_norm_fwd.default``, an AOTInductor package calls ``normfuse::add_norm_fwd``
through the C++ dispatcher. Loading either needs the op to exist: the export deserializer gives up on
a name that ``torch.ops.normfuse`` lacks, and AOTInductor's loader looks the schema up in C++ when the
package loads ("Could not find schema for normfuse::add_norm_fwd"), where no Python namespace hook is
asked. The implementations live in ``ops.py`` and ``norm_linear.py``, which import Triton (~0.3 s);
``import normfuse`` must not. So each op is declared here with its schema (a ``custom_op`` whose
kernel and fake import the module implementing it on first use, then call the op again), and that
module registers its functions on the same op with ``implement``: one registration, which loaded
programs and the C++ handles keep, whatever was imported first.

``import normfuse`` calls ``declare`` (right after torch's import when normfuse comes first).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from normfuse.kernels.declarations import DECLARATIONS, NAMESPACE, schema

__all__ = ["SCHEMAS", "declare", "implement", "implement_fake", "implement_autograd", "on_call"]

# op -> (its schema text, the module implementing it), made from normfuse/kernels/declarations.py:
# saved programs call the op by that schema, so an op's arguments change there or nowhere.
SCHEMAS: dict[str, tuple[str, str]] = {name: (schema(name), op.module) for name, op in DECLARATIONS.items()}

_DECLARED: dict[str, "torch._library.custom_ops.CustomOpDef"] = {}
_IMPLEMENTED: set[str] = set()
# op -> the function of its call registered as its kernel / its fake (tests/test_declarations.py reads them)
KERNELS: dict[str, Callable] = {}
FAKES: dict[str, Callable] = {}


def _implemented(name: str) -> None:
    """Import the module that implements ``name`` (once); raise when it did not."""
    if name not in _IMPLEMENTED:
        importlib.import_module(SCHEMAS[name][1])
    if name not in _IMPLEMENTED:  # else calling the op again would come back here
        raise RuntimeError(f"importing {SCHEMAS[name][1]} did not implement {NAMESPACE}::{name}; it must register "
                           f"the function with normfuse.kernels.library.implement({name!r}).")


def _on_first_use(name: str) -> tuple[Callable, Callable]:
    """The kernel and fake an op has until its module is imported: import it, then call the op
    again, which now runs what the module registered (its kernel, its fake, its autograd: the
    autograd formula is read after the kernel ran, so the first call is differentiable too)."""
    def kernel(*args, **kwargs):
        _implemented(name)
        return getattr(getattr(torch.ops, NAMESPACE), name).default(*args, **kwargs)

    def fake(*args, **kwargs):
        _implemented(name)
        return getattr(getattr(torch.ops, NAMESPACE), name).default(*args, **kwargs)

    kernel.__name__ = fake.__name__ = name
    return kernel, fake


def declare() -> None:
    """Declare every ``torch.ops.normfuse`` op (idempotent; about 4 ms per op in torch's custom_op, no import
    beyond torch)."""
    for name, (text, _) in SCHEMAS.items():
        if name in _DECLARED:
            continue
        kernel, fake = _on_first_use(name)
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=(), schema=text)
        op.register_fake(fake)
        _DECLARED[name] = op


def implement_fake(name: str) -> Callable:
    """Decorator for the fake of op ``name``: a function of the op's call, as the implementation."""
    def register(fn: Callable) -> Callable:
        _DECLARED[name].register_fake(on_call(name, fn))
        FAKES[name] = fn
        return fn
    return register


def implement_autograd(name: str, backward: Callable, *, setup_context: Callable) -> None:
    """Register op ``name``'s autograd formula; ``setup_context(ctx, call, output)`` takes the op's call."""
    from normfuse.kernels.specs import call_of

    def setup(ctx, inputs, output):
        setup_context(ctx, call_of(name, inputs), output)

    _DECLARED[name].register_autograd(backward, setup_context=setup)


def on_call(name: str, fn: Callable) -> Callable:
    """``fn(call)`` as a function of the op's flat arguments."""
    from normfuse.kernels.specs import call_of

    def on_flat(*args):
        return fn(call_of(name, args))

    on_flat.__name__ = fn.__name__
    return on_flat


def implement(name: str) -> Callable:
    """Decorator for the function that implements op ``name``: a function of the op's call (one
    parameter, annotated with the call type declarations.py names for the op), registered as the
    op's kernel; returns the op (a ``CustomOpDef``). Its fake and autograd formula take the call too:
    register them with ``implement_fake`` and ``implement_autograd``."""
    def register(fn: Callable):
        declare()
        expected = DECLARATIONS[name].call
        parameters = list(inspect.signature(fn).parameters.values())
        annotation = parameters[0].annotation if len(parameters) == 1 else None
        if getattr(annotation, "__name__", annotation) != expected:
            raise TypeError(f"{fn.__module__}.{fn.__name__} does not match the declaration of {NAMESPACE}::{name} in "
                            f"normfuse/kernels/declarations.py: an implementation takes one argument, the op's call "
                            f"({expected}), built from the declared arguments.")
        op = _DECLARED[name]
        op.register_kernel(None)(on_call(name, fn))
        _IMPLEMENTED.add(name)
        KERNELS[name] = fn
        return op

    return register
