"""Where a site came from: its module path and class, its source line, and the report's record of it."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from normfuse.passes.canonical import node_dtype
from normfuse.reporting import Site
from normfuse.vocabulary import CONVERTED_META, COPY_FILE

if TYPE_CHECKING:
    from normfuse.passes.classify import SiteState
    from normfuse.passes.graph import GraphIndex

__all__ = ["module_info", "module_class", "is_norm_module_class", "source_of", "site_record", "NORM_MODULES"]

_FQN_PREFIX = re.compile(r"^L\[[^\]]*\](\[[^\]]*\])*\.?")


def module_info(node: fx.Node) -> tuple[str | None, str | None]:
    """(fqn, class name) of the innermost module a node came from, if the graph recorded it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None, None
    path, cls = list(stack.values())[-1]
    fqn = _FQN_PREFIX.sub("", str(path)).replace("._modules", "").replace(".__dict__", "")
    fqn = re.sub(r"\[(\d+)\]", r".\1", fqn).replace("['", ".").replace("']", "").strip(".")
    fqn = ".".join(part for part in fqn.split(".") if part not in ("__dict__", "_modules"))
    name = getattr(cls, "__name__", None) or str(cls).rsplit(".", 1)[-1].rstrip("'>")
    return fqn or None, name


def module_class(node: fx.Node) -> type | None:
    """The class of the innermost module a node came from (call_module: that module)."""
    if node.op == "call_module" and node.graph.owning_module is not None:
        return type(node.graph.owning_module.get_submodule(node.target))
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    cls = list(stack.values())[-1][1]
    return cls if isinstance(cls, type) else None


NORM_MODULES = (torch.nn.LayerNorm, *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()))


def is_norm_module_class(cls: type | None) -> bool:
    return isinstance(cls, type) and issubclass(cls, NORM_MODULES)


def source_of(node: fx.Node) -> str | None:
    """'file:line' of the innermost frame of the node's stack trace."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not frames:
        return None
    path, line = frames[-1]
    prefix, _, suffix = COPY_FILE.partition("{path}")
    if path.startswith(prefix) and path.endswith(suffix):  # an edited copy of a function (boundary.py)
        path = path[len(prefix):len(path) - len(suffix)]
    return f"{path}:{line}"


def site_record(index: GraphIndex, state: SiteState, number: int) -> Site:
    """The report's record of one site found in a graph (before any rewrite)."""
    m = state.match
    fqn, cls = module_info(m.output) if m.output.meta.get("nn_module_stack") else module_info(m.anchor or m.output)
    # a norm call made by a torch norm module (nn.LayerNorm, nn.RMSNorm) is reported as "module"
    form = "module" if m.form in ("functional", "module") and is_norm_module_class(module_class(
        m.output)) else m.form
    # a norm moved by the Pre-Norm conversion (normfuse/passes/prenorm.py) is a pre-norm,
    # also the first one of a stream, which no add feeds
    converted = bool(m.output.meta.get(CONVERTED_META))
    return Site(
        id=f"g0.s{number}", number=number, kind=m.kind, form=form,
        placement="pre" if converted else state.placement, converted=converted,
        input_is_add=state.input_is_add, output_feeds_add=state.output_feeds_add,
        hidden_size=m.hidden_size, dtype=str(node_dtype(m.input)) if node_dtype(m.input) else None,
        eps=m.eps, fqn=fqn, source=source_of(m.output) or source_of(m.anchor or m.output),
        weight_offset=m.weight_offset,
        residual_scale=state.in_add.residual_scale if state.in_add is not None else 1.0,
        norm_round_dtype=str(m.norm_round_dtype) if m.norm_round_dtype else None,
        out_dtype=str(m.out_dtype) if m.out_dtype else None, module_type=cls)
