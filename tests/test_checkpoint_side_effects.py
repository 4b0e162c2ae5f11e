"""A checkpointed block whose forward has a Python side effect.

transformers requires the `kernels` package from 5.25 on; it wraps the attention's forward in a
function that sets a context-variable-like object's attribute and resets it on the way out.
Inside ``torch.utils.checkpoint`` dynamo refuses a mutation of an object from outside the
region that it cannot see undone (eager would replay it in the recompute) and so gave up the
whole forward: with HF gradient checkpointing on, every block's norm ran eagerly. normfuse
captures with the side effect run once, in the forward (``normfuse.capture.CAPTURE_CONFIG``).
The HF families below meet the `kernels` wrapper under the newest transformers (the
newest-release job, ``make test-newest``); the toy blocks meet a counter and a set/reset pair.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import normfuse
from tests.loops import CheckpointedStack

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class _ActiveValue:
    """A context variable as `kernels` writes one for torch.compile: a plain attribute."""

    def __init__(self):
        self.value = None

    def set(self, value):
        previous, self.value = self.value, value
        return previous

    def reset(self, previous):
        self.value = previous


ACTIVE = _ActiveValue()


class _SettingWrapper(nn.Module):
    """A module whose forward sets ``ACTIVE`` around the wrapped module's call."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        token = ACTIVE.set({"layer": 1})
        try:
            return self.inner(x)
        finally:
            ACTIVE.reset(token)


class _CountingWrapper(nn.Module):
    """A module whose forward counts its calls in an object outside the model."""

    calls = 0

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        _CountingWrapper.calls = _CountingWrapper.calls + 1
        return self.inner(x)


WRAPPERS = {"set_and_reset": _SettingWrapper, "counter": _CountingWrapper}


def _stack(wrapper="set_and_reset"):
    model = CheckpointedStack(depth=2)
    for block in model.blocks:
        block.attn = WRAPPERS[wrapper](block.attn)
    return model


IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
@pytest.mark.parametrize("cross_checkpoints", [False, True])
def test_side_effect_in_a_checkpointed_block_keeps_its_sites(wrapper, cross_checkpoints):
    model = _stack(wrapper).train()
    reference = copy.deepcopy(model)
    normfuse.optimize(model, cross_checkpoints=cross_checkpoints)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no eager fallback
        _CountingWrapper.calls = 0
        out = model(IDS)
        out.square().mean().backward()
    # the effect runs once per block in the forward (eager runs it again in the recompute)
    assert _CountingWrapper.calls == (2 if wrapper == "counter" else 0)
    ref_out = reference(IDS)
    ref_out.square().mean().backward()

    rep = normfuse.report(model)
    assert rep.uncaptured == []
    # 2 blocks x 2 norms + the final norm, every one fused
    assert (len(rep.sites), len(rep.fused)) == (5, 5)
    assert ACTIVE.value is None  # set and reset, as in eager
    torch.testing.assert_close(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_the_setting_applies_to_the_capture_only():
    before = torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    model = normfuse.optimize(_stack().train())
    model(IDS).sum().backward()
    assert torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint == before


HF_SITES = {"mistral": 5, "qwen3": 9, "gemma3_text": 13}


@pytest.mark.parametrize("model_type", list(HF_SITES))
def test_hf_gradient_checkpointing_keeps_every_block(model_type):
    """The flow the README gives for HF training with checkpointing: every norm found and
    fused, every residual add fused with its norm, gradients as eager's."""
    pytest.importorskip("transformers")
    from normfuse.zoo import example_inputs, hf_model

    model = hf_model(model_type).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    inputs = example_inputs(model)
    normfuse.optimize(model, cross_checkpoints=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = model(**inputs).last_hidden_state
    out.square().mean().backward()
    ref_out = reference(**inputs).last_hidden_state
    ref_out.square().mean().backward()

    rep = normfuse.report(model)
    assert rep.uncaptured == []
    assert (len(rep.sites), len(rep.fused)) == (HF_SITES[model_type], HF_SITES[model_type])
    assert rep.counts()["fused_with_add"] == 4  # 2 layers x 2 adds, each fused with the norm after it
    torch.testing.assert_close(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
