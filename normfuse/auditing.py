"""Audit a model: where its norms sit, which would fuse and why not, and what fusing is worth.

    rep = normfuse.audit(model, input_ids)          # the model is not changed
    print(rep); rep.to_html(); rep.to_json()

    $ normfuse audit hf:llama --layers 2 --format markdown
    $ normfuse audit my_models.py:build --graph stream.svg --format html --out report.html

The model is prepared as ``optimize`` prepares it (then put back), its graphs are captured
with dynamo and a recording backend (no rewrite), and the pass runs in analysis mode: the
same analysis and plans as ``optimize``, not applied. Each site is priced from its plan by
``normfuse/cost.py`` (HBM bytes and kernels, eager against fused; docs/audit.md states the
arithmetic). ``hf:`` targets are built on the meta device, so a 70B-shaped model takes no
memory: only shapes and dtypes flow. The command line is in ``normfuse/cli.py``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.capture import capture_once
from normfuse.cost import Traffic, numel, site_bytes
from normfuse.errors import InvalidModelError, InvalidOptionError, NormfuseError, closest
from normfuse.passes.analysis import Analysis
from normfuse.passes.planning import Planning
from normfuse.preparation import prepare
from normfuse.reporting import FusionReport, Site, folded_steps
from normfuse.runs import GraphRecord, find_anchor, model_report, tracked
from normfuse.vocabulary import POST_FAMILY, PRE_FAMILY

__all__ = ["audit", "AuditReport", "SiteAudit", "BANDWIDTHS", "DEFAULT_BANDWIDTH", "parse_bandwidth", "verdict"]

# Peak HBM bandwidth of current accelerators, bytes/s (vendor data sheets).
BANDWIDTHS = {
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
    "B200": 8.0e12,
    "A100 80GB SXM": 2.039e12,
    "L40S": 0.864e12,
    "MI300X": 5.3e12,
}
DEFAULT_BANDWIDTH = "H100 SXM"



def parse_bandwidth(value: Any = None) -> tuple[str, float]:
    """(label, bytes/s) from None (the default GPU), a GPU name in BANDWIDTHS, a number of
    TB/s, or a string such as ``"3.35TB/s"``, ``"900 GB/s"``."""
    if value is None:
        value = DEFAULT_BANDWIDTH
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidOptionError(f"bandwidth must be positive, got {value}.")
        return f"{value:g} TB/s", float(value) * 1e12
    text = str(value).strip()
    for name, bw in BANDWIDTHS.items():
        if text.lower() == name.lower():
            return f"{name} {bw / 1e12:g} TB/s", bw
    low = text.lower().replace(" ", "").removesuffix("/s")
    for unit, scale in (("tb", 1e12), ("gb", 1e9), ("", 1e12)):
        if low.endswith(unit):
            try:
                number = float(low[:len(low) - len(unit)] if unit else low)
            except ValueError:
                continue
            if number > 0:
                return f"{number:g} {unit.upper() or 'TB'}/s", number * scale
    raise InvalidOptionError(
        f"cannot read bandwidth {value!r}.{closest(text, BANDWIDTHS)} Give a number of TB/s (3.35), a string "
        f"such as '900GB/s', or one of: {', '.join(BANDWIDTHS)}.")


# --------------------------------------------------------------------------- the report

@dataclass
class SiteAudit:
    """One site: what the pass says about it, and its HBM traffic before and after fusion."""

    site: Site
    would_fuse: bool
    status: str                     # "would fuse as add_norm" or the reason it would not
    eager: Traffic
    fused: Traffic
    block: int | None = None        # index of the block (layer) the site sits in, when the path says
    rows: int = 0                   # rows the norm normalizes per forward (batch x seq for a text model)

    def to_dict(self) -> dict[str, Any]:
        d = self.site.to_dict()
        d.update(would_fuse=self.would_fuse, status=self.status, block=self.block, rows=self.rows,
                 bytes_eager=self.eager.to_dict(), bytes_fused=self.fused.to_dict())
        return d


def verdict(placements) -> tuple[str, str]:
    """(model verdict, conversion note) from the placements of its sites."""
    ps = set(placements)
    pre, post = ps & set(PRE_FAMILY), ps & set(POST_FAMILY)
    if pre and post:
        return "mixed", (f"not convertible as a whole: Pre-Norm ({', '.join(sorted(pre))}) and Post-Norm "
                         f"({', '.join(sorted(post))}) blocks; prenorm=True converts only the Post-Norm ones")
    if post:
        return "Post-Norm", ("convertible to Pre-Norm with normfuse.optimize(model, prenorm=True) "
                             "(changes the function by design; fine-tune after converting)")
    if pre:
        return "Pre-Norm", "already Pre-Norm: nothing to convert"
    return "no residual norms", "no norm sits on a residual stream"


@dataclass
class AuditReport:
    """Everything ``normfuse.audit`` found: one ``SiteAudit`` per norm, and the totals."""

    sites: list[SiteAudit] = field(default_factory=list)
    model: str = ""
    batch: int | None = None
    seq: int | None = None
    tokens: int | None = None       # rows the norms see per forward (batch x seq for a text model)
    dtype: str | None = None
    bandwidth: str = ""
    bandwidth_bytes_per_s: float = 0.0
    graphs: int = 0
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    regions: list = field(default_factory=list)   # nested subgraphs (normfuse.reporting.Region)
    capture: str = ""               # how the graphs were captured: one of CAPTURE_PATHS
    notes: list[str] = field(default_factory=list)  # streams regrouped across blocks, as optimize would

    # --- totals
    def totals(self) -> dict[str, Any]:
        e = Traffic()
        f = Traffic()
        for s in self.sites:
            e.add(**s.eager.to_dict())
            f.add(**s.fused.to_dict())
        bw = self.bandwidth_bytes_per_s or 1.0
        out = {"eager": e.to_dict(), "fused": f.to_dict()}
        for name, t in (("eager", e), ("fused", f)):
            out[name]["fwd_us"] = t.fwd / bw * 1e6
            out[name]["train_us"] = (t.fwd + t.bwd) / bw * 1e6
        out["saved_fwd_bytes"] = e.fwd - f.fwd
        out["saved_train_bytes"] = (e.fwd + e.bwd) - (f.fwd + f.bwd)
        out["saved_fwd_us"] = out["eager"]["fwd_us"] - out["fused"]["fwd_us"]
        out["saved_train_us"] = out["eager"]["train_us"] - out["fused"]["train_us"]
        return out

    def summary(self) -> dict[str, Any]:
        from collections import Counter
        placements = [s.site.placement for s in self.sites]
        v, conversion = verdict(placements)
        ops = Counter(s.site.op for s in self.sites if s.would_fuse)
        return {
            "model": self.model, "batch": self.batch, "seq": self.seq, "tokens": self.tokens, "dtype": self.dtype,
            "sites": len(self.sites),
            # the same keys as FusionReport.counts(); here they count what would fuse
            "fused": sum(s.would_fuse for s in self.sites),
            "fused_with_add": sum(s.would_fuse and s.site.op in ("add_norm", "norm_add") for s in self.sites),
            "by_op": dict(ops),
            # fused kernels (two norms of one value share one) and what they take from the branch
            "fused_calls": len({s.site.call or s.site.id for s in self.sites if s.would_fuse}),
            **{key: sum(getattr(s.site, key) for s in self.sites if s.would_fuse)
               for key in ("fused_x1", "fused_rowscale", "fused_dropout")},
            "by_placement": dict(Counter(placements)),
            "by_kind": dict(Counter(s.site.kind for s in self.sites)),
            "by_form": dict(Counter(s.site.form for s in self.sites)),
            "not_fused": dict(Counter(s.status for s in self.sites if not s.would_fuse)),
            "verdict": v, "conversion": conversion,
            "bandwidth": self.bandwidth, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "bytes": self.totals(), "graphs": self.graphs, "seconds": round(self.seconds, 3),
            "capture": self.capture,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [s.to_dict() for s in self.sites], "summary": self.summary(),
                "regions": [r.to_dict() for r in self.regions], "notes": list(self.notes),
                "warnings": list(self.warnings)}

    @property
    def regions_not_analyzed(self) -> list:
        return [r for r in self.regions if not r.analyzed]

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)

    def to_table(self) -> str:
        from normfuse import render
        return render.text_report(self)

    def to_markdown(self) -> str:
        from normfuse import render
        return render.markdown_report(self)

    def to_html(self) -> str:
        from normfuse import render
        return render.html_report(self)

    def to_svg(self) -> str:
        from normfuse import render
        return render.stream_svg(self)

    def render(self, fmt: str = "table") -> str:
        formats = {"table": self.to_table, "json": lambda: self.to_json(indent=2), "markdown": self.to_markdown,
                   "html": self.to_html, "svg": self.to_svg}
        if fmt not in formats:
            raise InvalidOptionError(f"unknown format {fmt!r}.{closest(fmt, formats)} Use one of: {', '.join(formats)}.")
        return formats[fmt]()

    def __str__(self) -> str:
        return self.to_table()


# --------------------------------------------------------------------------- capture and analysis

def _block_of(fqn: str | None) -> int | None:
    """The first integer component of a module path ("layers.3.input_layernorm" -> 3)."""
    for part in (fqn or "").split("."):
        if part.isdigit():
            return int(part)
    return None


def _status(site: Site) -> tuple[bool, str]:
    if site.op is not None and site.reason in (None, "not applied (analysis only)"):
        return True, f"would fuse as {site.op}{folded_steps(site)}"
    return False, site.reason or "not rewritten"


def _audit_graph(analysis: Analysis, planning: Planning, sites: list[Site], residual_dtype: torch.dtype | None = None
                 ) -> list[SiteAudit]:
    """Price each site of one analysed graph: bytes moved eagerly and by the planned call."""
    out = []
    for site_analysis, site in zip(analysis.sites, sites):
        would, status = _status(site)
        plan = planning.plan_of(site.number) if would else None
        if plan is not None and plan.lead != site.number:  # computed by another norm's call
            status += f" (in {sites[plan.lead].id}'s kernel)"
        eager, fused, _ = site_bytes(analysis.index, site_analysis, plan, residual_dtype)
        m = site_analysis.match
        rows = numel(m.input) // m.hidden_size if m.hidden_size else 0
        out.append(SiteAudit(site, would, status, eager, fused, _block_of(site.fqn), rows))
    return out


class _GraphFailure(Exception):
    def __init__(self, messages):
        super().__init__("; ".join(messages))
        self.messages = list(messages)


def _first_cause(error: BaseException) -> str:
    """The innermost error's type and first line (dynamo wraps the user's error in its own)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    # dynamo puts the user's error on an "Explanation: ... got Error('...')" line
    explained = [line.strip() for line in text if line.strip().startswith("Explanation:")]
    if explained:
        return explained[0].removeprefix("Explanation:").strip()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# How audit captured the graphs: one forward under dynamo, and when a meta-device forward
