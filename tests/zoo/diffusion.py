"""The diffusion zoo: diffusers' transformers at small configs, their inputs, and what normfuse does to them.

Each entry builds ``(model, kwargs)``: the model in fp32 on the CPU, eval mode, random weights
(fixed seed), at a config shaped like the one diffusers' own test suite uses for the class
(tests/models/transformers/test_models_*.py: ``get_init_dict`` / ``get_dummy_inputs``), with the
spatial sizes kept small so each model builds and runs in a second or two. ``model(**kwargs)``
runs it; its first output is the denoiser's prediction.

``measure(name)`` is what tests/test_diffusion_zoo.py asserts: the report's counts, outputs and
gradients against eager, and ``elementwise_passes`` (below) on the graph dynamo captures, before
and after the pass.
"""

from __future__ import annotations

import copy
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.fx as fx

__all__ = ["DIFFUSION", "DiffusionModel", "build", "measure", "passes", "per_block", "elementwise_passes",
           "activation_numel", "POINTWISE"]


@dataclass(frozen=True)
class DiffusionModel:
    name: str
    cls: str                    # the diffusers class
    family: str                 # DiT, PixArt, SD3, Flux, Wan, ...
    build: Callable[[], tuple[nn.Module, dict[str, Any]]]
    blocks: tuple[str, ...] = ("num_layers",)   # the config's counts of blocks, one per kind of block


def _diffusers():
    from normfuse.zoo import prepare_torchvision

    prepare_torchvision()  # diffusers imports peft, which imports transformers, which imports torchvision
    import diffusers

    return diffusers


def _randn(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# config key -> blocks added to what a builder asks for (``per_block`` measures one more block of a kind)
_MORE_BLOCKS: dict[str, int] = {}


def _make(cls: str, **config: Any) -> nn.Module:
    torch.manual_seed(0)
    config = {k: v + _MORE_BLOCKS.get(k, 0) if isinstance(v, int) else v for k, v in config.items()}
    return getattr(_diffusers(), cls)(**config).eval()


# --------------------------------------------------------------------------- builders

def _dit():
    model = _make("DiTTransformer2DModel", in_channels=4, out_channels=8, activation_fn="gelu-approximate",
                  num_attention_heads=2, attention_head_dim=8, attention_bias=True, num_layers=2,
                  norm_type="ada_norm_zero", num_embeds_ada_norm=8, patch_size=2, sample_size=8)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), timestep=torch.tensor([3, 5]),
                       class_labels=torch.tensor([1, 6]), return_dict=False)


def _pixart(alpha: bool):
    # inner dim 24: PixArt-alpha's size conditions embed to inner // 3 each
    model = _make("PixArtTransformer2DModel", sample_size=8, num_layers=2, patch_size=2, attention_head_dim=12,
                  num_attention_heads=2, in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True,
                  activation_fn="gelu-approximate", num_embeds_ada_norm=8, norm_type="ada_norm_single",
                  norm_elementwise_affine=False, norm_eps=1e-6, use_additional_conditions=alpha, caption_channels=16)
    cond = (dict(resolution=torch.tensor([[64.0, 64.0]] * 2), aspect_ratio=torch.tensor([[1.0]] * 2)) if alpha
            else dict(resolution=None, aspect_ratio=None))
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 6, 16, seed=2),
                       timestep=torch.tensor([3, 5]), added_cond_kwargs=cond, return_dict=False)


def _sd3(dual: bool):
    # SD3.5 Medium: the first layer's image stream attends twice (AdaLayerNormZeroX), q/k RMSNorms
    model = _make("SD3Transformer2DModel", sample_size=8, patch_size=1, in_channels=4, num_layers=2,
                  attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                  pooled_projection_dim=64, out_channels=4, pos_embed_max_size=16,
                  dual_attention_layers=(0,) if dual else (), qk_norm="rms_norm" if dual else None)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 6, 32, seed=2),
                       pooled_projections=_randn(2, 64, seed=3), timestep=torch.tensor([3, 500]), return_dict=False)


def _flux():
    model = _make("FluxTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                  axes_dims_rope=[4, 4, 8])
    h = w = 4
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w))
    return model, dict(hidden_states=_randn(1, h * w, 4), encoder_hidden_states=_randn(1, 8, 32, seed=2),
                       pooled_projections=_randn(1, 32, seed=3), timestep=torch.tensor([1.0]),
                       img_ids=img_ids.reshape(-1, 3).float(), txt_ids=torch.zeros(8, 3), return_dict=False)


def _flux2():
    model = _make("Flux2Transformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                  timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
    h = w = 4
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w), torch.arange(1))
    txt_ids = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(8))
    return model, dict(hidden_states=_randn(1, h * w, 4), encoder_hidden_states=_randn(1, 8, 32, seed=2),
                       img_ids=img_ids[None], txt_ids=txt_ids[None], timestep=torch.tensor([1.0]),
                       guidance=torch.tensor([1.0]), return_dict=False)


