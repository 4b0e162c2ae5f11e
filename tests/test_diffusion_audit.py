"""``normfuse audit diffusers:<ClassName>``: a diffusers transformer at its class's default (real) config,
on the meta device, inputs made per family (normfuse/targets.py, DIFFUSERS_FAMILIES); --seq is the
image-token count."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from normfuse.cli import main
from normfuse.errors import TargetError
from normfuse.targets import DIFFUSERS_FAMILIES, load_target

pytestmark = pytest.mark.skipif(importlib.util.find_spec("diffusers") is None,
                                reason="diffusers is not installed (pip install -e '.[dev]')")


def _audit(capsys, *argv: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["audit", *argv]) == 0
    return capsys.readouterr().out


def _json_reasons(capsys) -> str:
    import json

    out = _audit(capsys, "diffusers:WanTransformer3DModel", "--layers", "1", "--seq", "64", "--format", "json")
    return " ".join(str(s.get("add_reason")) for s in json.loads(out)["sites"])


def test_flux_audit_lists_its_norms(capsys):
    out = _audit(capsys, "diffusers:FluxTransformer2DModel", "--layers", "1", "--seq", "256")
    # one double block (adaLN norms of both streams, 4 q/k RMSNorms, 2 norms after the residual add),
    # one single block (its adaLN norm, 2 q/k RMSNorms), the final norm: at Flux-dev's hidden size
    assert "12 norm sites in 1 graph(s); 12 would fuse (2 with their residual add)" in out
    for fqn in ("transformer_blocks.0.norm1.norm", "transformer_blocks.0.attn.norm_added_k",
                "transformer_blocks.0.norm2_context", "single_transformer_blocks.0.attn.norm_q", "norm_out.norm"):
        assert fqn in out
    assert "3072" in out and "batch 1 x seq 256" in out and "torch.bfloat16" in out


def test_wan_audit_lists_its_norms(capsys):
    out = _audit(capsys, "diffusers:WanTransformer3DModel", "--layers", "1", "--seq", "64")
    # one block: norm1, q/k RMSNorms across heads of self- and cross-attention, norm2 (the cross-attention
    # norm) and norm3 after their residual adds, the final norm: at Wan 2.1 14B's hidden size. The class
    # keeps norm1/2/3 in fp32 (as from_pretrained loads it): norm2's and norm_out's adds are formed in fp32
    # and rounded to bf16 by a cast, the call's sum dtype; the gated branches and the modulations go in too
    assert "8 norm sites in 1 graph(s); 8 would fuse (3 with their residual add)" in out
    assert "would fuse as add_norm + gated branch" in out  # norm2 and norm_out (the modulation: the JSON)
    assert "a rounding cast sits between the residual add and the norm" not in _json_reasons(capsys)
    for fqn in ("blocks.0.norm1", "blocks.0.attn1.norm_q", "blocks.0.attn2.norm_k", "blocks.0.norm3", "norm_out"):
        assert fqn in out
    assert "5120" in out


def test_diffusers_target_is_real_size_on_meta():
    model, args, kwargs = load_target("diffusers:FluxTransformer2DModel", device="meta", dtype="bf16", batch=1, seq=4096)
    assert args == () and all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 11e9  # Flux-dev: 12B parameters, no memory
    assert len(model.transformer_blocks) == 19 and len(model.single_transformer_blocks) == 38
    assert kwargs["hidden_states"].shape == (1, 4096, 64) and kwargs["txt_ids"].shape[0] == 512


def test_diffusers_target_errors():
    with pytest.raises(TargetError, match="FluxTransformer2DModel"):
        load_target("diffusers:FluxTransformer2dModel", device="meta")
    with pytest.raises(TargetError, match="no inputs are made"):
        load_target("diffusers:PriorTransformer", device="meta")
    with pytest.raises(TargetError, match="takes no argument 'hidden_size'"):
        load_target("diffusers:FluxTransformer2DModel", overrides={"hidden_size": 8}, device="meta")
    with pytest.raises(TargetError, match="embeds at most 1024 image tokens"):  # AuraFlow's learned positions
        load_target("diffusers:AuraFlowTransformer2DModel", layers=1, device="meta", seq=4096)


@pytest.mark.zoo
@pytest.mark.parametrize("name", sorted(DIFFUSERS_FAMILIES))
def test_every_family_audits_on_meta(name):
    from normfuse import audit

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, args, kwargs = load_target(f"diffusers:{name}", layers=1, device="meta", dtype="bf16", seq=64)
        rep = audit(model, *args, **kwargs)
    assert rep.sites and all(s.would_fuse for s in rep.sites)
