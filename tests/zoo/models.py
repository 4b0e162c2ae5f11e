"""The zoo: every model the suite tries normfuse on, built offline and small.

Each entry is a name ("hf:llama", "timm:convnext_atto", "tv:swin_t", "nn:transformer_pre") and a
builder returning ``(model, args, kwargs)``: the model in eval mode with random weights (fixed
seed), and inputs that stay small (batch 2, 8 tokens, 32x32 images) so the whole zoo runs on a
laptop CPU. HF families are built from their configs by ``normfuse.zoo.hf_model`` (2 layers,
hidden 64, vocab 128); the overrides below shrink what its generic table does not reach
(vision stages, window sizes, expert counts) or make the family build at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from normfuse.zoo import example_inputs, hf_config, hf_model

# --------------------------------------------------------------------------- HF families

MOE = dict(num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1)
HC_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, qk_head_dim=32,
              o_lora_rank=32, index_topk=8, index_head_dim=16, index_n_heads=2, num_key_value_heads=4)
SWIN = dict(embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=4, image_size=32, patch_size=4)
STAGES = dict(hidden_sizes=[16, 32], depths=[1, 1], image_size=32, num_stages=2)

# family -> (group, config overrides beyond normfuse.zoo.TINY_HF)
HF_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # encoders
    "bert": ("encoder", {}), "roberta": ("encoder", {}), "albert": ("encoder", dict(embedding_size=32)),
    "distilbert": ("encoder", dict(dim=64, hidden_dim=128, n_heads=4)), "electra": ("encoder", dict(embedding_size=64)),
    "deberta": ("encoder", {}), "deberta-v2": ("encoder", {}), "xlm-roberta": ("encoder", {}),
    "camembert": ("encoder", {}), "mpnet": ("encoder", {}), "ernie": ("encoder", {}), "roformer": ("encoder", dict(embedding_size=64)),
    "convbert": ("encoder", dict(embedding_size=64)), "megatron-bert": ("encoder", {}), "esm": ("encoder", dict(pad_token_id=1)),
    "data2vec-text": ("encoder", {}), "rembert": ("encoder", dict(input_embedding_size=64, output_embedding_size=64)),
    "modernbert": ("encoder", dict(global_attn_every_n_layers=2, local_attention=16)),
    "roberta-prelayernorm": ("encoder", {}), "xlm-roberta-xl": ("encoder", {}), "mobilebert": ("encoder", dict(
        embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=1)),
    "nomic_bert": ("encoder", {}), "eurobert": ("encoder", {}),
    # q/k LayerNorms over all heads, before the view to heads and the RoPE; its k_norm is sized hidden_size,
    # so as many k heads as q heads
    "esmc": ("encoder", dict(num_key_value_heads=4)),
    # decoders
    "gpt2": ("decoder", {}), "gpt_neo": ("decoder", dict(attention_types=[[["global", "local"], 1]], window_size=16)),
    "gptj": ("decoder", dict(rotary_dim=8)), "gpt_neox": ("decoder", {}), "llama": ("decoder", {}),
    "mistral": ("decoder", {}), "qwen2": ("decoder", {}), "qwen3": ("decoder", {}), "phi": ("decoder", {}),
    "phi3": ("decoder", {}), "gemma": ("decoder", {}), "gemma2": ("decoder", {}), "gemma3_text": ("decoder", {}),
    "falcon": ("decoder", {}), "bloom": ("decoder", {}), "opt": ("decoder", dict(word_embed_proj_dim=64, ffn_dim=128)),
    "codegen": ("decoder", dict(rotary_dim=8)), "stablelm": ("decoder", {}), "starcoder2": ("decoder", {}),
    "olmo": ("decoder", {}), "olmo2": ("decoder", {}), "cohere": ("decoder", {}), "cohere2": ("decoder", {}),
    "granite": ("decoder", {}), "mpt": ("decoder", dict(d_model=64, n_heads=4, n_layers=2)),
    "persimmon": ("decoder", {}), "biogpt": ("decoder", {}), "xglm": ("decoder", dict(ffn_dim=128)),
    "ctrl": ("decoder", dict(dff=128)), "gpt_bigcode": ("decoder", {}), "helium": ("decoder", {}),
    "glm": ("decoder", {}), "glm4": ("decoder", {}), "nemotron": ("decoder", {}), "smollm3": ("decoder", {}),
    "exaone4": ("decoder", {}), "arcee": ("decoder", {}), "seed_oss": ("decoder", {}),
    "hunyuan_v1_dense": ("decoder", {}), "ernie4_5": ("decoder", {}), "apertus": ("decoder", {}),
    "bitnet": ("decoder", {}), "openai-gpt": ("decoder", {}), "vaultgemma": ("decoder", {}),
    "diffllama": ("decoder", {}), "internlm3": ("decoder", {}),
    # q/k norms and their RoPE: on the sliding-window layers only (Flint); RoPE before weightless norms
    # (nanochat); one weightless norm module for q and k, q scaled before its RoPE (Muse Glimmer)
    "flint": ("decoder", dict(layer_types=["sliding_attention", "full_attention"], sliding_window=16)),
    "nanochat": ("decoder", {}), "muse_glimmer_text": ("decoder", {}),
    # mixtures of experts
    "mixtral": ("moe", MOE), "qwen2_moe": ("moe", dict(MOE, shared_expert_intermediate_size=32)),
    "qwen3_moe": ("moe", MOE), "olmoe": ("moe", MOE), "granitemoe": ("moe", MOE), "jetmoe": ("moe", MOE),
    "phimoe": ("moe", MOE),
    "ernie4_5_moe": ("moe", MOE), "gpt_oss": ("moe", MOE), "dots1": ("moe", MOE),
    # q/k norms: GLM-4 MoE's behind an option (partial rotary), Llama 4's an L2 norm after its complex RoPE,
    # MiniMax-M2's over all heads before the view to heads, Laguna's with a partial rotary
    "glm4_moe": ("moe", dict(MOE, use_qk_norm=True)), "llama4_text": ("moe", MOE), "minimax_m2": ("moe", MOE),
    "afmoe": ("moe", MOE),
    "laguna": ("moe", dict(MOE, shared_expert_intermediate_size=32, num_attention_heads_per_layer=[4, 4],
                           layer_types=["full_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])),
    # no RoPE at all (relative logits), k through a short conv with its own residual add
    "inkling_text": ("moe", dict(MOE, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                                 sliding_window_size=16, rel_extent=16)),
    # hyper-connections: 4 residual streams collapsed by a weighted sum into each block's norm
    # (the norm fused alone, the site says why), MLA latents shrunk
    "deepseek_v4": ("moe", dict(MOE, **HC_MLA)), "hy_v4": ("moe", dict(MOE, **HC_MLA)),
    "glm5_next_text": ("moe", dict(MOE, **HC_MLA)),
    # hybrids (recurrent / state-space layers next to attention) and recurrent models
    "jamba": ("hybrid", dict(MOE, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                             expert_layer_offset=1, mamba_d_state=8, mamba_expand=2, use_mamba_kernels=False)),
    "bamba": ("hybrid", dict(mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                             attn_layer_indices=[1])),
    "falcon_h1": ("hybrid", dict(mamba_d_state=8, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                                 mamba_d_ssm=128)),
    "mamba": ("hybrid", dict(state_size=8)), "mamba2": ("hybrid", dict(state_size=8, num_heads=8, head_dim=16,
                                                                       n_groups=1)),
    # gated norms: statistics per group of columns (NemotronH's 8 groups), the gate after the norm
    "nemotron_h": ("hybrid", dict(hidden_size=64, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
                                  ssm_state_size=8)),
    "qwen3_next": ("hybrid", {}),
    "recurrent_gemma": ("hybrid", dict(lru_width=64, block_types=["recurrent", "attention"], attention_window_size=16)),
    "lfm2": ("hybrid", dict(layer_types=["conv", "full_attention"], block_ff_dim=128, block_auto_adjust_ff_dim=False)),
    "lfm2_moe": ("hybrid", dict(MOE, layer_types=["conv", "full_attention"])),
    "rwkv": ("hybrid", dict(attention_hidden_size=64, context_length=32)),
    # encoder-decoders
    "t5": ("encoder-decoder", {}), "bart": ("encoder-decoder", {}), "mbart": ("encoder-decoder", {}),
    "pegasus": ("encoder-decoder", {}), "marian": ("encoder-decoder", dict(decoder_vocab_size=128)),
    "blenderbot": ("encoder-decoder", {}), "blenderbot-small": ("encoder-decoder", {}), "mt5": ("encoder-decoder", {}),
    "umt5": ("encoder-decoder", {}), "longt5": ("encoder-decoder", {}), "plbart": ("encoder-decoder", {}),
    "m2m_100": ("encoder-decoder", {}), "led": ("encoder-decoder", dict(attention_window=8)),
    "switch_transformers": ("encoder-decoder", dict(num_experts=4, num_sparse_encoder_layers=1,
                                                    num_sparse_decoder_layers=1)),
    "fsmt": ("encoder-decoder", dict(src_vocab_size=128, tgt_vocab_size=128)),
    "whisper": ("encoder-decoder", dict(num_mel_bins=16, max_source_positions=16, max_target_positions=32)),
    # vision
    "vit": ("vision", {}), "deit": ("vision", {}), "beit": ("vision", {}), "data2vec-vision": ("vision", {}),
    "dinov2": ("vision", {}), "vit_msn": ("vision", {}), "ijepa": ("vision", {}), "vit_mae": ("vision", {}),
    "swin": ("vision", SWIN), "swinv2": ("vision", SWIN), "donut-swin": ("vision", SWIN),
    "convnext": ("vision", STAGES), "convnextv2": ("vision", STAGES),
    "segformer": ("vision", dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                                 num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], image_size=32)),
    "pvt_v2": ("vision", dict(hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2, sr_ratios=[2, 1],
                              num_attention_heads=[1, 2], patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2],
                              image_size=32)),
    "dinov2_with_registers": ("vision", {}), "siglip_vision_model": ("vision", {}),
    "clip_vision_model": ("vision", {}),
    "dinov3_vit": ("vision", {}),
    # a block ends NCHW, the next begins NHWC: the inverse permutes between the add and the norm cancel
    "vitdet": ("vision", {}),
    "focalnet": ("vision", dict(embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
                                                               focal_windows=[3, 3], image_size=32, patch_size=4)),
}


def _videoprism():
    """VideoPrism's video encoder: one forward loops over two block lists (spatial, then temporal
    layers), each ending in its own norm."""
    import transformers

    config = hf_config("videoprism").vision_config
    for key, value in dict(hidden_size=64, num_spatial_layers=2, num_temporal_layers=2, num_attention_heads=4,
                           intermediate_size=128, image_size=32, num_frames=2).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.VideoPrismVisionModel(config).eval()
    videos = torch.randn(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return model, (), {"pixel_values_videos": videos}


def _hf(name: str, overrides: dict[str, Any]):
    def build():
        # many default pad ids lie outside the shrunk vocabulary of 128
        model = hf_model(name, **{"pad_token_id": 0, **overrides})
        inputs = example_inputs(model)
        if name == "vit_mae":  # its random patch masking, drawn once so that every run sees the same
            patches = (model.config.image_size // model.config.patch_size) ** 2
            inputs["noise"] = torch.rand(2, patches, generator=torch.Generator().manual_seed(0))
        return model, (), inputs
    return build


# --------------------------------------------------------------------------- timm and torchvision

IMAGE = (2, 3, 32, 32)

# timm name -> create_model keyword arguments (pretrained=False always)
TIMM_MODELS: dict[str, dict[str, Any]] = {
    "vit_tiny_patch16_224": dict(img_size=32, patch_size=8, depth=2),
    "deit_tiny_patch16_224": dict(img_size=32, patch_size=8, depth=2),
    "eva02_tiny_patch14_224": dict(img_size=32, patch_size=8, depth=2),
    "cait_xxs24_224": dict(img_size=32, patch_size=8, depth=2, depth_token_only=1),
    "swin_tiny_patch4_window7_224": dict(img_size=32, window_size=4, depths=(1, 1), num_heads=(2, 4), embed_dim=32),
    "convnext_atto": dict(depths=(1, 1, 1, 1)),
    "convnextv2_atto": dict(depths=(1, 1, 1, 1)),
    "coatnet_nano_rw_224": dict(img_size=64),
    "maxvit_tiny_tf_224": dict(img_size=64, depths=(1, 1, 1, 1)),
    "edgenext_xx_small": dict(),
    "efficientformer_l1": dict(),  # attention biases sized for 224 x 224 inputs
    "levit_128s": dict(img_size=64),
    "beit_base_patch16_224": dict(img_size=32, patch_size=8, depth=2, embed_dim=64, num_heads=4),
    # gemma3n's vision tower: RmsNorm2d / RmsNormAct2d, norms written out over dim 1 of NCHW
    "mobilenetv5_300m_enc": dict(),
}


FULL_SIZE_ONLY = {"efficientformer_l1"}


def _timm(name: str, kwargs: dict[str, Any]):
    def build():
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, **kwargs).eval()
        size = kwargs.get("img_size", 224 if name in FULL_SIZE_ONLY else 64)
        return model, (torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(0)),), {}
    return build


def _torchvision_models() -> dict[str, Callable[[], nn.Module]]:
    from torchvision.models import convnext, maxvit, swin_transformer, vision_transformer

    return {
        "vit": lambda: vision_transformer.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4,
                                                            hidden_dim=64, mlp_dim=128, num_classes=10),
        "swin_t": lambda: swin_transformer.SwinTransformer(patch_size=[4, 4], embed_dim=32, depths=[1, 1],
                                                           num_heads=[2, 4], window_size=[4, 4], num_classes=10),
        "swin_v2_t": lambda: swin_transformer.SwinTransformer(
            patch_size=[4, 4], embed_dim=32, depths=[1, 1], num_heads=[2, 4], window_size=[4, 4], num_classes=10,
            block=swin_transformer.SwinTransformerBlockV2, downsample_layer=swin_transformer.PatchMergingV2),
        "convnext": lambda: convnext.ConvNeXt([convnext.CNBlockConfig(16, 32, 1), convnext.CNBlockConfig(32, None, 1)],
                                              num_classes=10),
        "maxvit": lambda: maxvit.MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[32],
                                        block_layers=[1], head_dim=16, stochastic_depth_prob=0.0, num_classes=10),
    }


def _tv(name: str):
    def build():
        torch.manual_seed(0)
        model = _torchvision_models()[name]().eval()
        return model, (torch.randn(*IMAGE, generator=torch.Generator().manual_seed(0)),), {}
    return build


# --------------------------------------------------------------------------- torch.nn

def _nn(kind: str, norm_first: bool):
    def build():
        torch.manual_seed(0)
        d, heads, ffn = 64, 4, 128
        common = dict(d_model=d, nhead=heads, dim_feedforward=ffn, dropout=0.0, batch_first=True,
                      norm_first=norm_first)
        g = torch.Generator().manual_seed(0)
        src, tgt = torch.randn(2, 8, d, generator=g), torch.randn(2, 6, d, generator=g)
        if kind == "transformer":
            model = nn.Transformer(num_encoder_layers=2, num_decoder_layers=2, **common)
            return model.eval(), (src, tgt), {}
        if kind == "encoder":
            model = nn.TransformerEncoder(nn.TransformerEncoderLayer(**common), 2, norm=nn.LayerNorm(d),
                                          enable_nested_tensor=False)
            return model.eval(), (src,), {}
        model = nn.TransformerDecoder(nn.TransformerDecoderLayer(**common), 2, norm=nn.LayerNorm(d))
        return model.eval(), (tgt, src), {}
    return build


# --------------------------------------------------------------------------- x-transformers

# variant -> (attention layers class, keyword switches); 2 layers of dim 32, 2 heads, 16 tokens
X_TRANSFORMERS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoder_pre": ("Decoder", {}),
    "encoder_post": ("Encoder", dict(pre_norm=False)),
    "sandwich": ("Decoder", dict(sandwich_norm=True)),
    "rmsnorm": ("Decoder", dict(use_rmsnorm=True)),
    "scalenorm": ("Decoder", dict(use_scalenorm=True)),
    "simple_rmsnorm": ("Decoder", dict(use_simple_rmsnorm=True)),
    "scale_residual": ("Decoder", dict(scale_residual=True)),
    "gate_residual": ("Decoder", dict(gate_residual=True)),
    "qk_norm": ("Decoder", dict(attn_qk_norm=True)),
    "rotary": ("Decoder", dict(rotary_pos_emb=True)),
    # hyper-connections: 4 residual streams, mixed into each branch by an einsum over the streams
    "hyper_connections": ("Decoder", dict(num_residual_streams=4)),
}


def _xt(kind: str, switches: dict[str, Any]):
    def build():
        import x_transformers

        torch.manual_seed(0)
        layers = getattr(x_transformers, kind)(dim=32, depth=2, heads=2, **switches)
        model = x_transformers.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=layers).eval()
        return model, (torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0)),), {}
    return build


# --------------------------------------------------------------------------- the registry

@dataclass(frozen=True)
class ZooModel:
    name: str                      # "hf:llama", "timm:convnext_atto", "tv:swin_t", "nn:encoder_pre"
    group: str                     # encoder, decoder, moe, hybrid, encoder-decoder, vision, torch.nn
    build: Callable[[], tuple[nn.Module, tuple, dict]] = field(compare=False, repr=False)
    needs: str | None = None       # the optional package it needs ("timm", "torchvision", "transformers")


def zoo_models() -> dict[str, ZooModel]:
    models = [ZooModel(f"hf:{n}", group, _hf(n, o), "transformers") for n, (group, o) in HF_FAMILIES.items()]
    models.append(ZooModel("hf:videoprism_vision", "vision", _videoprism, "transformers"))
    models += [ZooModel(f"timm:{n}", "vision", _timm(n, k), "timm") for n, k in TIMM_MODELS.items()]
    models += [ZooModel(f"tv:{n}", "vision", _tv(n), "torchvision")
               for n in ("vit", "swin_t", "swin_v2_t", "convnext", "maxvit")]
    models += [ZooModel(f"xt:{n}", "x-transformers", _xt(k, sw), "x_transformers")
               for n, (k, sw) in X_TRANSFORMERS.items()]
    for kind in ("transformer", "encoder", "decoder"):
        for norm_first in (False, True):
            name = f"nn:{kind}_{'pre' if norm_first else 'post'}"
            models.append(ZooModel(name, "torch.nn", _nn(kind, norm_first)))
    return {m.name: m for m in models}