def _wan(per_token: bool):
    # Wan 2.2 TI2V takes one timestep per latent token (its first frame kept clean): timestep [B, S]
    model = _make("WanTransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    frames, h, w = 2, 8, 8
    tokens = frames * (h // 2) * (w // 2)
    timestep = torch.full((1, tokens), 700) if per_token else torch.tensor([700])
    if per_token:
        timestep[:, : tokens // frames] = 0
    # 8 text tokens: more than the 6 rows of the per-sample modulation table [B, 6, C], so the
    # activation's size (the text stream's, the smallest normed) does not count the table's add
    return model, dict(hidden_states=_randn(1, 4, frames, h, w), timestep=timestep,
                       encoder_hidden_states=_randn(1, 8, 16, seed=2), return_dict=False)


def _cogvideox(rope: bool):
    # CogVideoX 1.0 (2B: sincos positions) and 1.5 (rotary positions, patch_size_t=2)
    head_dim = 16
    model = _make("CogVideoXTransformer3DModel", num_attention_heads=2, attention_head_dim=head_dim, in_channels=4,
                  out_channels=4, time_embed_dim=4, text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8,
                  sample_frames=8, patch_size=2, patch_size_t=2 if rope else None, temporal_compression_ratio=4,
                  max_text_seq_length=8, use_rotary_positional_embeddings=rope)
    frames = 2 if rope else 1
    kwargs = dict(hidden_states=_randn(2, frames, 4, 8, 8), encoder_hidden_states=_randn(2, 8, 8, seed=2),
                  timestep=torch.tensor([3, 500]), return_dict=False)
    if rope:
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        kwargs["image_rotary_emb"] = get_3d_rotary_pos_embed(
            embed_dim=head_dim, crops_coords=None, grid_size=(4, 4), temporal_size=1, grid_type="slice",
            max_size=(4, 4))
    return model, kwargs


def _ltx():
    model = _make("LTXVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=8, cross_attention_dim=16, num_layers=2, qk_norm="rms_norm_across_heads",
                  caption_channels=16)
    frames, h, w = 2, 4, 4
    return model, dict(hidden_states=_randn(2, frames * h * w, 4), encoder_hidden_states=_randn(2, 8, 16, seed=2),
                       timestep=torch.tensor([3, 500]), encoder_attention_mask=torch.ones(2, 8, dtype=torch.bool),
                       num_frames=frames, height=h, width=w, return_dict=False)


def _hunyuan_video(token_replace: bool = False):
    """HunyuanVideo; ``token_replace``: its image-to-video variant, whose first frame's tokens take a
    modulation and gates of their own (per segment of the tokens)."""
    model = _make("HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=10, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                  patch_size_t=1, guidance_embeds=not token_replace, text_embed_dim=16, pooled_projection_dim=8,
                  rope_axes_dim=(2, 4, 4), image_condition_type="token_replace" if token_replace else None)
    frames, guidance = (2, {}) if token_replace else (1, dict(guidance=torch.tensor([3500.0])))
    return model, dict(hidden_states=_randn(1, 4, frames, 4, 4), timestep=torch.tensor([500.0]),
                       encoder_hidden_states=_randn(1, 6, 16, seed=2), encoder_attention_mask=torch.ones(1, 6),
                       pooled_projections=_randn(1, 8, seed=3), return_dict=False, **guidance)


def _sana():
    model = _make("SanaTransformer2DModel", patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                  attention_head_dim=4, num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
                  cross_attention_dim=8, caption_channels=8, sample_size=8)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 8, 8, seed=2),
                       timestep=torch.tensor([3, 500]), return_dict=False)


def _qwen_image(zero_cond_t: bool = False):
    """Qwen-Image; ``zero_cond_t``: its edit variant, a condition image's tokens appended, each token's
    scale, shift and gate selected from two sets by ``torch.where`` (per token)."""
    model = _make("QwenImageTransformer2DModel", patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                  attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
                  axes_dims_rope=(8, 4, 4), zero_cond_t=zero_cond_t)
    h = w = 4
    images = 2 if zero_cond_t else 1
    shapes = [[(1, h, w)] * images] if zero_cond_t else [(1, h, w)]
    return model, dict(hidden_states=_randn(1, images * h * w, 16), encoder_hidden_states=_randn(1, 8, 16, seed=2),
                       encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]),
                       img_shapes=shapes, return_dict=False)


def _z_image():
    model = _make("ZImageTransformer2DModel", all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32,
                  n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, qk_norm=True, cap_feat_dim=16,
                  rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32])
    return model, dict(x=[_randn(16, 1, 8, 8)], cap_feats=[_randn(16, 16, seed=2)], t=torch.tensor([0.5]),
                       return_dict=False)


