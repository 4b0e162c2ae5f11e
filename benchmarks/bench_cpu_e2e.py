"""Benchmark 4: CPU end to end, optimized vs eager, forward and one training step.

Small HF llama and bert (fp32, dropout off) on CPU. Three variants of the same weights:

* eager:     the HF model as is;
* dynamo:    ``model.compile(backend=<returns gm.forward>)``: dynamo's own cost (guards,
             the captured graph run by the FX interpreter's generated code), no rewrite;
* optimized: ``normfuse.optimize(model)``: the same capture, sites rewritten to the
             fused ops (on CPU they run the PyTorch reference).

Rounds alternate the variants; each reports the min and median over rounds of the mean
CPU time (this process's, one intra-op thread: steadier than wall time on a shared
machine) of ``iters`` calls. Target: optimized never slower than eager (speed ratio >= 0.95).

    python benchmarks/bench_cpu_e2e.py [--toy] [--rounds 7]
"""

from __future__ import annotations

import copy
import time
import warnings

from common import (ResidualNormSite, hf_overrides, machine, markdown_table, parse_args, reset_dynamo, save_plot,
                    site_norms, write_csv, write_json)

import torch

import normfuse
from normfuse import zoo

VARIANTS = ("eager", "dynamo", "optimized")
TARGET = 0.95


def _bare_backend(gm, example_inputs):
    return gm.forward


def build(model_type: str, hidden: int, layers: int, train: bool) -> dict:
    base = zoo.hf_model(model_type, **hf_overrides(model_type, hidden, layers))
    base.train(train)
    models = {name: copy.deepcopy(base) for name in VARIANTS}
    models["dynamo"].compile(backend=_bare_backend)
    normfuse.optimize(models["optimized"])
    return models


def _loss(out) -> torch.Tensor:
    return out.last_hidden_state.float().square().mean()


def step_fn(model, inputs, train: bool):
    if not train:
        def forward():
            with torch.no_grad():
                model(**inputs)
        return forward
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)

    def train_step():
        opt.zero_grad(set_to_none=True)
        _loss(model(**inputs)).backward()
        opt.step()
    return train_step


