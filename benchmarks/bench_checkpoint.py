"""Benchmark: activation checkpointing, eager vs optimized (HF llama-shaped model).

With ``gradient_checkpointing_enable()`` every decoder layer is a checkpointed region: the
forward keeps only each layer's input, and backward re-runs the layer to rebuild what
its own backward needs. normfuse enters those regions, so the re-run is the fused graph.
Three models: eager, ``optimize`` (the default: the last layer's residual pair goes to the
final norm, the others hand on the sum) and ``optimize(cross_checkpoints=True)`` ("crossing":
the pair goes into every checkpointed layer, which keeps two tensors instead of one).
Measured, per configuration:

- ``forward saved``: bytes autograd keeps through the forward (distinct storages,
  parameters left out) — the checkpointed model's resident activations;
- ``recompute saved``: bytes one layer's re-run keeps for that layer's backward (the layer
  run under autograd on its input, eager vs its rewritten graph) — the transient peak
  checkpointing trades for;
- CPU step time (forward + backward), best of 10, the two models' steps interleaved.

    python benchmarks/bench_checkpoint.py [--toy]
"""

from __future__ import annotations

import copy
import time

from bench_memory import SavedBytes
from common import hf_overrides, machine, markdown_table, parse_args, reset_dynamo, write_csv, write_json

import torch

import normfuse
from normfuse import zoo


def _step(model, inputs):
    out = model(**inputs).last_hidden_state
    out.float().square().mean().backward()


def _timed(models, inputs, repeats: int) -> list[float]:
    """Best step time of each model, the models' steps interleaved (so that load on the
    machine falls on all of them alike)."""
    for model in models:
        _step(model, inputs)  # warm-up (capture)
    best = [float("inf")] * len(models)
    for _ in range(repeats):
        for i, model in enumerate(models):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _step(model, inputs)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def _forward_saved(model, inputs) -> int:
    params = list(model.parameters())
    with SavedBytes(exclude=params) as saved:
        model(**inputs).last_hidden_state.float().square().mean()
    return saved.bytes


def _layer_recompute_saved(model, eager_model, inputs) -> tuple[int, int]:
    """Bytes one decoder layer keeps for its backward when re-run: eager vs rewritten."""
    hidden = eager_model.embed_tokens(inputs["input_ids"]).detach().requires_grad_()
    position_ids = torch.arange(hidden.shape[1]).unsqueeze(0)
    rotary = eager_model.rotary_emb(hidden, position_ids)
    result = []
    for layer in (eager_model.layers[0], model.layers[0]):
        params = list(layer.parameters())
        with SavedBytes(exclude=params) as saved:
            layer(hidden, position_embeddings=rotary, position_ids=position_ids)
        result.append(saved.bytes)
    return result[0], result[1]


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    configs = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    hidden, layers, batch, seq, repeats = (64, 2, 1, 32, 1) if args.toy else (256, 4, 2, 256, 10)
    rows = []
    for name, dtype in configs:
        reset_dynamo()
        eager = zoo.hf_model("llama", dtype=dtype, **hf_overrides("llama", hidden, layers))
        eager.gradient_checkpointing_enable()
        eager.train()
        inputs = zoo.example_inputs(eager, batch=batch, seq=seq)
        optimized = normfuse.optimize(copy.deepcopy(eager))
        # the residual pair handed into the checkpointed layers too (every add fused; each
        # checkpoint then keeps the pair, two tensors, where it kept the sum)
        crossing = normfuse.optimize(copy.deepcopy(eager), cross_checkpoints=True)
        eager_s, opt_s, cross_s = _timed([eager, optimized, crossing], inputs, repeats)
        counts = normfuse.report(optimized).counts()
        cross_counts = normfuse.report(crossing).counts()
        # what one layer's re-run keeps: the layer itself, eager and optimized, outside any
        # checkpoint (a checkpointed call would keep only its inputs)
        plain = copy.deepcopy(eager)
        plain.gradient_checkpointing_disable()
        layer_model = copy.deepcopy(plain)
        layer_model.layers[0] = normfuse.optimize(layer_model.layers[0])
        eager_layer, fused_layer = _layer_recompute_saved(layer_model, plain, inputs)
        rows.append({
            "dtype": name, "hidden": hidden, "layers": layers, "tokens": batch * seq,
            "sites": counts["sites"], "fused": counts["fused"], "fused_with_add": counts["fused_with_add"],
            "fused_with_add_crossing": cross_counts["fused_with_add"],
            "forward_saved_eager": _forward_saved(eager, inputs),
            "forward_saved_optimized": _forward_saved(optimized, inputs),
            "forward_saved_crossing": _forward_saved(crossing, inputs),
            "recompute_saved_eager": eager_layer, "recompute_saved_optimized": fused_layer,
            "recompute_ratio": round(fused_layer / eager_layer, 3),
            "step_s_eager": round(eager_s, 4), "step_s_optimized": round(opt_s, 4),
            "step_speedup": round(eager_s / opt_s, 3),
            "step_s_crossing": round(cross_s, 4), "step_speedup_crossing": round(eager_s / cross_s, 3),
        })
    out = args.out
    write_csv(out / "checkpoint.csv", rows)
    write_json(out / "checkpoint.json", {"machine": machine(), "rows": rows})
    print(markdown_table(rows))
    return {"rows": rows}


if __name__ == "__main__":
    main()