def _chroma():
    """Chroma: Flux's blocks with the modulation from a distilled approximator (no pooled projection)."""
    model = _make("ChromaTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 4, 8),
                  approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1)
    h = w = 4
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(h), torch.arange(w)).float()
    return model, dict(hidden_states=_randn(1, h * w, 4), encoder_hidden_states=_randn(1, 8, 32, seed=2),
                       timestep=torch.tensor([1.0]), img_ids=img_ids, txt_ids=torch.zeros(8, 3), return_dict=False)


def _skyreels_v2():
    """SkyReels V2: Wan's blocks (its q/k norm over all heads, the stored RoPE)."""
    model = _make("SkyReelsV2Transformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    return model, dict(hidden_states=_randn(1, 4, 2, 8, 8), timestep=torch.tensor([700]),
                       encoder_hidden_states=_randn(1, 8, 16, seed=2), return_dict=False)


def _auraflow():
    model = _make("AuraFlowTransformer2DModel", sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1,
                  num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                  caption_projection_dim=16, out_channels=4, pos_embed_max_size=64)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 6, 16, seed=2),
                       timestep=torch.tensor([3, 500]), return_dict=False)


def _cogview4():
    model = _make("CogView4Transformer2DModel", patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
                  num_attention_heads=4, out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4)
    size = torch.tensor([[64, 64]] * 2)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 6, 8, seed=2),
                       timestep=torch.tensor([3, 500]), original_size=size, target_size=size,
                       crop_coords=torch.tensor([[0, 0]] * 2), return_dict=False)


def _lumina2():
    model = _make("Lumina2Transformer2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=24,
                  num_layers=2, num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
                  norm_eps=1e-5, axes_dim_rope=(4, 2, 2), axes_lens=(10, 32, 32), cap_feat_dim=8)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), timestep=torch.tensor([0.3, 0.5]),
                       encoder_hidden_states=_randn(2, 6, 8, seed=2),
                       encoder_attention_mask=torch.ones(2, 6, dtype=torch.bool), return_dict=False)


def _mochi():
    """Mochi: its modulated RMSNorms (``norm(x) * scale`` in fp32, cast back), the gate a norm's scale."""
    model = _make("MochiTransformer3DModel", patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2,
                  pooled_projection_dim=16, in_channels=4, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
                  activation_fn="swiglu", max_sequence_length=16)
    return model, dict(hidden_states=_randn(2, 4, 2, 8, 8), encoder_hidden_states=_randn(2, 6, 16, seed=2),
                       timestep=torch.tensor([3, 500]), encoder_attention_mask=torch.ones(2, 6, dtype=torch.bool),
                       return_dict=False)


def _easyanimate():
    """EasyAnimate: the text and the image q/k LayerNorms concatenated, the image rows' RoPE stored
    back into the cat (``q[:, :, T:] = rope(q[:, :, T:])``)."""
    model = _make("EasyAnimateTransformer3DModel", num_attention_heads=2, attention_head_dim=16, in_channels=4,
                  out_channels=4, time_embed_dim=16, text_embed_dim=16, num_layers=2, mmdit_layers=2, sample_width=8,
                  sample_height=8, patch_size=2)
    return model, dict(hidden_states=_randn(1, 4, 2, 8, 8), timestep=torch.tensor([500.0]),
                       encoder_hidden_states=_randn(1, 8, 16, seed=2), return_dict=False)


def _hunyuan_image():
    """HunyuanImage 2.1: HunyuanVideo's blocks (the single stream's RoPE of the image tokens only)."""
    model = _make("HunyuanImageTransformer2DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=16, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1),
                  text_embed_dim=16, rope_axes_dim=(8, 8))
    return model, dict(hidden_states=_randn(1, 4, 4, 4), timestep=torch.tensor([500.0]),
                       encoder_hidden_states=_randn(1, 8, 16, seed=2), encoder_attention_mask=torch.ones(1, 8),
                       return_dict=False)



def _cosmos():
    # Cosmos-Predict2 (no learnable position embedding; Cosmos 1.0's normalizes its table with
    # vector_norm(dtype=float32), which an fp64 copy of the model cannot run): the q/k RoPE in the
    # unbind(-2) / cat form, read per head
    model = _make("CosmosTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2,
                  attention_head_dim=12, num_layers=2, mlp_ratio=2, text_embed_dim=16, adaln_lora_dim=4,
                  max_size=(4, 32, 32), patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True,
                  extra_pos_embed_type=None)
    return model, dict(hidden_states=_randn(1, 4, 1, 16, 16), timestep=torch.tensor([500]),
                       encoder_hidden_states=_randn(1, 12, 16, seed=2), attention_mask=torch.ones(1, 12),
                       fps=30, padding_mask=torch.zeros(1, 1, 16, 16), return_dict=False)


