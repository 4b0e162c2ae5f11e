"""Optimize a HF LLaMA built from its config and compare it with eager.

    python examples/optimize_llama.py

The model is built from its transformers config (no weights downloaded), shrunk to
4 layers. normfuse.optimize rewrites it in place on the first call; the outputs and the
gradients are compared with an untouched copy.
"""

import copy

import torch

import normfuse
from normfuse.zoo import example_inputs, hf_model

model = hf_model("llama", torch.float32, num_hidden_layers=4, hidden_size=128, intermediate_size=256)
eager = copy.deepcopy(model)
inputs = example_inputs(model, batch=2, seq=32)

normfuse.optimize(model)                       # in place; state_dict keys unchanged
out = model(**inputs).last_hidden_state        # capture + rewrite happen here
ref = eager(**inputs).last_hidden_state
out.square().mean().backward()
ref.square().mean().backward()

print(normfuse.report(model))
grad_diff = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), eager.parameters()) if p.grad is not None)
print(f"\nmax |optimized - eager|: output {(out - ref).abs().max().item():.3e}, gradients {grad_diff:.3e}")
print("state_dict keys unchanged:", list(model.state_dict()) == list(eager.state_dict()))
