"""What ``normfuse.check`` found: ``SiteCheck`` per rewritten site, ``CheckResult`` for the model.

``print(result)`` gives the tables; ``result.to_dict()`` / ``to_json()`` the data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from normfuse.reporting import FusionReport
from normfuse.verify.numeric import OutputCheck, SiteNumeric
from normfuse.verify.symbolic import SymbolicResult

__all__ = ["SiteCheck", "CheckResult"]


@dataclass
class SiteCheck:
    """One rewritten site: its numeric check against the original subgraph and its proof."""

    id: str
    fqn: str | None
    source: str | None
    op: str | None
    placement: str
    kind: str
    numeric: SiteNumeric
    symbolic: SymbolicResult
    graph: int = 0
    number: int = 0

    @property
    def compared(self) -> bool:
        """Whether the site was compared with its original subgraph (a converted or widened site
        is not, by design: it is neither passed nor failed)."""
        return self.numeric.compared

    @property
    def passed(self) -> bool:
        return self.compared and self.numeric.passed and self.symbolic.status != "refuted"

    @property
    def failed(self) -> bool:
        return (self.compared and not self.numeric.passed) or self.symbolic.status == "refuted"

    @property
    def reason(self) -> str | None:
        if self.passed:
            return None
        if not self.failed:
            return f"not compared: by design ({self.numeric.reason})"
        parts = [] if self.numeric.passed or not self.compared else [self.numeric.reason]
        if self.symbolic.status == "refuted":
            parts.append(f"symbolic: refuted ({self.symbolic.detail})")
        return "; ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "fqn": self.fqn, "source": self.source, "op": self.op, "placement": self.placement,
                "kind": self.kind, "passed": self.passed, "failed": self.failed, "compared": self.compared,
                "reason": self.reason, "numeric": self.numeric.to_dict(), "symbolic": self.symbolic.to_dict()}

    def __str__(self) -> str:
        return f"{self.id} {self.fqn or '?'} ({self.source or 'no source line'})"


def _site_result(site: SiteCheck) -> str:
    if site.failed:
        return f"FAIL: {site.reason}"
    if not site.passed:
        return site.reason  # not compared: by design (...)
    # a folded dropout draws another mask than eager's: equal once that mask is replayed
    return "ok (equal given the mask)" if site.numeric.given_mask else "ok"


@dataclass
class CheckResult:
    """What ``normfuse.check`` found; ``print(res)`` gives the tables, ``res.to_dict()`` the data."""

    ok: bool
    outputs: list[OutputCheck] = field(default_factory=list)
    sites: list[SiteCheck] = field(default_factory=list)
    first_divergence: SiteCheck | None = None
    by_design: bool = False             # Post-Norm -> Pre-Norm conversion: the function changes on purpose
    structure_ok: bool | None = None    # the residual stream promise of that conversion
    notes: list[str] = field(default_factory=list)
    # fused sites with no site check, and why (the headline says so whenever there are any)
    unverified: int = 0
    unverified_why: list[str] = field(default_factory=list)
    report: FusionReport | None = field(default=None, repr=False)

    def summary(self) -> dict[str, Any]:
        ratios = [o.ratio for o in self.outputs if o.ratio != float("inf")]
        statuses = [s.symbolic.status for s in self.sites]
        return {
            "ok": self.ok, "outputs": len(self.outputs), "outputs_failed": sum(not o.passed for o in self.outputs),
            "max_error_ratio": max(ratios, default=0.0),
            "sites": len(self.sites), "sites_failed": sum(s.failed for s in self.sites),
            "sites_passed": sum(s.passed for s in self.sites),
            "sites_not_compared": sum(not s.compared and not s.failed for s in self.sites),
            "proved": statuses.count("proved"), "refuted": statuses.count("refuted"),
            "unsupported": statuses.count("unsupported"), "sites_unverified": self.unverified,
            "max_site_ulp": max((o.ulp_max for s in self.sites for o in s.numeric.outputs), default=0.0),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "outputs": [o.to_dict() for o in self.outputs],
                "sites": [s.to_dict() for s in self.sites],
                "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
                "by_design": self.by_design, "structure_ok": self.structure_ok, "notes": list(self.notes),
                "unverified_why": list(self.unverified_why)}

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), default=_json_default, **kwargs)

    def __str__(self) -> str:
        s = self.summary()
        verdict = "EQUIVALENT" if self.ok else "NOT EQUIVALENT"
        if self.by_design:
            verdict = f"CHANGED BY DESIGN (Post-Norm -> Pre-Norm), structure {'kept' if self.structure_ok else 'NOT kept' if self.structure_ok is False else 'not checked'}"
        lines = [f"normfuse check: {verdict}: {s['outputs'] - s['outputs_failed']}/{s['outputs']} outputs and "
                 f"gradients pass, {s['sites_passed']}/{s['sites']} sites pass"
                 + (f" ({s['sites_not_compared']} not compared: by design)" if s['sites_not_compared'] else "") + " "
                 f"({s['proved']} proved, {s['refuted']} refuted, {s['unsupported']} unsupported); "
                 f"largest error ratio {s['max_error_ratio']:.3g}"]
        if self.unverified:
            lines[0] += (f"; {self.unverified} of {self.unverified + s['sites']} fused sites not verified: "
                         + "; ".join(self.unverified_why or ["unknown"]))
        lines.append("")
        lines.append(f"  {'output':48s} {'dtype':15s} {'err':>9s} {'err orig':>9s} {'ratio':>6s} {'bound':>9s} "
                     f"{'ulp':>5s} {'diff%':>6s}  pass")
        forward = [o for o in self.outputs if not o.name.startswith("grad:")]
        grads = sorted((o for o in self.outputs if o.name.startswith("grad:")),
                       key=lambda o: (o.passed, -o.ratio))
        shown = forward + grads[:8]
        for o in shown:
            lines.append(f"  {o.name[:48]:48s} {o.dtype:15s} {o.max_abs:9.2e} {o.err_original:9.2e} "
                         f"{o.ratio:6.2f} {o.tolerance:9.2e} {o.ulp_max:5.0f} {100 * o.mismatch:6.2f}  "
                         f"{'ok' if o.passed else 'FAIL: ' + str(o.reason)}")
        if len(grads) > 8:
            rest = grads[8:]
            lines.append(f"  ... {len(rest)} more gradients, {sum(o.passed for o in rest)} pass")
        if self.sites:
            lines.append("")
            lines.append(f"  {'site':8s} {'fqn':40s} {'op':12s} {'ulp':>4s} {'diff%':>6s} {'symbolic':12s} result")
            for site in self.sites:
                outs = site.numeric.outputs
                ulp = max((o.ulp_max for o in outs), default=0.0)
                diff = max((o.mismatch for o in outs), default=0.0)
                sym = site.symbolic.status
                numbers = f"{ulp:4.0f} {100 * diff:6.2f}" if site.compared else f"{'-':>4s} {'-':>6s}"
                lines.append(f"  {site.id:8s} {(site.fqn or '?')[:40]:40s} {site.op or '?':12s} {numbers} "
                             f"{sym:12s} {_site_result(site)}")
        if self.first_divergence is not None:
            lines.append("")
            lines.append(f"first divergence: {self.first_divergence}")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)


def _json_default(value: Any) -> Any:
    return str(value)  # dtypes, tuples of SymInts, ...