def _lumina_next():
    # the q/k norms over all heads, then the complex RoPE per head (freqs_cis as the pipeline builds it)
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    model = _make("LuminaNextDiT2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=2,
                  num_attention_heads=3, num_kv_heads=1, multiple_of=16, ffn_dim_multiplier=None, norm_eps=1e-5,
                  learn_sigma=False, qk_norm=True, cross_attention_dim=32, scaling_factor=1.0)
    return model, dict(hidden_states=_randn(2, 4, 16, 16), encoder_hidden_states=_randn(2, 16, 32, seed=2),
                       timestep=torch.tensor([0.3, 0.7]), encoder_mask=torch.ones(2, 16),
                       image_rotary_emb=get_2d_rotary_pos_embed_lumina(8, 384, 384), cross_attention_kwargs={},
                       return_dict=False)


def _hunyuan_dit():
    # the RoPE table of a 4 x 4 grid of patches as the pipeline builds it for a square image: the grid's
    # crop region of the 32 x 32 base is the whole base
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model = _make("HunyuanDiT2DModel", sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                  num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4,
                  hidden_size=16, text_len=4, text_len_t5=4, activation_fn="gelu-approximate")
    rope = get_2d_rotary_pos_embed(8, ((0, 0), (32, 32)), (4, 4), output_type="pt")
    return model, dict(hidden_states=_randn(2, 4, 8, 8), timestep=torch.tensor([3.0, 500.0]),
                       encoder_hidden_states=_randn(2, 4, 8, seed=2), text_embedding_mask=torch.ones(2, 4),
                       encoder_hidden_states_t5=_randn(2, 4, 8, seed=3), text_embedding_mask_t5=torch.ones(2, 4),
                       image_meta_size=torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * 2),
                       style=torch.zeros(2, dtype=torch.long), image_rotary_emb=rope, return_dict=False)


def _latte():
    # spatial and temporal blocks: the stream reordered between them (reshape, permute, reshape)
    model = _make("LatteTransformer3DModel", sample_size=8, num_layers=2, patch_size=2, attention_head_dim=4,
                  num_attention_heads=2, caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8,
                  attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=1000,
                  norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)
    return model, dict(hidden_states=_randn(2, 4, 1, 8, 8), encoder_hidden_states=_randn(2, 8, 8, seed=2),
                       timestep=torch.tensor([3, 500]), enable_temporal_attentions=True, return_dict=False)


def _cogview3plus():
    model = _make("CogView3PlusTransformer2DModel", patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
                  num_attention_heads=2, out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=2,
                  pos_embed_max_size=8, sample_size=8)
    size = torch.tensor([[64, 64]] * 2)
    return model, dict(hidden_states=_randn(2, 4, 8, 8), encoder_hidden_states=_randn(2, 8, 8, seed=2),
                       original_size=size, target_size=size, crop_coords=torch.tensor([[0, 0]] * 2),
                       timestep=torch.tensor([3, 500]), return_dict=False)


def _ltx2():
    # video and audio streams; the video norm modulated twice, for the audio-to-video attention's q and the
    # video-to-audio attention's k (one q/k call pairs the norms that share the video RoPE table)
    model = _make("LTX2VideoTransformer3DModel", in_channels=4, out_channels=4, patch_size=1, patch_size_t=1,
                  num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16, audio_in_channels=4,
                  audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
                  audio_cross_attention_dim=8, num_layers=2, qk_norm="rms_norm_across_heads", caption_channels=16,
                  rope_double_precision=False)
    frames, h, w = 2, 4, 4
    return model, dict(hidden_states=_randn(1, frames * h * w, 4), audio_hidden_states=_randn(1, 9, 4, seed=2),
                       encoder_hidden_states=_randn(1, 8, 16, seed=3),
                       audio_encoder_hidden_states=_randn(1, 8, 16, seed=4), timestep=torch.tensor([500.0]),
                       encoder_attention_mask=torch.ones(1, 8, dtype=torch.bool), num_frames=frames, height=h,
                       width=w, audio_num_frames=9, fps=25.0, return_dict=False)


def _bria():
    model = _make("BriaTransformer2DModel", patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                  attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=None,
                  axes_dims_rope=[0, 4, 4])
    img_ids = torch.cartesian_prod(torch.arange(1), torch.arange(4), torch.arange(4)).float()
    return model, dict(hidden_states=_randn(1, 16, 4), encoder_hidden_states=_randn(1, 8, 32, seed=2),
                       img_ids=img_ids, txt_ids=torch.zeros(8, 3), timestep=torch.tensor([1.0]), return_dict=False)


def _wan_vace():
    # control hints added into the stream after blocks 0 and 2
    model = _make("WanVACETransformer3DModel", patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=4,
                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32, vace_layers=[0, 2],
                  vace_in_channels=12)
    return model, dict(hidden_states=_randn(1, 4, 2, 8, 8), encoder_hidden_states=_randn(1, 8, 16, seed=2),
                       control_hidden_states=_randn(1, 12, 2, 8, 8, seed=3), timestep=torch.tensor([700]),
                       return_dict=False)


