"""Benchmark 3: activation memory, i.e. the bytes autograd keeps for backward.

Every tensor saved for backward passes through ``torch.autograd.graph.saved_tensors_hooks``;
the pack hook records its storage once (a tensor saved by several ops is one block of
memory), leaving out the model's parameters. Measured per model forward, eager vs
``normfuse.optimize``, for HF llama (pre-norm, decomposed RMSNorm) and bert (post-norm
LayerNorm), fp32 and bf16; and per norm site, on one residual add -> norm site built
from the HF module itself and rewritten by the pass.

Target: a fused site keeps only what its backward needs (the sum it normalizes plus fp32
row statistics): at least 50% less than HF eager's decomposed RMSNorm site.

Recomputing the norm output for the linears that read it (``recompute_norm_output``):
a bf16 llama-shaped norm-and-linear stack (HF LlamaRMSNorm, q/k/v and gate/up linears)
and the whole HF llama, eager vs optimized vs optimized with recompute, with the CPU
time of a training step (forward + backward) of the two optimized ones. Targets: the
stack with recompute <= 0.3x eager; the whole 2-layer llama <= 0.8x optimized; the step
time >= 0.95x optimized (speed, i.e. time(optimized) / time(recompute) >= 0.95).

    python benchmarks/bench_memory.py [--toy]
"""

from __future__ import annotations

import warnings

from common import (Clock, ResidualNormSite, hf_overrides, machine, markdown_table, parse_args, reset_dynamo,
                    save_plot, site_norms, write_csv, write_json)

import torch
import torch.nn as nn

import normfuse
from normfuse import zoo

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class SavedBytes:
    """Counts the distinct storages saved for backward inside the ``with`` block."""

    def __init__(self, exclude: list[torch.Tensor] = ()):
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        self.saves = 0

    def _pack(self, t: torch.Tensor):
        self.saves += 1
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.excluded and key not in self.storages:
            self.storages[key] = storage.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def saved_by_forward(model: nn.Module, inputs: dict) -> SavedBytes:
    with SavedBytes(exclude=list(model.parameters())) as counter:
        out = model(**inputs)
    del out
    return counter


# ------------------------------------------------------------------ whole models

def model_rows(model_type: str, dtype_name: str, hidden: int, layers: int, batch: int, seq: int) -> dict:
    dtype = DTYPES[dtype_name]
    overrides = hf_overrides(model_type, hidden, layers)
    reset_dynamo()
    eager = zoo.hf_model(model_type, dtype=dtype, **overrides)
    inputs = zoo.example_inputs(eager, batch=batch, seq=seq)
    e = saved_by_forward(eager, inputs)
    opt = normfuse.optimize(zoo.hf_model(model_type, dtype=dtype, **overrides))
    saved_by_forward(opt, inputs)  # first call: capture and rewrite
    o = saved_by_forward(opt, inputs)
    rep = normfuse.report(opt)
    fused = sum(s.fused for s in rep.sites)
    return {"model": model_type, "dtype": dtype_name, "hidden": hidden, "layers": layers, "tokens": batch * seq,
            "sites": len(rep.sites), "fused": fused, "eager_bytes": e.bytes, "optimized_bytes": o.bytes,
            "saved_fraction": 1 - o.bytes / e.bytes,
            "saved_bytes_per_fused_site_per_token": (e.bytes - o.bytes) / max(fused, 1) / (batch * seq)}


# ------------------------------------------------------------------ norm-and-linear stack

class NormLinearStack(nn.Module):
    """Llama's norms and the linears that read them, nothing else: per layer
    ``s = h + a; a = q(y) + k(y) + v(y)`` with ``y = norm1(s)``, then ``s' = s + a;
    a = fold(gate(y') + up(y'))`` with ``y' = norm2(s')`` (sums and a reshape save nothing,
    so what is kept is the norms' and the linears' own)."""

    def __init__(self, hidden: int, layers: int, dtype):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
        self.hidden = hidden
        self.layers = nn.ModuleList(nn.ModuleDict({
            "norm1": LlamaRMSNorm(hidden, eps=1e-6), "norm2": LlamaRMSNorm(hidden, eps=1e-6),
            **{name: nn.Linear(hidden, hidden, bias=False) for name in ("q", "k", "v")},
            **{name: nn.Linear(hidden, 2 * hidden, bias=False) for name in ("gate", "up")}})
            for _ in range(layers)).to(dtype)

    def forward(self, h, a):
        for layer in self.layers:
            h = h + a
            y = layer["norm1"](h)
            a = layer["q"](y) + layer["k"](y) + layer["v"](y)
            h = h + a
            y = layer["norm2"](h)
            a = (layer["gate"](y) + layer["up"](y)).unflatten(-1, (2, self.hidden)).sum(-2)
        return h + a


