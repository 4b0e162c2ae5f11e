"""Run one zoo model: normfuse's report, an independent eager count, and ``normfuse.check``."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from typing import Any

import torch

import normfuse
from .count import count_eager
from .models import ZooModel


def measure(entry: ZooModel, check: bool = True) -> dict[str, Any]:
    """What the zoo asserts about one model, as plain data (see tests/zoo/expected.py)."""
    start = time.perf_counter()
    torch._dynamo.reset()
    model, args, kwargs = entry.build()
    eager = count_eager(model, args, kwargs)
    record: dict[str, Any] = {"eager_norms": eager.norms, "eager_input_is_add": eager.input_is_add}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if check:
            try:
                result = normfuse.check(model, *args, backward=False, **kwargs)
            except Exception as error:  # noqa: BLE001 - recorded, and the table says whether it is expected
                record["check"] = f"raises {type(error).__name__}"
                record["check_detail"] = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
                result = None
            report = result.report if result is not None else _optimized_report(model, args, kwargs)
        else:
            result, report = None, _optimized_report(model, args, kwargs)
    c = report.counts()
    record.update(norms=c["sites"], fused=c["fused"], fused_with_add=c["fused_with_add"],
                  input_is_add=c["input_is_add"], placements=dict(sorted(Counter(s.placement for s in report.sites).items())))
    if c["gated"]:  # gated norms (Mamba2, NemotronH, Qwen3-Next): found, and their gate in the call
        record.update(gated=c["gated"], fused_gate=c["fused_gate"])
    if c["rope"]:  # q/k norms whose output goes into a rotary embedding, and those fused with it
        record.update(rope=c["rope"], fused_rope=c["fused_rope"])
    if result is not None:
        forward = [o for o in result.outputs if not o.name.startswith("grad:")]
        record["check"] = "ok" if result.ok else "FAILS"
        record["checked_sites"] = len(result.sites)
        record["bitwise"] = all(o.mismatch == 0 for o in forward)
        if not result.ok:
            record["check_detail"] = str(result).splitlines()[0]
    record["unfused"] = sorted({s.reason for s in report.unfused if s.reason})
    # no silent site: every norm module that ran is a site or listed as not captured, and every
    # add-fed site whose add stays outside the kernel says why
    sites = {s.fqn for s in report.sites}
    # (a norm module wrapping a site's module is that site: x-transformers' LayerNorm calls its
    # affine-free nn.LayerNorm, then multiplies by its gamma)
    record["silent"] = [fqn for fqn in eager.modules if fqn not in sites and fqn not in report.uncaptured
                        and not any(s and s.startswith(fqn + ".") for s in sites)]
    record["unexplained_adds"] = [s.fqn or s.id for s in report.sites
                                  if s.fused and s.input_is_add and not s.fused_add and not s.add_reason]
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record


def _optimized_report(model, args, kwargs):
    import copy

    optimized = normfuse.optimize(copy.deepcopy(model))
    with torch.no_grad():
        optimized(*args, **kwargs)
    return normfuse.report(optimized)
