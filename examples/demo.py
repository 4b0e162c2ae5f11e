"""`make demo`: normfuse end to end on a built-in example, on the CPU, in about a minute.

1. Audit a LLaMA-shaped model built from its transformers config (no download): every
   norm site, where it sits, whether it fuses, and the HBM bytes fusion saves.
2. The fused ops on a small Post-Norm and a small Pre-Norm model, against eager.
3. Optimize the LLaMA model, check equivalence (numeric against fp64, symbolic per
   site) and print the report.
"""

from __future__ import annotations

import sys
import time
import warnings

import torch

import normfuse
from normfuse.zoo import ToyTransformer, example_inputs, hf_model

LLAMA = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, vocab_size=1000)


def rule(title: str) -> None:
    print(f"\n{'=' * 78}\n{title}\n{'=' * 78}")


def audit_llama() -> None:
    rule("1. normfuse audit: a LLaMA-shaped model from its config (4 layers, hidden 256)")
    model = hf_model("llama", torch.bfloat16, **LLAMA)
    report = normfuse.audit(model, **example_inputs(model, batch=8, seq=512), name="hf:llama (4 layers)")
    print(report.to_table())


def fused_ops_on_toys() -> None:
    rule("2. The fused ops on a Post-Norm and a Pre-Norm model (bf16), against eager")
    print(f"{'model':22s} {'sites':>5s} {'fused':>5s} {'with add':>8s}  {'max|opt-eager|':>14s} "
          f"{'err eager':>10s} {'err opt':>10s}   (errors against an fp64 copy)")
    for placement in ("post", "pre"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = ToyTransformer(placement=placement, kind="layer_norm", hidden=128, depth=4,
                               embed_norm=placement == "post").eval()
        exact = ToyTransformer(placement=placement, kind="layer_norm", hidden=128, depth=4,
                               embed_norm=placement == "post").eval().double()
        exact.load_state_dict(model.state_dict())
        model = model.to(torch.bfloat16)
        ids = torch.randint(0, 64, (4, 32))
        with torch.no_grad():
            eager = model(ids).double()
            ref = exact(ids)
            normfuse.optimize(model)
            optimized = model(ids).double()
        c = normfuse.report(model).counts()
        print(f"{placement + '-norm toy (4 blocks)':22s} {c['sites']:5d} {c['fused']:5d} {c['fused_with_add']:8d}  "
              f"{(optimized - eager).abs().max().item():14.3e} {(eager - ref).abs().max().item():10.3e} "
              f"{(optimized - ref).abs().max().item():10.3e}")


def optimize_and_check() -> int:
    rule("3. normfuse.optimize + normfuse.check on the LLaMA model (fp32, forward and backward)")
    torch._dynamo.reset()
    model = hf_model("llama", torch.float32, **LLAMA)
    inputs = example_inputs(model, batch=2, seq=64)
    start = time.perf_counter()
    result = normfuse.check(model, **inputs)
    print(result)
    print(f"(check took {time.perf_counter() - start:.1f} s)")
    optimized = normfuse.optimize(model)
    with torch.no_grad():
        optimized(**inputs)
    rule("4. normfuse.report(model)")
    print(normfuse.report(optimized))
    return 0 if result.ok else 1


def main() -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    warnings.filterwarnings("ignore", category=UserWarning)
    print(f"normfuse {normfuse.__version__} on torch {torch.__version__}, device: cpu")
    audit_llama()
    fused_ops_on_toys()
    return optimize_and_check()


if __name__ == "__main__":
    sys.exit(main())