def _ace_step():
    # the stream is a conv's output transposed (channels first in memory); diffusers' RMSNorm written out
    model = _make("AceStepTransformer1DModel", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=16, in_channels=24,
                  audio_acoustic_hidden_dim=8, patch_size=2, rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=16)
    return model, dict(hidden_states=_randn(1, 8, 8), timestep=torch.tensor([0.6]), timestep_r=torch.tensor([0.3]),
                       encoder_hidden_states=_randn(1, 6, 32, seed=2), context_latents=_randn(1, 8, 16, seed=3),
                       return_dict=False)


def _sana_wm():
    # SANA's linear attention with a camera branch; the stream a patch embedder's flatten(2).transpose(1, 2)
    model = _make("SanaWMTransformer3DModel", in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2,
                  patch_size=(1, 1, 1), softmax_every_n=2, linear_head_dim=16, t_kernel_size=3, conv_kernel_size=4,
                  caption_channels=8, mlp_ratio=2.0, chunk_plucker_channels=8, chunk_plucker_post_attn_blocks=2)
    b, f, h, w = 1, 4, 4, 4
    c2w = torch.eye(4).repeat(b, f, 1, 1)
    c2w[..., 2, 3] = torch.arange(f, dtype=torch.float32) * 0.1
    camera = torch.cat([c2w.flatten(start_dim=-2), torch.tensor([float(w), float(h), w / 2, h / 2]).expand(b, f, 4)],
                       dim=-1)
    return model, dict(hidden_states=_randn(b, 4, f, h, w), timestep=torch.tensor([[[100.0, 300.0, 500.0, 700.0]]]),
                       encoder_hidden_states=_randn(b, 1, 8, 8, seed=2),
                       encoder_attention_mask=torch.ones(b, 8, dtype=torch.long), camera_conditions=camera,
                       chunk_plucker=_randn(b, 8, f, h, w, seed=4), return_dict=False)


DIFFUSION: dict[str, DiffusionModel] = {m.name: m for m in [
    DiffusionModel("dit", "DiTTransformer2DModel", "DiT", _dit),
    DiffusionModel("pixart_alpha", "PixArtTransformer2DModel", "PixArt", lambda: _pixart(alpha=True)),
    DiffusionModel("pixart_sigma", "PixArtTransformer2DModel", "PixArt", lambda: _pixart(alpha=False)),
    DiffusionModel("sd3", "SD3Transformer2DModel", "SD3", lambda: _sd3(dual=False)),
    DiffusionModel("sd35_medium", "SD3Transformer2DModel", "SD3", lambda: _sd3(dual=True)),
    DiffusionModel("flux", "FluxTransformer2DModel", "Flux", _flux, ("num_layers", "num_single_layers")),
    DiffusionModel("flux2", "Flux2Transformer2DModel", "Flux", _flux2, ("num_layers", "num_single_layers")),
    DiffusionModel("wan21", "WanTransformer3DModel", "Wan", lambda: _wan(per_token=False)),
    DiffusionModel("wan22_ti2v", "WanTransformer3DModel", "Wan", lambda: _wan(per_token=True)),
    DiffusionModel("cogvideox", "CogVideoXTransformer3DModel", "CogVideoX", lambda: _cogvideox(rope=False)),
    DiffusionModel("cogvideox15", "CogVideoXTransformer3DModel", "CogVideoX", lambda: _cogvideox(rope=True)),
    DiffusionModel("ltx_video", "LTXVideoTransformer3DModel", "LTX-Video", _ltx),
    DiffusionModel("hunyuan_video", "HunyuanVideoTransformer3DModel", "HunyuanVideo", _hunyuan_video,
                   ("num_layers", "num_single_layers")),
    DiffusionModel("hunyuan_video_i2v", "HunyuanVideoTransformer3DModel", "HunyuanVideo",
                   lambda: _hunyuan_video(token_replace=True), ("num_layers", "num_single_layers")),
    DiffusionModel("sana", "SanaTransformer2DModel", "Sana", _sana),
    DiffusionModel("qwen_image", "QwenImageTransformer2DModel", "Qwen-Image", _qwen_image),
    DiffusionModel("qwen_image_edit", "QwenImageTransformer2DModel", "Qwen-Image", lambda: _qwen_image(zero_cond_t=True)),
    DiffusionModel("z_image", "ZImageTransformer2DModel", "Z-Image", _z_image, ("n_layers",)),
    DiffusionModel("chroma", "ChromaTransformer2DModel", "Chroma", _chroma, ("num_layers", "num_single_layers")),
    DiffusionModel("skyreels_v2", "SkyReelsV2Transformer3DModel", "SkyReels", _skyreels_v2),
    DiffusionModel("auraflow", "AuraFlowTransformer2DModel", "AuraFlow", _auraflow,
                   ("num_mmdit_layers", "num_single_dit_layers")),
    DiffusionModel("cogview4", "CogView4Transformer2DModel", "CogView4", _cogview4),
    DiffusionModel("lumina2", "Lumina2Transformer2DModel", "Lumina2", _lumina2),
    DiffusionModel("mochi", "MochiTransformer3DModel", "Mochi", _mochi),
    DiffusionModel("easyanimate", "EasyAnimateTransformer3DModel", "EasyAnimate", _easyanimate),
    DiffusionModel("hunyuan_image", "HunyuanImageTransformer2DModel", "HunyuanImage", _hunyuan_image,
                   ("num_layers", "num_single_layers")),
    DiffusionModel("cosmos", "CosmosTransformer3DModel", "Cosmos", _cosmos),
    DiffusionModel("lumina_next", "LuminaNextDiT2DModel", "Lumina", _lumina_next),
    DiffusionModel("hunyuan_dit", "HunyuanDiT2DModel", "HunyuanDiT", _hunyuan_dit),
    DiffusionModel("latte", "LatteTransformer3DModel", "Latte", _latte),
    DiffusionModel("cogview3plus", "CogView3PlusTransformer2DModel", "CogView3", _cogview3plus),
    DiffusionModel("ltx2", "LTX2VideoTransformer3DModel", "LTX-Video", _ltx2),
    DiffusionModel("bria", "BriaTransformer2DModel", "Bria", _bria, ("num_layers", "num_single_layers")),
    DiffusionModel("wan_vace", "WanVACETransformer3DModel", "Wan", _wan_vace),
    DiffusionModel("ace_step", "AceStepTransformer1DModel", "AceStep", _ace_step, ("num_hidden_layers",)),
    DiffusionModel("sana_wm", "SanaWMTransformer3DModel", "Sana", _sana_wm),
]}