# builds tensors of its own (Falcon indexes with a Python list: a real meta tensor that
# fake-tensor tracing refuses), once more accepting such tensors as constants.
CAPTURE_PATHS = ("dynamo with fake tensors",
                 "dynamo with fake tensors, accepting the tensors the forward builds itself (fallback: the first "
                 "capture refused them)")
_NON_FAKE = "Please convert all Tensors to FakeTensors first"


def _capture_graphs(model: nn.Module, args: tuple, kwargs: dict, allow_constants: bool
                    ) -> list[tuple[fx.GraphModule, GraphRecord]]:
    """Each graph dynamo captures of one forward (``capture_once``, entered as ``torch.compile``
    enters, without grad), with a record noting the modules it runs for."""
    from torch._subclasses.fake_tensor import fake_tensor_tls

    graphs: list[tuple[fx.GraphModule, GraphRecord]] = []

    def record(gm: fx.GraphModule, example_inputs):
        graphs.append((gm, GraphRecord(FusionReport(), anchor=find_anchor(gm))))
        return tracked(gm.forward, graphs[-1][1])

    limits = {"recompile_limit": 64, "accumulated_recompile_limit": 4096}
    before = fake_tensor_tls.allow_non_fake_inputs_override
    try:
        if allow_constants:  # dynamo's own switch for tensors made outside its fake mode
            fake_tensor_tls.allow_non_fake_inputs_override = True
        with torch._dynamo.config.patch(**limits):
            capture_once(model, args, kwargs, record, grad=False, like_optimize=False, dynamic=False)
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = before
    return graphs