def _step_seconds(models: dict[str, nn.Module], make_args, repeats: int) -> dict[str, float]:
    """Median CPU time of forward + backward of each model (the process's CPU time: steadier on a
    shared machine), the models' steps interleaved so that load changes hit all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(repeats + 1):
        for name, model in models.items():
            args = make_args()
            with Clock() as clock:
                out = model(*args) if isinstance(args, tuple) else model(**args)
                out = out if isinstance(out, torch.Tensor) else out[0]
                out.float().square().mean().backward()
            if i:  # the first round is a warm-up
                times[name].append(clock.cpu)
            model.zero_grad(set_to_none=True)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def recompute_rows(hidden: int, layers: int, tokens: int, repeats: int, llama_shape: dict) -> list[dict]:
    """Saved bytes and step time of the norm-and-linear stack and the whole llama, bf16:
    eager, optimized, optimized with recompute_norm_output."""
    dtype = torch.bfloat16
    rows = []

    def stack_args():
        g = torch.Generator().manual_seed(0)
        return tuple(torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_() for _ in range(2))

    overrides = hf_overrides("llama", llama_shape["hidden"], llama_shape["layers"])
    probe = zoo.hf_model("llama", dtype=dtype, **overrides)
    llama_inputs = zoo.example_inputs(probe, batch=llama_shape["batch"], seq=llama_shape["seq"])
    builds = {
        "norm-and-linear stack": (lambda: NormLinearStack(hidden, layers, dtype), stack_args, f"{layers} layers, "
                                  f"N={hidden}, {tokens} tokens"),
        "HF llama": (lambda: zoo.hf_model("llama", dtype=dtype, **overrides), lambda: dict(llama_inputs),
                     f"{llama_shape['layers']} layers, hidden {llama_shape['hidden']}, "
                     f"{llama_shape['batch'] * llama_shape['seq']} tokens"),
    }
    for name, (build, make_args, shape) in builds.items():
        row = {"model": name, "shape": shape}
        timed = {}
        for variant, options in (("eager", None), ("optimized", {}), ("recompute", dict(recompute_norm_output=True))):
            reset_dynamo()
            torch.manual_seed(0)
            model = build()
            if options is not None:
                model = normfuse.optimize(model, **options)
            args = make_args()
            call = (lambda m=model, a=args: m(*a)) if isinstance(args, tuple) else (lambda m=model, a=args: m(**a))
            call()  # capture and rewrite
            with SavedBytes(exclude=list(model.parameters())) as saved:
                out = call()
            del out
            row[f"{variant}_bytes"] = saved.bytes
            if variant != "eager":
                timed[variant] = model
            if variant == "recompute":
                row["recomputed_sites"] = sum(s.recomputed_linears > 0 for s in normfuse.report(model).sites)
        for variant, seconds in _step_seconds(timed, make_args, repeats).items():
            row[f"{variant}_step_s"] = seconds
        row["recompute_vs_eager"] = row["recompute_bytes"] / row["eager_bytes"]
        row["recompute_vs_optimized"] = row["recompute_bytes"] / row["optimized_bytes"]
        row["speed_vs_optimized"] = row["optimized_step_s"] / row["recompute_step_s"]
        rows.append(row)
    return rows


# ------------------------------------------------------------------ one site

def site_rows(dtype_name: str, n: int, rows: int) -> list[dict]:
    dtype = DTYPES[dtype_name]
    out = []
    for name, (norm, pre) in site_norms(n, dtype).items():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
        r = torch.randn(rows, n, generator=g).to(dtype).requires_grad_()
        site = ResidualNormSite(norm, pre)
        with SavedBytes(exclude=list(site.parameters())) as e:
            site(x, r)
        reset_dynamo()
        fused_site = normfuse.optimize(ResidualNormSite(norm, pre))
        fused_site(x, r)  # capture and rewrite
        with SavedBytes(exclude=list(fused_site.parameters())) as o:
            fused_site(x, r)
        rep = normfuse.report(fused_site)
        elems = rows * n
        # what the backward needs: the sum (model dtype) + fp32 rstd (+ mean for LayerNorm) per row
        floor = elems * dtype.itemsize + rows * 4 * (2 if "LayerNorm" in name else 1)
        out.append({"site": name, "dtype": dtype_name, "N": n, "rows": rows,
                    "fused": sum(s.fused for s in rep.sites),
                    "eager_bytes_per_elem": e.bytes / elems, "fused_bytes_per_elem": o.bytes / elems,
                    "needed_bytes_per_elem": floor / elems, "reduction": 1 - o.bytes / e.bytes,
                    "fused_is_minimal": o.bytes <= floor})
    return out


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    torch.set_num_threads(1)
    if args.toy:
        shape = dict(hidden=64, layers=1, batch=1, seq=8)
        site_n, site_rows_ = 64, 4
        stack = dict(hidden=64, layers=1, tokens=8, repeats=1)
    else:
        shape = dict(hidden=256, layers=2, batch=2, seq=128)
        site_n, site_rows_ = 1024, 256
        stack = dict(hidden=1024, layers=2, tokens=512, repeats=15)
    models = [model_rows(m, d, **shape) for m in ("llama", "bert") for d in DTYPES]
    sites = [r for d in DTYPES for r in site_rows(d, site_n, site_rows_)]
    recompute = recompute_rows(**stack, llama_shape=shape)
    hf_rms = [s for s in sites if s["site"].startswith("HF LlamaRMSNorm")]
    verdict = {
        "min_reduction_vs_hf_rmsnorm_site": min(s["reduction"] for s in hf_rms),
        # the rows' fp32 statistics are allowed on top of the sum: the target is met when the
        # fused site stores no more than that and at least halves HF's site up to those stats
        "meets_target": all(s["fused_is_minimal"] and s["fused_bytes_per_elem"] <=
                            0.5 * s["eager_bytes_per_elem"] + (s["needed_bytes_per_elem"] - DTYPES[s["dtype"]].itemsize)
                            for s in hf_rms),
        "all_sites_minimal": all(s["fused_is_minimal"] for s in sites),
    }
    stack_row, llama_row = recompute
    verdict["recompute"] = {
        "stack_vs_eager": stack_row["recompute_vs_eager"], "stack_target_met": stack_row["recompute_vs_eager"] <= 0.3,
        "llama_vs_optimized": llama_row["recompute_vs_optimized"],
        "llama_target_met": llama_row["recompute_vs_optimized"] <= 0.8,
        "speed_vs_optimized": {r["model"]: r["speed_vs_optimized"] for r in recompute},
        "speed_target_met": all(r["speed_vs_optimized"] >= 0.95 for r in recompute),
    }
    write_csv(args.out / "memory_models.csv", models)
    write_csv(args.out / "memory_sites.csv", sites)
    write_csv(args.out / "memory_recompute.csv", recompute)
    payload = {"machine": machine(), "shape": shape, "models": models, "sites": sites, "recompute_shape": stack,
               "recompute": recompute, "verdict": verdict}
    write_json(args.out / "memory.json", payload)

    def draw(ax):
        labels = [f"{s['site'].split(' (')[0]}\n{s['dtype']}" for s in sites]
        xs = range(len(sites))
        ax.bar([x - 0.2 for x in xs], [s["eager_bytes_per_elem"] for s in sites], 0.4, label="eager")
        ax.bar([x + 0.2 for x in xs], [s["fused_bytes_per_elem"] for s in sites], 0.4, label="normfuse")
        ax.set_xticks(list(xs), labels, fontsize=6)
        ax.set(ylabel="bytes saved for backward / element", title="Activation memory per norm site")
        ax.legend()
    save_plot(args.out / "memory_sites.png", draw)
    print(markdown_table(models, ["model", "dtype", "fused", "eager_bytes", "optimized_bytes", "saved_fraction"]))
    print(markdown_table(sites, ["site", "dtype", "eager_bytes_per_elem", "fused_bytes_per_elem",
                                 "needed_bytes_per_elem", "reduction"]))
    print(markdown_table(recompute, ["model", "shape", "eager_bytes", "optimized_bytes", "recompute_bytes",
                                     "recompute_vs_eager", "recompute_vs_optimized", "optimized_step_s",
                                     "recompute_step_s", "speed_vs_optimized"]))
    print("verdict:", verdict)
    return payload


if __name__ == "__main__":
    main()