def build(name: str) -> tuple[nn.Module, dict[str, Any]]:
    """``(model, kwargs)`` of a zoo entry; ``prediction(model(**kwargs))`` is its prediction."""
    return DIFFUSION[name].build()


def prediction(out: Any) -> torch.Tensor:
    """The denoiser's prediction out of ``model(..., return_dict=False)``: the first output (Z-Image's is
    a list of one tensor per sample, stacked here)."""
    first = out[0]
    return torch.stack(list(first)) if isinstance(first, (list, tuple)) else first


# --------------------------------------------------------------------------- elementwise passes

_ARITH = ("add", "sub", "rsub", "mul", "div", "truediv", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh",
          "sigmoid", "erf", "abs", "cos", "sin", "square", "reciprocal", "clamp", "clamp_min", "clamp_max",
          "where", "addcmul", "addcdiv", "lerp", "masked_fill", "maximum", "minimum", "floordiv", "mod",
          "iadd", "isub", "imul", "itruediv", "add_", "sub_", "mul_", "div_", "addcmul_", "masked_fill_")
_ACTIVATIONS = ("gelu", "silu", "relu", "mish", "softplus", "hardswish", "leaky_relu", "elu")
_NORMS = ("layer_norm", "rms_norm", "group_norm", "instance_norm")
_CASTS = ("to", "float", "half", "bfloat16", "double", "type", "type_as")
POINTWISE = frozenset(_ARITH + _ACTIVATIONS + _NORMS)


def _name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        target = node.target
        if target in (operator.getitem, getattr):
            return None
        return getattr(target, "__name__", str(target)).rsplit(".", 1)[-1]
    return None


def _value(node: Any) -> Any:
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def _numel(node: fx.Node) -> int:
    value = _value(node)
    if isinstance(value, torch.Tensor):
        return int(value.numel())
    if isinstance(value, (tuple, list)):
        return max((int(v.numel()) for v in value if isinstance(v, torch.Tensor)), default=0)
    return 0


def activation_numel(gm: fx.GraphModule) -> int | None:
    """The activation's numel in a captured graph: the smallest input of a token-wise norm.

    A norm is a call of layer_norm / rms_norm / group_norm, or a decomposed norm's statistic
    (``mean`` over the last dim with ``keepdim``); token-wise means its rows (numel / last dim)
    outnumber the batch, so a norm of a per-sample vector (a pooled or timestep embedding) does
    not set the size. None when the graph holds no norm."""
    sizes = []
    for node in gm.graph.nodes:
        name = _name(node)
        if name in _NORMS or (name == "mean" and (node.kwargs.get("keepdim") or
                                                   (len(node.args) > 2 and node.args[2] is True))):
            x = _value(node.args[0]) if node.args else None
            if isinstance(x, torch.Tensor) and x.dim() >= 3:
                sizes.append(int(x.numel()))
    return min(sizes) if sizes else None


_PROJECTIONS = ("linear", "conv1d", "conv2d", "conv3d", "matmul", "bmm", "baddbmm", "addmm", "einsum",
                "scaled_dot_product_attention")


