"""Audit a model and write the HTML report: per-site table, verdict, bytes saved, residual-stream picture.

    python examples/audit_report.py                       # a Gemma-2 shape: sandwich + pre-norm sites
    python examples/audit_report.py hf:llama report.html  # any target normfuse audit takes

The model is built on the meta device from its transformers config (no weights, no memory),
so this runs in well under a minute on a laptop CPU. Open the HTML file in a browser.
"""

from __future__ import annotations

import sys
import time

import normfuse
from normfuse.targets import load_target


def main(target: str = "hf:gemma2", out: str = "audit_report.html") -> None:
    start = time.perf_counter()
    model, args, kwargs = load_target(target, layers=4, device="meta", dtype="bf16", batch=1, seq=None)
    rep = normfuse.audit(model, *args, name=target, **kwargs)
    rep.batch, rep.seq = 1, rep.tokens
    with open(out, "w", encoding="utf-8") as f:
        f.write(rep.to_html())
    print(rep)
    s = rep.summary()
    print(f"\nwrote {out}: {s['sites']} sites, {s['fused']} would fuse, verdict {s['verdict']} "
          f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
