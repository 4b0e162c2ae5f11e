"""Benchmark 6: accuracy of an fp32 residual stream in a deep bf16 model (``residual_dtype``).

Deep bf16 models, eager vs ``normfuse.optimize(model, residual_dtype=torch.float32)``,
each against an fp64 copy of the model (``normfuse.check``): the largest error of the
output and the median, over every parameter's gradient, of the largest error. A wider
stream rounds the sums of the stream once per kernel in fp32 instead of bf16, so the
error should shrink, more so the deeper the model.

    python benchmarks/bench_residual_dtype.py [--toy]
"""

from __future__ import annotations

import copy
import statistics
import warnings

from common import hf_overrides, machine, markdown_table, parse_args, reset_dynamo, write_csv, write_json

import torch

import normfuse
from normfuse import zoo


def accuracy_row(name: str, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    reset_dynamo()
    model = model.to(torch.bfloat16).eval()
    opt = normfuse.optimize(copy.deepcopy(model), residual_dtype=torch.float32)
    res = normfuse.check(model, *args, optimized=opt, **kwargs)
    outputs = [o for o in res.outputs if not o.name.startswith("grad:")]
    grads = [o for o in res.outputs if o.name.startswith("grad:")]
    out = outputs[0]
    sites = normfuse.report(opt).sites
    return {"model": name, "widened_sums": sum(s.residual_dtype is not None for s in sites), "sites": len(sites),
            "output_err_eager": out.err_original, "output_err_fp32_stream": out.max_abs,
            "output_err_ratio": out.max_abs / out.err_original,
            "grad_err_ratio_median": statistics.median(g.max_abs / g.err_original for g in grads if g.err_original),
            "check_ok": res.ok, "by_design": res.by_design}


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    warnings.filterwarnings("ignore", message=".*torch_dtype.*")
    torch.set_num_threads(1)
    depths = (2,) if args.toy else (12, 24)
    rows = []
    for depth in depths:
        torch.manual_seed(0)
        toy = zoo.ToyTransformer(hidden=64, depth=depth, kind="rms_norm", spelling="llama", max_len=64)
        ids = torch.randint(0, 64, (2, 32))
        rows.append(accuracy_row(f"ToyTransformer pre-RMSNorm depth {depth}", toy, (ids,), {}))
    layers = 2 if args.toy else 16
    llama = zoo.hf_model("llama", **hf_overrides("llama", 64, layers))
    rows.append(accuracy_row(f"HF llama {layers} layers hidden 64", llama, (),
                             zoo.example_inputs(llama, batch=2, seq=32)))
    verdict = {"fp32_stream_more_accurate": all(r["output_err_ratio"] < 1 for r in rows),
               "all_checks_ok": all(r["check_ok"] and r["by_design"] for r in rows)}
    write_csv(args.out / "residual_dtype.csv", rows)
    payload = {"machine": machine(), "rows": rows, "verdict": verdict}
    write_json(args.out / "residual_dtype.json", payload)
    print(markdown_table(rows, ["model", "widened_sums", "output_err_eager", "output_err_fp32_stream",
                                "output_err_ratio", "grad_err_ratio_median", "check_ok"]))
    print("verdict:", verdict)
    return payload


if __name__ == "__main__":
    main()