def _analyse(model: nn.Module, graphs: list[tuple[fx.GraphModule, GraphRecord]], cfg, rep: "AuditReport") -> None:
    """The pass in analysis mode on each captured graph, then the sites of every run priced,
    each module's under its own path (one graph may run for several modules)."""
    from normfuse.passes.pipeline import NormFusionPass

    fusion = NormFusionPass(cfg, apply=False)
    priced: dict[tuple[int, int, int], SiteAudit] = {}  # (record, graph in it, site number) -> its audit
    for gm, record in graphs:
        result = fusion(gm)
        record.report = result.report
        for number, analysed in enumerate(result.analyses):
            if analysed is None:  # the pass failed on this graph: its warning says why
                continue
            sites = [s for s in result.report.sites if s.graph == number]
            for audited in _audit_graph(*analysed, sites, cfg.residual_dtype):
                priced[id(record), number, audited.site.number] = audited
    runs: list = []
    assembled = model_report([record for _, record in graphs], model, run_of=runs)
    for site in assembled.sites:
        record, number = runs[site.graph]
        audited = priced.get((id(record), number, site.number))
        if audited is not None:
            rep.sites.append(dataclasses.replace(audited, site=site, block=_block_of(site.fqn)))
    rep.regions, rep.graphs = assembled.regions, assembled.graphs
    rep.warnings += assembled.warnings


