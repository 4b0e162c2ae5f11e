"""What the pass found and did: one ``Site`` per norm, gathered in a ``FusionReport``."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["Site", "Region", "FusionReport", "PLACEMENTS", "KINDS", "folded_steps"]

from normfuse.vocabulary import KINDS, PLACEMENTS  # noqa: F401  (re-exported)


@dataclass
class Site:
    """One norm found in a graph, and what the pass did with it. Its ``id`` ("g0.s3": graph 0,
    site 3 in graph order) and its ``call`` ("g0.c1") are derived from ``graph``, ``number``
    and ``call_number``: a report joined into another (``FusionReport.extend``) renumbers graphs only."""

    kind: str                   # "layer_norm" | "rms_norm"
    form: str                   # one of FORMS (normfuse/vocabulary.py)
    placement: str              # one of PLACEMENTS
    input_is_add: bool          # the norm's input is a residual add (seen through casts, views, identity dropout)
    output_feeds_add: bool      # the norm's output goes straight into a residual add
    hidden_size: int | None
    dtype: str | None           # dtype of the norm's input, e.g. "torch.bfloat16"
    eps: float | None
    fqn: str | None = None      # module path, e.g. "layers.0.input_layernorm"
    source: str | None = None   # "file.py:line" of the user's code
    fused: bool = False
    reason: str | None = None   # why not fused (None when fused)
    op: str | None = None       # the fused op that replaced it: one of FUSED_OPS
    fused_add: bool = False     # the residual add was folded into the same kernel
    add_reason: str | None = None  # why the add next to it was not folded (when there is one)
    converted: bool = False     # rewritten from Post-Norm to Pre-Norm
    weight_offset: float = 0.0
    residual_scale: float = 1.0
    sum_dtype: str | None = None
    norm_round_dtype: str | None = None
    out_dtype: str | None = None
    module_type: str | None = None
    residual_dtype: str | None = None  # the site writes (or reads) a residual stream kept in this dtype
    recomputed_linears: int = 0  # linears reading the norm output, which recompute it in backward
    call_number: int | None = None  # the fused call computing it, numbered in its graph; sites computed together share it
    # what the call takes from the add's branch (set on the first site of a shared call only):
    fused_x1: bool = False      # a second branch (``x + attn + mlp``) summed in the kernel
    fused_rowscale: bool = False  # a per-sample scale of the branch (drop_path) applied in the kernel
    fused_dropout: bool = False   # the branch's dropout drawn in the kernel (another random stream)
    norm_group: int | None = None  # statistics per group of this many columns (Mamba2, NemotronH)
    gate: str | None = None       # a gated norm: "silu(z) before the norm" (Mamba2), "sigmoid(z) after" (Kimi)
    fused_gate: bool = False      # ... and the call applies the gate
    gate_reason: str | None = None  # why it does not (when the norm is gated)
    quant: str | None = None      # the graph quantizes the norm's output: "float8_e4m3fn, dynamic per row", ...
    fused_quant: bool = False     # ... and the call computes that quantization (q and its scale) too
    quant_reason: str | None = None  # why it does not (when the graph quantizes and the site is fused)
    rope: str | None = None       # the norm's output goes into a rotary embedding: "neox, rotary 64 of 128"
    fused_rope: bool = False      # ... and the call (qk_norm_rope) computes that RoPE too
    rope_reason: str | None = None  # why it does not
    modulation: str | None = None  # the norm's output is modulated (adaLN): "y * scale + shift in bfloat16"
    fused_modulation: bool = False  # ... and the call computes the modulation
    modulation_reason: str | None = None  # why it does not
    gated_residual: str | None = None  # the add's branch is gated: "x * gate (2, 1, 64)"
    fused_gated_residual: bool = False  # ... and the call reads the branch and the gate
    gated_residual_reason: str | None = None  # why it does not
    graph: int = 0              # the graph run it was found in (nested subgraphs count as graphs)
    number: int = 0             # its place among that graph's sites, in graph order
    # dynamo runs one compiled graph for every module whose forward is the same code (the
    # blocks of a stack under FSDP2 or per-block compile): the id of the site whose run
    # compiled the graph that computes this one (None: this run compiled it)
    reuses: str | None = None

    def __post_init__(self):
        # a symbolic hidden size (dynamic shapes) is reported as the size it had at capture
        if self.hidden_size is not None and not isinstance(self.hidden_size, int):
            hint = getattr(getattr(self.hidden_size, "node", None), "hint", None)
            self.hidden_size = int(hint) if hint is not None else None

    @property
    def id(self) -> str:
        return f"g{self.graph}.s{self.number}"

    @property
    def call(self) -> str | None:
        """The fused call computing it, e.g. "g0.c3" (None: no call does)."""
        return None if self.call_number is None else f"g{self.graph}.c{self.call_number}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, **asdict(self), "call": self.call}

    def __setstate__(self, state: dict) -> None:
        # a Site pickled by 0.1 holds its id and call as strings ("g0.c3"): the call's number is kept
        state = dict(state)
        state.pop("id", None)
        call = state.pop("call", None)
        if call is not None and "call_number" not in state:
            state["call_number"] = int(call.rpartition(".c")[2])
        self.__dict__.update(state)


@dataclass
class Region:
    """A nested subgraph of a higher-order op (activation checkpointing, ``wrap``, ...)."""

    graph: int | None           # the report's graph number of the subgraph (None: not analyzed)
    parent: int                 # the graph that calls it
    name: str | None            # the subgraph's attribute in its parent, e.g. "wrap_body_0"
    op: str | None              # the higher-order op, e.g. "tag_activation_checkpoint"
    analyzed: bool = True
    reason: str | None = None   # why it was not analyzed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FusionReport:
    """Every site the pass saw in every graph of a model, and what it did with each."""

    sites: list[Site] = field(default_factory=list)
    graphs: int = 0
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    # the rewritten graphs themselves (not serialized): the checker and the Pre-Norm
    # structure check read them
    graph_modules: list = field(default_factory=list, repr=False, compare=False)
    # norm modules of the model that no graph the pass saw holds (module paths): they ran
    # eagerly, outside every captured graph (a frame dynamo gave up on), or not at all
    uncaptured: list[str] = field(default_factory=list)

    # --- summaries
    @property
    def fused(self) -> list[Site]:
        return [s for s in self.sites if s.fused]

    @property
    def unfused(self) -> list[Site]:
        return [s for s in self.sites if not s.fused]

    def counts(self) -> dict[str, Any]:
        return {
            "sites": len(self.sites),
            "fused": len(self.fused),
            "fused_with_add": sum(s.fused and s.fused_add for s in self.sites),
            "input_is_add": sum(s.input_is_add for s in self.sites),
            "output_feeds_add": sum(s.output_feeds_add for s in self.sites),
            "by_placement": dict(Counter(s.placement for s in self.sites)),
            "by_kind": dict(Counter(s.kind for s in self.sites)),
            "by_form": dict(Counter(s.form for s in self.sites)),
            "converted": sum(s.converted for s in self.sites),
            # kernels: fused calls (two norms of one value share one); what their branches folded
            "fused_calls": len({s.call or s.id for s in self.fused}),
            "fused_x1": sum(s.fused_x1 for s in self.fused),
            "fused_rowscale": sum(s.fused_rowscale for s in self.fused),
            "fused_dropout": sum(s.fused_dropout for s in self.fused),
            # norms whose output the graph quantizes to fp8, and those whose call computes it
            "quantized": sum(s.quant is not None for s in self.sites),
            "fused_quant": sum(s.fused_quant for s in self.fused),
            "gated": sum(s.gate is not None for s in self.sites),
            "fused_gate": sum(s.fused_gate for s in self.fused),
            "rope": sum(s.rope is not None for s in self.sites),
            "fused_rope": sum(s.fused_rope for s in self.fused),
            "modulated": sum(s.modulation is not None for s in self.sites),
            "fused_modulation": sum(s.fused_modulation for s in self.fused),
            "gated_residual": sum(s.gated_residual is not None for s in self.sites),
            "fused_gated_residual": sum(s.fused_gated_residual for s in self.fused),
            "not_captured": len(self.uncaptured),
        }

    def call_members(self, site: Site) -> list[Site]:
        """The sites computed by the same fused call as ``site`` (itself included)."""
        return [s for s in self.sites if s is site or (site.call is not None and s.call == site.call)]

    def extend(self, other: "FusionReport") -> None:
        offset = self.graphs
        for site in other.sites:
            site.graph += offset
            self.sites.append(site)
        for region in other.regions:
            region.parent += offset
            if region.graph is not None:
                region.graph += offset
            self.regions.append(region)
        self.graphs += other.graphs
        self.warnings += other.warnings
        self.notes += other.notes
        self.graph_modules += other.graph_modules
        self.uncaptured += [fqn for fqn in other.uncaptured if fqn not in self.uncaptured]

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [s.to_dict() for s in self.sites], "summary": self.counts(),
                "graphs": self.graphs, "regions": [r.to_dict() for r in self.regions],
                "warnings": list(self.warnings), "notes": list(self.notes), "uncaptured": list(self.uncaptured)}

    @property
    def regions_not_analyzed(self) -> list[Region]:
        return [r for r in self.regions if not r.analyzed]

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def to_markdown(self) -> str:
        cols = ("id", "fqn", "kind", "form", "placement", "input_is_add", "output_feeds_add",
                "hidden_size", "dtype", "eps", "fused", "reason", "source")
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for s in self.sites:
            row = []
            for c in cols:
                v = getattr(s, c)
                row.append("" if v is None else str(v).replace("|", "\\|"))
            lines.append("| " + " | ".join(row) + " |")
        c = self.counts()
        lines.append("")
        lines.append(f"{c['fused']} of {c['sites']} sites fused ({c['fused_with_add']} with their residual add); "
                     f"placements: {c['by_placement']}; kinds: {c['by_kind']}")
        return "\n".join(lines)

    @property
    def compiled_graphs(self) -> int:
        """Distinct graphs behind the graph runs (one graph may run for several modules)."""
        return len({id(gm) for gm in self.graph_modules if gm is not None}) if self.graph_modules else self.graphs

    def __str__(self) -> str:
        c = self.counts()
        compiled = self.compiled_graphs
        runs = f"{self.graphs} graph(s)" if compiled == self.graphs else \
            f"{self.graphs} graph runs ({compiled} graphs compiled, each run for its own module)"
        head = (f"FusionReport: {c['sites']} norm sites in {runs}, {c['fused']} fused "
                f"({c['fused_with_add']} with their residual add)")
        rows = [head]
        for s in self.sites:
            what = f"fused as {s.op}{folded_steps(s)}" if s.fused else f"left: {s.reason}"
            others = [m.id for m in self.call_members(s) if m is not s] if s.fused else []
            if others:
                what += f" (one kernel with {', '.join(others)})"
            if s.reuses:
                what += f" (graph of {s.reuses})"
            rows.append(f"  {s.id:8s} {s.placement:10s} {s.kind:10s} {s.form:22s} {s.fqn or '?':40s} {what}")
        for r in self.regions_not_analyzed:
            rows.append(f"  not analyzed: {r.name} of graph {r.parent} ({r.op}): {r.reason}")
        if self.uncaptured:
            rows.append(f"  not captured: {', '.join(self.uncaptured)}: no graph normfuse saw holds these norm "
                        "modules; they ran eagerly (a frame dynamo skipped or that ran outside the compiled "
                        "modules), or not at all")
        for note in self.notes:
            rows.append(f"  note: {note}")
        for w in self.warnings:
            rows.append(f"  warning: {w}")
        return "\n".join(rows)


def folded_steps(site: Site) -> str:
    """What the site's kernel took over besides the norm and its add, e.g. " + x1 + dropout":
    the add's branch, and the fp8 quantization of its output (or why not)."""
    steps = [name for name, on in (("x1", site.fused_x1), ("drop_path", site.fused_rowscale),
                                   ("dropout", site.fused_dropout), ("gate", site.fused_gate),
                                   ("fp8 quant", site.fused_quant), ("rope", site.fused_rope),
                                   ("gated branch", site.fused_gated_residual),
                                   ("modulation", site.fused_modulation)) if on]
    text = "".join(f" + {step}" for step in steps)
    if site.quant is not None and not site.fused_quant and site.fused:
        text += f" (fp8 quantization left: {site.quant_reason})"
    return text


SITE_FIELDS = tuple(f.name for f in fields(Site))
