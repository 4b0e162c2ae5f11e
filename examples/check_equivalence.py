"""Check that fusing a model kept it: outputs, gradients, and every rewritten site.

    python examples/check_equivalence.py            # a shrunk Llama in bf16 (about 20 s on a laptop CPU)

normfuse.check optimizes a deep copy, runs it next to the original and an fp64 copy of
the original (forward and backward), then holds each fused site to the subgraph it
replaced, numerically and with a sympy proof. The same from a shell:

    normfuse check hf:llama --dtype bf16
"""

import torch

import normfuse
from normfuse.verify.numeric import perturb_vectors
from normfuse.zoo import hf_model

# Built from its config, so the norm weights are exactly 1; trained weights are not, and
# weights of 1 would hide a rounding-order mistake. Give them small noise.
model = perturb_vectors(hf_model("llama", dtype=torch.bfloat16))

res = normfuse.check(model)          # inputs are made for HF models; or check(model, *args, **kwargs)
print(res)

summary = res.summary()
print(f"\n{summary['sites']} sites, {summary['proved']} proved; largest error ratio "
      f"{summary['max_error_ratio']:.2f} (the rule allows 3 in bf16)")
if res.first_divergence is not None:
    print("first divergence:", res.first_divergence)
raise SystemExit(0 if res.ok else 1)