def _caused_by(error: BaseException, text: str) -> bool:
    while error is not None:
        if text in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def audit(model: nn.Module, *args: Any, config=None, bandwidth: Any = None, name: str | None = None,
          **kwargs: Any) -> AuditReport:
    """Audit ``model`` called as ``model(*args, **kwargs)``; the model is not changed.

    One forward runs under dynamo with a recording backend, on whatever device the model and
    inputs are on (meta-device models and inputs cost no memory and no compute). ``config``
    (a FuseConfig) is the one ``optimize`` would use; ``bandwidth`` prices the bytes
    (default: the peak of an H100 SXM, 3.35 TB/s).
    """
    from normfuse.config import make_config

    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"audit takes a torch.nn.Module, got {type(model).__name__}. "
                                "Wrap a function in an nn.Module first.")
    cfg = make_config(config)
    label, bw = parse_bandwidth(bandwidth)
    start = time.perf_counter()
    rep = AuditReport(model=name or type(model).__name__, bandwidth=label, bandwidth_bytes_per_s=bw)
    was_training = model.training
    # audit the graphs optimize would see (its streams regrouped across blocks), then put the
    # model back as it was (the Pre-Norm conversion is not audited)
    preparation = prepare(model, cfg, prenorm=False)
    rep.notes += preparation.notes
    try:
        try:
            rep.capture = CAPTURE_PATHS[0]
            graphs = _capture_graphs(model, args, kwargs, allow_constants=False)
        except Exception as error:  # noqa: BLE001 - retried below, or raised with the cause
            if not _caused_by(error, _NON_FAKE):
                raise
            rep.capture = CAPTURE_PATHS[1]
            rep.warnings.append(f"captured by the fallback path ({rep.capture}): the forward builds a tensor "
                                f"of its own ({_first_cause(error)[:160]}...)")
            graphs = _capture_graphs(model, args, kwargs, allow_constants=True)
    except Exception as error:  # noqa: BLE001 - the user's forward failed: say where
        preparation.undo()
        model.train(was_training)
        raise InvalidModelError(f"running {rep.model} to capture its graph failed: {_first_cause(error)}. "
                                "Check the example inputs (shapes, dtypes, device, sequence length) against "
                                "the model.") from error
    try:
        if not graphs:
            raise NormfuseError(f"dynamo captured no graph of {rep.model}: the forward ran eagerly (dynamo's "
                                "recompile limit may have been reached in this process; call "
                                "torch._dynamo.reset() and audit again).")
        _analyse(model, graphs, cfg, rep)  # before the undo: module paths are read off the prepared model
    finally:
        model.train(was_training)
        preparation.undo()
    first = next((s for s in rep.sites if s.rows), None)
    if first is not None:
        rep.tokens, rep.dtype = first.rows, first.site.dtype
    rep.seconds = time.perf_counter() - start
    return rep
