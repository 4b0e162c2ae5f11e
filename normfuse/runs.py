"""Which rewritten graph ran for which module: what a model's report is built from.

Dynamo compiles a frame once per code object and, with a module's parameters as graph
inputs, runs the same graph for every module whose forward is that code: each block of
a stack under FSDP2, under per-block ``torch.compile``, or with a graph break in every
block. One rewritten graph then computes the norms of several modules. So each graph
the pass rewrote is kept as a ``GraphRecord``:

- its report (sites numbered within the graph, module paths relative to the frame's
  ``self``), without graph modules, and weak references to those;
- the placeholder through which a module parameter enters it (``Anchor``);
- the modules it ran for (``GraphRecord.runs``): the parameter seen in that placeholder,
  noted by the callable handed back to dynamo (``tracked``), in the order of first runs.

``model_report(records, model)`` builds a model's report from them: one run per (graph,
module), each site's module path made whole ("layers.2.attention_norm"), graph numbers
counting runs. Nothing here keeps a graph module alive: dynamo's compiled code does, and
a record lives as long as that code (the tracked callable holds it).
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.reporting import FusionReport

__all__ = ["Anchor", "GraphRecord", "RunLog", "tracked", "find_anchor", "parameter_paths", "model_report",
           "WRAPPER_ATTRS", "without_wrappers", "belongs_to", "norm_module_paths"]

# Module attributes that wrap a module without being part of its path in the model's code
# (torch.compile's OptimizedModule, checkpoint_wrapper, FSDP1): dropped from reported paths,
# as state_dict hooks drop them from parameter names.
WRAPPER_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")

_ORDER = itertools.count()  # first runs, across every graph of the process


def without_wrappers(path: str) -> str:
    return ".".join(part for part in path.split(".") if part not in WRAPPER_ATTRS)


# --------------------------------------------------------------------------- where a module enters

@dataclass(frozen=True)
class Anchor:
    """The placeholder through which a module parameter (or buffer) enters a graph: its
    position among the placeholders and its path under the frame's root object
    (``L['self']._modules['attention_norm']._parameters['weight']`` -> "attention_norm.weight")."""

    position: int
    path: str


# attributes a path into a module passes through that name no module
_CONTAINER_ATTRS = ("__dict__", "_modules")


def _source_path(source: Any) -> tuple[str, bool] | None:
    """(path under the source's root module, whether it is a parameter or buffer) of a dynamo source.

    The root module is the first module on the way from the frame's local or global: the local
    itself (``L['self']``), or a module the frame reached inside an argument, as in a compiled
    bound method whose decorator takes ``(*args, **kwargs)`` (``L['args'][0]``, HF's forwards);
    dynamo names the modules of the graph relative to it too."""
    from torch._dynamo import source as sources

    parts: list[str] = []
    in_root_module: int | None = None  # how many parts lie under the outermost module seen so far
    param = False
    while source is not None:
        if isinstance(source, sources.NNModuleSource):
            in_root_module = len(parts)
        if isinstance(source, sources.UnspecializedParamBufferSource):
            param = True
        if isinstance(source, (sources.AttrSource, sources.DictGetItemSource, sources.GetItemSource)):
            part = source.member if isinstance(source, sources.AttrSource) else source.index
            if not isinstance(part, (str, int)):
                return None
            if part in ("_parameters", "_buffers"):
                param = True
            elif part not in _CONTAINER_ATTRS:
                parts.append(str(part))
        elif isinstance(source, (sources.LocalSource, sources.GlobalSource)):
            if in_root_module is not None:
                parts = parts[:in_root_module]
            return ".".join(reversed(parts)), param
        elif not isinstance(source, sources.ChainedSource):
            return None
        source = getattr(source, "base", None)
    return None


def find_anchor(gm: fx.GraphModule) -> Anchor | None:
    """The first placeholder of ``gm`` that holds a module parameter or buffer (None when no
    module parameter enters the graph as an input)."""
    position = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        source = getattr(node, "_dynamo_source", None)
        found = _source_path(source) if source is not None else None
        if found is not None and found[1] and found[0]:
            return Anchor(position, found[0])
        position += 1
    return None


# --------------------------------------------------------------------------- the records

@dataclass(eq=False)
class Run:
    """One module a graph ran for: the parameter seen in the anchor placeholder."""

    param: weakref.ref | None
    order: int


@dataclass(eq=False)
class GraphRecord:
    """One graph the pass rewrote (with its nested regions) and the modules it ran for."""

    report: FusionReport                        # numbered within the graph; holds no graph module
    graph_modules: list[weakref.ref] = field(default_factory=list)
    anchor: Anchor | None = None
    runs: list[Run] = field(default_factory=list)
    _by_id: dict[int, Run] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, report: FusionReport, anchor: Anchor | None) -> "GraphRecord":
        graphs = [weakref.ref(gm) for gm in report.graph_modules]
        kept = copy.copy(report)
        kept.graph_modules = []
        return cls(kept, graphs, anchor)

    def note(self, param: Any) -> None:
        """A call of the graph with ``param`` in the anchor placeholder."""
        run = self._by_id.get(id(param))
        if run is not None and run.param() is param:
            return
        live = [r for r in self.runs if r.param is None or r.param() is not None]  # modules freed since
        if len(live) != len(self.runs):
            self.runs = live
            self._by_id = {id(r.param()): r for r in live if r.param is not None}
        run = Run(weakref.ref(param) if isinstance(param, torch.Tensor) else None, next(_ORDER))
        self.runs.append(run)
        if run.param is not None:
            self._by_id[id(param)] = run

    def note_unanchored(self) -> None:
        if not self.runs:
            self.runs.append(Run(None, next(_ORDER)))


def tracked(compiled: Callable, record: GraphRecord) -> Callable:
    """``compiled`` (what a backend hands dynamo, which calls it with the graph's inputs as
    positional arguments), noting in ``record`` each module it runs for."""
    anchor = record.anchor
    if anchor is None:
        def run(*args):
            record.note_unanchored()
            return compiled(*args)
    else:
        position = anchor.position

        def run(*args):
            record.note(args[position])
            return compiled(*args)
    run.normfuse_record = record  # type: ignore[attr-defined]  # the record lives as long as this code
    return run


@dataclass(eq=False)
class RunLog:
    """What the pass did for one optimized model: the graphs it rewrote, and what was said
    outside any graph (streams regrouped across blocks, an eager fallback).

    A copied or unpickled model captures its graphs afresh: its log starts without records."""

    records: list[GraphRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, record: GraphRecord) -> None:
        self.records.append(record)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def __reduce__(self):
        return (RunLog, ([], list(self.notes)))


# --------------------------------------------------------------------------- a model's report

def parameter_paths(model: nn.Module) -> dict[int, list[str]]:
    """id of each parameter and buffer a graph of ``model`` may read -> its paths in the model.

    Besides the registered tensors: FSDP2's unsharded parameters, which it registers on
    the modules only while they run (after a forward with ``reshard_after_forward`` the
    module holds the sharded ones again)."""
    paths: dict[int, list[str]] = defaultdict(list)
    module_paths: dict[int, str] = {}
    modules = list(model.named_modules(remove_duplicate=False))
    for prefix, module in modules:
        module_paths.setdefault(id(module), prefix)
        for name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is not None:
                paths[id(tensor)].append(f"{prefix}.{name}" if prefix else name)
    for _, module in modules:
        get_state = getattr(type(module), "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(module), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = fsdp_param.__dict__.get("_unsharded_param")
            info = getattr(fsdp_param, "_module_info", None)
            owner = module_paths.get(id(getattr(info, "module", None)))
            if unsharded is None or owner is None:
                continue
            path = f"{owner}.{info.param_name}" if owner else info.param_name
            if path not in paths[id(unsharded)]:
                paths[id(unsharded)].append(path)
    return paths


def _prefix(record: GraphRecord, run: Run, paths: dict[int, list[str]] | None) -> str | None:
    """The module path of the frame's root object in this run ("layers.2."), "" for the model
    itself; None when the run's parameter is not one of the model's."""
    if record.anchor is None or run.param is None:
        return ""
    param = run.param()
    if param is None or paths is None:
        return None
    for path in paths.get(id(param), ()):
        if path == record.anchor.path:
            return ""
        if path.endswith("." + record.anchor.path):
            return without_wrappers(path[:-len(record.anchor.path)])
    return None


def belongs_to(record: GraphRecord, paths: dict[int, list[str]]) -> bool:
    """Whether some run of ``record`` ran on the parameters of the model ``paths`` describes."""
    return any(record.anchor is not None and _prefix(record, run, paths) is not None for run in record.runs)


def _canonical_path(model: nn.Module, names: dict[int, str], prefix: str, fqn: str) -> str:
    """The module path ``prefix + fqn`` names in ``model``, as ``named_modules`` gives it.

    Dynamo records the path through which the traced code first reached a module, which
    may be an alias (the cross-block stream reaches the next block through its own
    table: "layers.0._normfuse_stream_element.receivers.0.input_layernorm")."""
    obj: Any = model
    for part in (prefix + fqn).split("."):
        if isinstance(obj, dict):
            obj = obj.get(part)
        elif isinstance(obj, (list, tuple)) and part.isdigit():
            obj = obj[int(part)] if int(part) < len(obj) else None
        else:
            obj = getattr(obj, part, None)
        if obj is None:
            return prefix + fqn
    return names.get(id(obj), prefix + fqn)


def model_report(records: Iterable[GraphRecord], model: nn.Module | None = None,
                 paths: dict[int, list[str]] | None = None, notes: Iterable[str] = (), warnings: Iterable[str] = (),
                 only_model: bool = False, run_of: list | None = None) -> FusionReport:
    """One report of every run of ``records`` in the order the runs started: per run a copy
    of its graph's sites with whole module paths (``model``'s, when the model is known;
    ``paths``: its ``parameter_paths``, when already at hand), and the graph modules.
    ``only_model``: leave out runs on parameters that are not the model's (the process-wide
    records of the registered backends); else such a run keeps the paths relative to its frame.
    ``run_of``: a list to which (record, graph number within the record) is appended for each
    graph number of the report."""
    if model is not None and paths is None:
        paths = parameter_paths(model)
    names = {id(module): name for name, module in model.named_modules()} if model is not None else {}
    runs: list[tuple[int, GraphRecord, int, str]] = []
    for position, record in enumerate(records):
        if not record.runs:  # compiled, not run yet: once, as captured
            if not only_model:
                runs.append((1 << 62, record, 0, ""))
            continue
        for k, run in enumerate(record.runs):
            prefix = _prefix(record, run, paths)
            if prefix is None and only_model:
                continue
            runs.append((run.order, record, k, prefix or ""))
    runs.sort(key=lambda entry: entry[0])
    out = FusionReport(notes=list(notes), warnings=list(warnings))
    first_ids: dict[tuple[int, int, int], str] = {}   # (record, graph, number) -> id of its first run's site
    for _, record, k, prefix in runs:
        part = FusionReport(sites=[copy.copy(s) for s in record.report.sites], graphs=record.report.graphs,
                            warnings=list(record.report.warnings) if k == 0 else [],
                            notes=list(record.report.notes) if k == 0 else [],
                            regions=[copy.copy(r) for r in record.report.regions],
                            graph_modules=[ref() for ref in record.graph_modules])
        local = [(s.graph, s.number) for s in part.sites]
        for site in part.sites:
            if site.fqn and model is not None:
                site.fqn = _canonical_path(model, names, prefix, site.fqn)
            elif site.fqn:
                site.fqn = prefix + site.fqn
            else:  # a site with no module path of its own is computed by the frame's module itself
                site.fqn = prefix.rstrip(".") or None
            site.fqn = without_wrappers(site.fqn) if site.fqn else None
        out.extend(part)
        if run_of is not None:
            run_of += [(record, g) for g in range(record.report.graphs)]
        for (graph, number), site in zip(local, part.sites):
            key = (id(record), graph, number)
            if key in first_ids:
                site.reuses = first_ids[key]
            else:
                first_ids[key] = site.id
    return out


def norm_module_paths(model: nn.Module) -> list[str]:
    """The module paths of ``model``'s norm modules, as the report names them (wrappers dropped)."""
    from normfuse.passes.blocks import is_norm_module

    return list(dict.fromkeys(without_wrappers(path) for path, module in model.named_modules()
                              if path and is_norm_module(module)))
