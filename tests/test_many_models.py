"""Several models optimized one after another in one process, as a notebook, an evaluation
harness or a server does, with no ``torch._dynamo.reset()`` in between.

transformers' forwards share one decorator's code, and dynamo keeps what it learned of a
frame's inputs per (file, first line, code name): before each model entered through a code
of its own name, a norm's eps that differed between two models became a graph input in every
later model, whose norms then went unrecognized (olmo2 2 of 9 sites, phi3 0 of 5, llama the
second time 2 of 5). Every model here must keep every site of its zoo entry.
"""

import copy

import pytest
import torch

import normfuse
from normfuse.zoo import example_inputs, hf_model
from tests.zoo.expected import EXPECTED

pytest.importorskip("transformers")

# the families of the report, in its order, then two of them again; more than dynamo's
# recompile_limit (8) models, so a per-code cache shared between them would show too
SEQUENCE = ("llama", "qwen3", "gemma3_text", "olmo2", "mistral", "qwen2", "phi3", "olmo", "llama", "qwen3")
OVERRIDES = {"phi3": {"pad_token_id": 0}}  # its default pad id lies outside the tiny vocabulary


def test_every_model_keeps_every_site():
    @torch.compile(backend="eager")
    def users_own(x):  # compiled code the user already has: optimize must not discard it
        return x * 2

    users_own(torch.ones(3))

    seen = []
    for model_type in SEQUENCE:
        model = hf_model(model_type, **OVERRIDES.get(model_type, {}))
        inputs = example_inputs(model)
        optimized = normfuse.optimize(copy.deepcopy(model))
        with torch.no_grad():
            expected_out = model(**inputs).last_hidden_state
            out = optimized(**inputs).last_hidden_state
        rep = normfuse.report(optimized)
        entry = EXPECTED[f"hf:{model_type}"]
        seen.append((model_type, len(rep.sites), len(rep.fused), rep.uncaptured))
        assert (len(rep.sites), len(rep.fused)) == (entry["norms"], entry["fused"]), seen
        assert rep.uncaptured == [], seen
        assert torch.equal(out, expected_out), model_type

    frames = torch._dynamo.utils.counters["frames"]["ok"]
    users_own(torch.ones(3))
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames, "the user's compiled function was traced again"
