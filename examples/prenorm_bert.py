"""Convert a BERT-like (Post-Norm) model to Pre-Norm, check the structure, train a step.

    python examples/prenorm_bert.py

A deliberate change of architecture: each norm(x + F(x)) becomes x + F(norm(x)), and a
final norm (identity at first) closes the residual stream. The converted model computes
a different function, so normfuse.check reports the deviation as by design and checks the
structural promise instead: from the first converted block to the final norm, the
residual stream passes through adds only. See docs/prenorm.md.
"""

import copy

import torch

import normfuse
from normfuse.zoo import example_inputs, hf_model

original = hf_model("bert", torch.float32)
inputs = example_inputs(original, batch=2, seq=16)
converted = normfuse.optimize(copy.deepcopy(original), prenorm=True)

result = normfuse.check(original, **inputs, optimized=converted)
rep = normfuse.report(converted)
print(rep)
print(f"\nconverted norms: {sum(s.converted for s in rep.sites)}; by design: {result.by_design}; "
      f"structure ok: {result.structure_ok}")
print("new parameters:", [k for k in converted.state_dict() if "normfuse_final_norm" in k])

optimizer = torch.optim.AdamW(converted.parameters(), lr=1e-4)
loss = converted(**inputs).last_hidden_state.square().mean()
loss.backward()
optimizer.step()
print(f"one training step: loss {loss.item():.4f}")
