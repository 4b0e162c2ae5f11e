"""LoRA fine-tuning of a diffusion transformer through PEFT, optimized: the flow users run on
Flux and Wan (adapters on the attention projections, the base frozen), here on small diffusers
configs built offline. The optimized model takes the block chain (gated branch, add, norm,
modulation) into its calls and trains as eager does: the adapters' gradients within the tolerance
rule against an fp64 copy, next to eager's; the adapter keys unchanged.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings

import pytest
import torch

import normfuse
from normfuse.tolerances import within_tolerance

pytestmark = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None or
                                importlib.util.find_spec("peft") is None,
                                reason="diffusers or peft is not installed (pip install -e '.[dev]')")


def _lora(name: str, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model

    from tests.zoo.diffusion import build, prediction

    model, kwargs = build(name)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"], lora_dropout=0.0)
    return get_peft_model(model.to(dtype), config), kwargs, prediction


def _double(value):
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


def _first_grads(model, kwargs, prediction, target):
    out = prediction(model(**kwargs))
    ((out.double() - target) ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", ["dit", "wan21"])
def test_lora_gradients_within_the_rule(name):
    from peft import get_peft_model_state_dict

    torch.manual_seed(0)
    eager, kwargs, prediction = _lora(name)
    state = copy.deepcopy(eager.state_dict())
    optimized = copy.deepcopy(eager)
    exact = copy.deepcopy(eager).double()
    exact.load_state_dict({k: v.double() for k, v in state.items()})
    adapter_keys = list(get_peft_model_state_dict(optimized))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normfuse.optimize(optimized)
        target = torch.randn_like(prediction(eager(**kwargs)).double())
        base = _first_grads(eager, kwargs, prediction, target)
        got = _first_grads(optimized, kwargs, prediction, target)
        ref = _first_grads(exact, _double(kwargs), prediction, target)
    counts = normfuse.report(optimized).counts()
    assert counts["fused_modulation"] == counts["modulated"] > 0 and counts["fused_gated_residual"] > 0
    assert list(get_peft_model_state_dict(optimized)) == adapter_keys
    assert base.keys() == got.keys() and all("lora" in n for n in got)
    for n, g in got.items():
        ok, err, err_base, bound = within_tolerance(g, base[n], ref[n], dtype=g.dtype)
        assert ok, f"{n}: error {err:.3g} > bound {bound:.3g} (eager's {err_base:.3g})"