def measure(model_type: str, train: bool, hidden: int, layers: int, batch: int, seq: int, rounds: int,
            iters: int) -> dict:
    reset_dynamo()
    models = build(model_type, hidden, layers, train)
    inputs = zoo.example_inputs(models["eager"], batch=batch, seq=seq)
    fns = {name: step_fn(m, inputs, train) for name, m in models.items()}
    for fn in fns.values():  # first calls: capture, rewrite; warm caches
        fn(), fn()
    times = {name: [] for name in VARIANTS}
    for rnd in range(rounds):
        order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
        for name in order:
            t0 = time.process_time()
            for _ in range(iters):
                fns[name]()
            times[name].append((time.process_time() - t0) / iters)
    rep = normfuse.report(models["optimized"])
    row = {"model": model_type, "step": "train" if train else "forward", "hidden": hidden, "layers": layers,
           "tokens": batch * seq, "fused": sum(s.fused for s in rep.sites), "sites": len(rep.sites),
           "graphs": rep.graphs}
    for name in VARIANTS:
        row[f"{name}_ms_min"] = 1e3 * min(times[name])
        row[f"{name}_ms_median"] = 1e3 * sorted(times[name])[len(times[name]) // 2]
    # speed ratio: eager time / optimized time (> 1: optimized is faster)
    row["speed_vs_eager"] = row["eager_ms_min"] / row["optimized_ms_min"]
    row["speed_vs_eager_median"] = row["eager_ms_median"] / row["optimized_ms_median"]
    row["dynamo_speed_vs_eager"] = row["eager_ms_min"] / row["dynamo_ms_min"]
    row["speed_vs_dynamo"] = row["dynamo_ms_min"] / row["optimized_ms_min"]
    return row


def _cpu_us(fn, iters: int, rounds: int) -> float:
    """min over rounds of the mean CPU microseconds of ``fn()``."""
    fn(), fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.process_time()
        for _ in range(iters):
            fn()
        best = min(best, (time.process_time() - t0) / iters)
    return 1e6 * best


def site_rows(rows: int, n: int, iters: int, rounds: int) -> list[dict]:
    """One site (the add and its norm), eager vs rewritten: where a model's difference comes from."""
    out = []
    for name, (norm, pre) in site_norms(n, torch.float32).items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, n, generator=g).requires_grad_()
        r = torch.randn(rows, n, generator=g).requires_grad_()
        reset_dynamo()
        variants = {"eager": ResidualNormSite(norm, pre), "dynamo": ResidualNormSite(norm, pre),
                    "optimized": normfuse.optimize(ResidualNormSite(norm, pre))}
        variants["dynamo"].compile(backend=_bare_backend)
        row = {"site": name, "rows": rows, "N": n}
        for vname, site in variants.items():
            def forward(site=site):
                with torch.no_grad():
                    site(x, r)

            def fwd_bwd(site=site):
                out = site(x, r)
                sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
            row[f"{vname}_fwd_us"] = _cpu_us(forward, iters, rounds)
            row[f"{vname}_fwd_bwd_us"] = _cpu_us(fwd_bwd, iters, rounds)
        rep = normfuse.report(variants["optimized"])  # no-grad and grad calls: one graph each
        row["fused"], row["graphs"] = sum(s.fused for s in rep.sites), rep.graphs
        # the fused op against the same captured graph run unfused: dynamo's own cost cancels
        row["fwd_extra_us"] = row["optimized_fwd_us"] - row["dynamo_fwd_us"]
        row["fwd_bwd_extra_us"] = row["optimized_fwd_bwd_us"] - row["dynamo_fwd_bwd_us"]
        out.append(row)
    return out


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--rounds", type=int, default=7),
        p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")))
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    torch.set_num_threads(args.threads)
    if args.toy:
        shape, rounds, iters = dict(hidden=64, layers=1, batch=1, seq=8), 2, 1
    else:
        shape, rounds, iters = dict(hidden=256, layers=2, batch=4, seq=128), args.rounds, 5
    rows = []
    for model_type in ("llama", "bert"):
        for train in (False, True):
            rows.append(measure(model_type, train, rounds=rounds, iters=iters, **shape))
            r = rows[-1]
            print(f"  {r['model']:6s} {r['step']:8s} eager {r['eager_ms_min']:.2f} ms, dynamo {r['dynamo_ms_min']:.2f}"
                  f" ms, optimized {r['optimized_ms_min']:.2f} ms: x{r['speed_vs_eager']:.3f}", flush=True)
    # one site at the models' shape (tokens x hidden): the per-site cost of the CPU path
    sites = site_rows(shape["batch"] * shape["seq"], shape["hidden"], iters=20 * iters, rounds=rounds)
    verdict = {"min_speed_vs_eager": min(r["speed_vs_eager"] for r in rows),
               "meets_target": all(r["speed_vs_eager"] >= TARGET for r in rows)}
    write_csv(args.out / "cpu_e2e.csv", rows)
    write_csv(args.out / "cpu_sites.csv", sites)
    payload = {"machine": machine(), "shape": shape, "rounds": rounds, "iters": iters, "rows": rows,
               "sites": sites, "verdict": verdict}
    write_json(args.out / "cpu_e2e.json", payload)

    def draw(ax):
        labels = [f"{r['model']}\n{r['step']}" for r in rows]
        xs = range(len(rows))
        for k, name in enumerate(VARIANTS):
            ax.bar([x + (k - 1) * 0.27 for x in xs], [r[f"{name}_ms_min"] for r in rows], 0.27, label=name)
        ax.set_xticks(list(xs), labels)
        ax.set(ylabel="ms per call (min over rounds)", title="CPU end to end")
        ax.legend()
    save_plot(args.out / "cpu_e2e.png", draw)
    print(markdown_table(rows, ["model", "step", "fused", "eager_ms_min", "dynamo_ms_min", "optimized_ms_min",
                                "speed_vs_eager", "speed_vs_eager_median", "speed_vs_dynamo"]))
    print(markdown_table(sites, ["site", "eager_fwd_us", "dynamo_fwd_us", "optimized_fwd_us", "eager_fwd_bwd_us",
                                 "dynamo_fwd_bwd_us", "optimized_fwd_bwd_us", "fwd_extra_us", "fwd_bwd_extra_us"]))
    print("verdict:", verdict)
    return payload


if __name__ == "__main__":
    main()
