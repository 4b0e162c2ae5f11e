"""Use normfuse as a torch.compile backend.

    python examples/compile_backend.py

"normfuse" rewrites each captured graph and runs it eagerly; "normfuse_inductor" rewrites
it and hands the rest to inductor. Both are registered by entry point, so the names work
without importing normfuse. torch.compile wraps the model (state_dict keys gain an
"_orig_mod." prefix); normfuse.optimize compiles in place instead.
"""

import torch

import normfuse
from normfuse.zoo import ToyTransformer

torch.manual_seed(0)
model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", hidden=64, depth=4).eval()
ids = torch.randint(0, 64, (2, 16))

for backend in ("normfuse", "normfuse_inductor"):
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        diff = (compiled(ids) - model(ids)).abs().max().item()
    print(f"backend={backend!r}: max |compiled - eager| = {diff:.3e}")
    print(normfuse.report(compiled))   # the graphs the backend rewrote for this model
