"""Benchmark 2: what ``optimize`` costs at capture time, against a bare dynamo capture.

For a HF llama (hidden 64) at 8, 32 and 128 layers, in one process, alternating:

* bare:     ``model.compile(backend=<returns gm.forward>)``, first call (dynamo capture);
* optimize: ``normfuse.optimize(model)``, first call (capture + the pass + the run).

The first call of each is timed (wall and process CPU time); inside ``optimize`` the
time spent in the pass itself (``normfuse.NormFusionPass.run``) is timed as well, so
the overhead is known even when the machine is noisy. Each repeat runs the two back to back
(alternating which goes first); the ratio is the median over repeats of optimize / bare
within a repeat. Targets: optimize <= 1.1x bare, pass time linear in layers.

    python benchmarks/bench_pass_cost.py [--toy] [--layers 8 32 128] [--repeats 5]
"""

from __future__ import annotations

import gc
import time
import warnings

from common import (Clock, hf_overrides, machine, markdown_table, median, parse_args, reset_dynamo, save_plot,
                    write_csv, write_json)

import torch

import normfuse
from normfuse import zoo
from normfuse.passes import pipeline

HIDDEN = 64
TARGET_RATIO = 1.1


class _PassTimer:
    """Wraps ``NormFusionPass.run`` (one call per captured graph) and sums its time."""

    def __init__(self):
        self.wall = self.cpu = 0.0
        self._run = pipeline.NormFusionPass.run

    def __enter__(self):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.process_time()
            try:
                return self._run(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - w
                self.cpu += time.process_time() - c
        pipeline.NormFusionPass.run = timed
        return self

    def __exit__(self, *exc):
        pipeline.NormFusionPass.run = self._run


def _bare_backend(gm, example_inputs):
    return gm.forward


def first_call(layers: int, mode: str, seq: int = 8) -> dict:
    """Capture (and rewrite) a fresh llama of ``layers`` layers; time its first call."""
    reset_dynamo()
    model = zoo.hf_model("llama", **hf_overrides("llama", HIDDEN, layers))
    inputs = zoo.example_inputs(model, batch=1, seq=seq)
    row = {"layers": layers, "mode": mode}
    with _PassTimer() as pt:
        if mode == "bare":
            model.compile(backend=_bare_backend)
        else:
            normfuse.optimize(model)
        gc.collect()  # each first call starts from a collected heap: the previous model's garbage is not billed to it
        with Clock() as clock, torch.no_grad():
            model(**inputs)
    row.update(wall_s=clock.wall, cpu_s=clock.cpu, pass_wall_s=pt.wall, pass_cpu_s=pt.cpu)
    if mode == "optimize":
        rep = normfuse.report(model)
        row.update(graphs=rep.graphs, sites=len(rep.sites), fused=sum(s.fused for s in rep.sites))
    return row


def summarize(runs: list[dict]) -> list[dict]:
    """Per depth: the ratio of each repeat's two first calls, run back to back (this machine's
    speed drifts by tens of percent over minutes, alike for both), their median as the ratio;
    the least time of each mode and the medians beside it."""
    out = []
    for layers in sorted({r["layers"] for r in runs}):
        reps = sorted({r["rep"] for r in runs if r["layers"] == layers})
        cpu = {(r["rep"], r["mode"]): r["cpu_s"] for r in runs if r["layers"] == layers}
        ratios = [cpu[rep, "optimize"] / cpu[rep, "bare"] for rep in reps]
        bare = [cpu[rep, "bare"] for rep in reps]
        opt = [r for r in runs if r["layers"] == layers and r["mode"] == "optimize"]
        p_cpu = median(r["pass_cpu_s"] for r in opt)
        out.append({
            "layers": layers, "repeats": len(reps), "sites": opt[0]["sites"], "fused": opt[0]["fused"],
            "bare_capture_s": median(bare), "optimize_s": median(r["cpu_s"] for r in opt), "pass_s": p_cpu,
            "ratio_vs_bare": median(ratios), "ratio_low": min(ratios), "ratio_high": max(ratios),
            "ratio_of_least": min(r["cpu_s"] for r in opt) / min(bare),
            "ratio_pass_share": (median(bare) + p_cpu) / median(bare),  # bare capture + the measured pass time
            "pass_ms_per_layer": 1e3 * p_cpu / layers,
            "bare_ms_per_layer": 1e3 * median(bare) / layers,
        })
    return out


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--layers", type=int, nargs="+", default=[8, 32, 128]),
        p.add_argument("--repeats", type=int, default=5)))
    layers_list, repeats = (([1, 2], 1) if args.toy else (args.layers, args.repeats))
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    torch.set_num_threads(1)
    first_call(1, "bare"), first_call(1, "optimize")  # imports, dynamo's one-time set-up
    runs = []
    for layers in layers_list:
        for rep in range(repeats):
            for mode in (("bare", "optimize") if rep % 2 == 0 else ("optimize", "bare")):
                runs.append({**first_call(layers, mode), "rep": rep})
                print(f"  layers={layers:4d} {mode:9s} cpu {runs[-1]['cpu_s']:.2f}s "
                      f"pass {runs[-1]['pass_cpu_s']:.3f}s", flush=True)
    summary = summarize(runs)
    lo, hi = summary[0], summary[-1]
    verdict = {
        "max_ratio_vs_bare": max(s["ratio_vs_bare"] for s in summary),
        "max_ratio_pass_share": max(s["ratio_pass_share"] for s in summary),
        # per-layer pass cost at the largest model over the smallest: 1.0 is perfectly linear
        "pass_per_layer_growth": hi["pass_ms_per_layer"] / lo["pass_ms_per_layer"],
        "bare_per_layer_growth": hi["bare_ms_per_layer"] / lo["bare_ms_per_layer"],
    }
    verdict["meets_ratio_target"] = verdict["max_ratio_vs_bare"] <= TARGET_RATIO
    write_csv(args.out / "pass_cost_runs.csv", runs)
    write_csv(args.out / "pass_cost.csv", summary)
    payload = {"machine": machine(), "model": f"llama hidden {HIDDEN}", "summary": summary, "verdict": verdict}
    write_json(args.out / "pass_cost.json", payload)

    def draw(ax):
        xs = [s["layers"] for s in summary]
        ax.plot(xs, [s["bare_capture_s"] for s in summary], "o-", label="dynamo capture (do-nothing backend)")
        ax.plot(xs, [s["optimize_s"] for s in summary], "s-", label="normfuse.optimize (capture + pass)")
        ax.plot(xs, [s["pass_s"] for s in summary], "^-", label="the pass alone")
        ax.set(xlabel="llama layers", ylabel="CPU seconds, first call", xscale="log", yscale="log",
               title="Pass cost vs bare capture")
        ax.legend()
    save_plot(args.out / "pass_cost.png", draw)
    print(markdown_table(summary, ["layers", "fused", "bare_capture_s", "optimize_s", "pass_s", "ratio_vs_bare",
                                   "ratio_low", "ratio_high", "ratio_of_least", "ratio_pass_share",
                                   "pass_ms_per_layer"]))
    print("verdict:", verdict)
    return payload


if __name__ == "__main__":
    main()