def _projected(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes with a projection (linear, conv, matmul, attention) among their ancestors: the
    activations the network computes, as opposed to tables made from its small inputs (a RoPE's
    cos/sin from the position ids, the sinusoidal projection of the timestep)."""
    seen: set[fx.Node] = set()
    for node in gm.graph.nodes:  # topological order
        if _name(node) in _PROJECTIONS or any(a in seen for a in node.all_input_nodes):
            seen.add(node)
    return seen


def elementwise_passes(gm: fx.GraphModule, threshold: int) -> int:
    """Elementwise passes over activation-sized tensors in one captured graph.

    Counts the call nodes (``call_function`` / ``call_method``) of the graph as dynamo captured it
    (torch-level ops; after the pass, the same graph with fused calls in it) that
    - are pointwise (``POINTWISE``: ``+ - * /``, pow, rsqrt, exp, tanh, where, addcmul, ...;
      activations; the norm calls layer_norm / rms_norm / group_norm, one pass each) or a cast that
      changes the dtype (``to``, ``float``, ``type_as``, ...; a cast to the dtype a value already has
      launches nothing and is not counted),
    - have an output of ``threshold`` elements or more, read off the node's ``example_value``
      (``threshold``: ``activation_numel`` of the graph before the pass), and
    - lie on the activation path: a projection (linear, conv, matmul, attention) among their
      ancestors, so tables computed from small inputs (RoPE cos/sin, timestep sinusoids) are not
      counted however large they are at a small config.
    A fused call of normfuse (``normfuse.passes.record.is_fused_call``) counts as one pass, whatever it
    returns. Reductions (``mean``, ``sum``), matmuls and linears, attention, softmax, views,
    ``getitem`` and data movement (``cat``, ``stack``, ``contiguous``, ``clone``) are not counted,
    nor anything smaller than the activation: modulation parameters (``1 + scale`` of [B, 1, C]),
    a norm's rstd column.
    """
    from normfuse.passes.record import is_fused_call

    projected = _projected(gm)
    count = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        if is_fused_call(node):
            count += 1
            continue
        name = _name(node)
        if name is None or node not in projected or _numel(node) < threshold:
            continue
        if name in POINTWISE:
            count += 1
        elif name in _CASTS:
            x, y = _value(node.args[0]) if node.args else None, _value(node)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype != y.dtype:
                count += 1
    return count


# --------------------------------------------------------------------------- one model

def _grads(model: nn.Module, out: torch.Tensor, seed: int = 7) -> dict[str, torch.Tensor | None]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    out.backward(g)
    return {k: p.grad for k, p in model.named_parameters()}


def _double(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_double(v) for v in value)
    if isinstance(value, dict):
        return {k: _double(v) for k, v in value.items()}
    return value


def _grads_within(model: nn.Module, kwargs: dict[str, Any], eager: dict, optimized: dict) -> bool:
    """Every parameter's gradient of the optimized model within the tolerance table
    (normfuse/tolerances.py) against an fp64 copy of the model, eager fp32 the baseline."""
    from normfuse.tolerances import within_tolerance

    reference = copy.deepcopy(model).double()
    grads = _grads(reference, prediction(reference(**_double(kwargs))))
    return all(within_tolerance(optimized[k], eager[k], grads[k])[0]
               for k in eager if eager[k] is not None and optimized.get(k) is not None)


def _captured(model: nn.Module, kwargs: dict[str, Any]) -> tuple[list[fx.GraphModule], int]:
    """The graphs dynamo captures of the untouched model (training mode: grad on), and the
    activation's numel in them (``activation_numel``, the threshold of ``elementwise_passes``)."""
    from normfuse.capture import record_graphs

    with torch.no_grad():  # a first eager call fills the caches a model keeps (Z-Image's RoPE tables), so
        model(**kwargs)    # both captures see the same code paths
    # each capture in a fresh dynamo: a frame compiled once (a function a graph break leaves) is not
    # handed to the second backend
    torch._dynamo.reset()
    graphs = [gm for gm, _ in record_graphs(model, (), kwargs, grad=True)]
    torch._dynamo.reset()
    sizes = [n for n in map(activation_numel, graphs) if n is not None]
    return graphs, min(sizes) if sizes else 1


def _rewritten(report) -> list[fx.GraphModule]:
    return list({id(gm): gm for gm in report.graph_modules if gm is not None}.values())


def passes(model: nn.Module, kwargs: dict[str, Any]) -> tuple[int, int]:
    """``elementwise_passes`` summed over the graphs dynamo captures: before the pass (an untouched
    capture) and after it (the optimized model's rewritten graphs)."""
    import normfuse

    before, threshold = _captured(model, kwargs)
    optimized = normfuse.optimize(copy.deepcopy(model))
    optimized(**kwargs)
    after = _rewritten(normfuse.report(optimized))
    return (sum(elementwise_passes(gm, threshold) for gm in before),
            sum(elementwise_passes(gm, threshold) for gm in after))


def per_block(name: str) -> dict[str, tuple[int, int]]:
    """The passes one more block adds, before and after the pass, per kind of block (the config key
    that counts it: ``num_layers``, Flux's ``num_single_layers``, ...): the model built as the zoo
    builds it and with one block more of that kind, the difference of ``passes``. What a deep model
    (Flux-dev: 19 double and 38 single blocks) spends per block, without the first and last blocks'
    boundary (embeddings, the output norm, a last text stream nothing reads)."""
    base = passes(*build(name))
    out = {}
    for key in DIFFUSION[name].blocks:
        _MORE_BLOCKS[key] = 1
        try:
            deeper = passes(*build(name))
        finally:
            _MORE_BLOCKS.pop(key)
        out[key] = (deeper[0] - base[0], deeper[1] - base[1])
    return out


def measure(name: str) -> dict[str, Any]:
    """What tests/test_diffusion_zoo.py asserts about one model, as plain data.

    norms, fused, fused_with_add: the report of ``normfuse.optimize`` (its counts()); modulation,
    gated: the adaLN modulations and gated residual branches found and those their calls take; equal: the
    optimized prediction ``torch.equal`` to eager's (fp32, CPU: the reference path); grads, after one
    backward of the same cotangent: "equal" (every parameter's gradient ``torch.equal`` to eager's),
    "within" (not all equal, all within the tolerance table against an fp64 copy) or "FAILS";
    passes: ``(before, after)``, ``elementwise_passes`` summed over the graphs dynamo captures,
    before the pass (an untouched capture) and after it (the optimized model's rewritten graphs);
    unfused / add_reasons: the report's reasons for norms left and adds left outside their call;
    rope_refused: the norms followed by a RoPE their call does not take (each with the reason)."""
    import normfuse

    start = time.perf_counter()
    model, kwargs = build(name)
    before, threshold = _captured(model, kwargs)
    optimized = normfuse.optimize(copy.deepcopy(model))
    out_eager, out_opt = prediction(model(**kwargs)), prediction(optimized(**kwargs))
    grads_eager, grads_opt = _grads(model, out_eager), _grads(optimized, out_opt)
    same = grads_eager.keys() == grads_opt.keys() and all(
        (a is None) == (b is None) for a, b in zip(grads_eager.values(), grads_opt.values()))
    if same and all(a is None or torch.equal(a, grads_opt[k]) for k, a in grads_eager.items()):
        grads = "equal"
    else:
        grads = "within" if same and _grads_within(model, kwargs, grads_eager, grads_opt) else "FAILS"
    report = normfuse.report(optimized)
    after = _rewritten(report)
    c = report.counts()
    return {"norms": c["sites"], "fused": c["fused"], "fused_with_add": c["fused_with_add"],
            "input_is_add": c["input_is_add"], "rope": c["rope"], "fused_rope": c["fused_rope"],
            "rope_refused": sum(bool(s.rope_reason) for s in report.sites),
            "modulation": (c["modulated"], c["fused_modulation"]),
            "gated": (c["gated_residual"], c["fused_gated_residual"]),
            "equal": torch.equal(out_eager, out_opt), "grads": grads,
            "passes": (sum(elementwise_passes(gm, threshold) for gm in before),
                       sum(elementwise_passes(gm, threshold) for gm in after)),
            "graphs": (len(before), len(after)), "activation": threshold,
            "unfused": sorted({s.reason or "(no reason)" for s in report.unfused}),
            "add_reasons": sorted({s.add_reason for s in report.sites
                                   if s.fused and s.input_is_add and not s.fused_add and s.add_reason}),
            "not_captured": list(report.uncaptured), "report": report,
            "seconds": round(time.perf_counter() - start, 2)}


def _bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _bf16(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_bf16(v) for v in value)
    return value


def measure_bf16(name: str) -> dict[str, Any]:
    """The model and its inputs in bf16 (the dtype these models run in): whether the optimized
    prediction is ``torch.equal`` to eager's (CPU: the reference path), and the report's counts."""
    import normfuse

    model, kwargs = build(name)
    model, kwargs = model.to(torch.bfloat16), _bf16(kwargs)
    with torch.no_grad():
        want = prediction(model(**kwargs))
        torch._dynamo.reset()
        optimized = normfuse.optimize(copy.deepcopy(model))
        got = prediction(optimized(**kwargs))
    c = normfuse.report(optimized).counts()
    return {"equal": torch.equal(got, want), "fused": c["fused"], "fused_with_add": c["fused_with_add"],
            "fused_rope": c["fused_rope"],
            "modulation": (c["modulated"], c["fused_modulation"]),
            "gated": (c["gated_residual"], c["fused_gated_residual"])}
