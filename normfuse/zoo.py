"""Small models to try normfuse on: a configurable toy transformer and shrunk HF models.

``ToyTransformer`` covers every placement and every spelling of the norms the pass
recognizes; the demo, the examples, the tests and the fuzzer build on it.
``hf_model(model_type)`` builds a transformers model from its config (no download).
``TitanLlama`` is torchtitan's llama layout (examples/train_fsdp2_tp.py). Models only the
tests and benchmarks use live under tests/ (loops.py, fp8_models.py).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ToyTransformer", "make_norm", "NORM_SPELLINGS", "PLACEMENTS", "ADD_ORDERS", "residual_add", "hf_config", "hf_model",
           "example_inputs", "TINY_HF", "prepare_torchvision", "TitanLlama", "apply_titan_tp"]

PLACEMENTS = ("pre", "post", "res_post", "sandwich", "parallel", "deepnorm")

# how the residual add is written: stream + branch, branch + stream, torch.add, in place
ADD_ORDERS = ("x+f", "f+x", "torch.add", "iadd")


def residual_add(x, f, order="x+f"):
    """``x + f`` written the ``order`` way (ADD_ORDERS); "iadd" adds into the branch output."""
    if order == "x+f":
        return x + f
    if order == "f+x":
        return f + x
    if order == "torch.add":
        return torch.add(x, f)
    if order == "iadd":
        f += x
        return f
    raise ValueError(f"unknown add order {order!r}; choose one of {ADD_ORDERS}")

# how a norm is written in the model's code
NORM_SPELLINGS = {
    "rms_norm": ("module", "functional", "llama", "llama_pow_half", "gemma", "t5", "square_div_sqrt"),
    "layer_norm": ("module", "functional", "manual", "manual_var", "manual_div"),
}


class _WrittenNorm(nn.Module):
    """A norm written out by hand, as model code does: a weight of size n and eps."""

    weight_init = 1.0

    def __init__(self, n, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), self.weight_init))
        self.eps = eps


class _LlamaRMSNorm(_WrittenNorm):
    """HF Llama: upcast, mean of squares, rsqrt, round to the input dtype, then * weight."""

    def __init__(self, n, eps=1e-6, inv="rsqrt"):
        super().__init__(n, eps)
        self.inv = inv

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        var = h.pow(2).mean(-1, keepdim=True)
        if self.inv == "rsqrt":
            h = h * torch.rsqrt(var + self.eps)
        elif self.inv == "pow":
            h = h * (var + self.eps) ** -0.5
        else:  # 1 / sqrt spelled as a division
            h = h / torch.sqrt(var + self.eps)
        return self.weight * h.to(dtype)


class _GemmaRMSNorm(_WrittenNorm):
    """Gemma: normalize in fp32, multiply by (1 + w) in fp32, round once."""

    weight_init = 0.0

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class _T5LayerNorm(_WrittenNorm):
    """T5: the variance in fp32, the multiply on the un-upcast input, weight last."""

    def forward(self, x):
        var = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return self.weight * x


class _SquareRMSNorm(_WrittenNorm):
    """x / sqrt(mean(square(x)) + eps) with the last dim spelled ndim - 1."""

    def forward(self, x):
        h = x.float()
        h = h / torch.sqrt(torch.square(h).mean(dim=x.ndim - 1, keepdim=True) + self.eps)
        return (h * self.weight).to(x.dtype)


class _FunctionalNorm(nn.Module):
    def __init__(self, n, kind, eps):
        super().__init__()
        self.kind, self.eps, self.n = kind, eps, n
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if kind == "layer_norm" else None

    def forward(self, x):
        if self.kind == "layer_norm":
            return F.layer_norm(x, (self.n,), self.weight, self.bias, self.eps)
        return F.rms_norm(x, (self.n,), self.weight, self.eps)


class _ManualLayerNorm(_WrittenNorm):
    """LayerNorm written out (Cohere/OLMo style): mean, subtract, variance, rsqrt."""

    def __init__(self, n, eps=1e-5, how="manual"):
        super().__init__(n, eps)
        self.bias = nn.Parameter(torch.zeros(n))
        self.how = how

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        mean = h.mean(-1, keepdim=True)
        if self.how == "manual_var":
            var = h.var(-1, keepdim=True, unbiased=False)
            h = (h - mean) * torch.rsqrt(var + self.eps)
        elif self.how == "manual_div":
            d = h - mean
            var = (d * d).mean(-1, keepdim=True)
            h = d / torch.sqrt(var + self.eps)
        else:
            d = h - mean
            var = d.pow(2).mean(-1, keepdim=True)
            h = d * torch.rsqrt(var + self.eps)
        return (self.weight * h + self.bias).to(dtype)


def make_norm(kind: str, spelling: str, n: int, eps: float | None = None) -> nn.Module:
    """A norm module of ``kind`` written the ``spelling`` way (see NORM_SPELLINGS)."""
    eps = eps if eps is not None else (1e-6 if kind == "rms_norm" else 1e-5)
    if spelling == "module":
        return nn.LayerNorm(n, eps=eps) if kind == "layer_norm" else nn.RMSNorm(n, eps=eps)
    if spelling == "functional":
        return _FunctionalNorm(n, kind, eps)
    if kind == "rms_norm":
        return {"llama": lambda: _LlamaRMSNorm(n, eps), "llama_pow_half": lambda: _LlamaRMSNorm(n, eps, "pow"),
                "gemma": lambda: _GemmaRMSNorm(n, eps), "t5": lambda: _T5LayerNorm(n, eps),
                "square_div_sqrt": lambda: _SquareRMSNorm(n, eps)}[spelling]()
    return _ManualLayerNorm(n, eps, spelling)


class _Attention(nn.Module):
    def __init__(self, n, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(n, 3 * n)
        self.proj = nn.Linear(n, n)

    def forward(self, x):
        b, t, n = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, n // self.heads).permute(2, 0, 3, 1, 4)  # (3, B, h, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, n))


class _MLP(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.up = nn.Linear(n, 2 * n)
        self.down = nn.Linear(2 * n, n)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    """One transformer block with its norms where ``placement`` puts them."""

    def __init__(self, n, heads, placement, kind, spelling, eps, alpha, dropout, add_order="x+f"):
        super().__init__()
        self.placement, self.alpha, self.add_order = placement, alpha, add_order
        self.attn, self.mlp = _Attention(n, heads), _MLP(n)
        self.norm1 = make_norm(kind, spelling, n, eps)
        self.norm2 = make_norm(kind, spelling, n, eps)
        if placement == "sandwich":
            self.post1 = make_norm(kind, spelling, n, eps)
            self.post2 = make_norm(kind, spelling, n, eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        p, add = self.placement, (lambda a, b: residual_add(a, b, self.add_order))
        if p == "pre":
            x = add(x, self.drop(self.attn(self.norm1(x))))
            return add(x, self.drop(self.mlp(self.norm2(x))))
        if p == "post":
            x = self.norm1(add(x, self.drop(self.attn(x))))
            return self.norm2(add(x, self.drop(self.mlp(x))))
        if p == "deepnorm":
            x = self.norm1(add(x * self.alpha, self.attn(x)))
            return self.norm2(add(x * self.alpha, self.mlp(x)))
        if p == "res_post":
            x = add(x, self.norm1(self.attn(x)))
            return add(x, self.norm2(self.mlp(x)))
        if p == "sandwich":
            x = add(x, self.post1(self.attn(self.norm1(x))))
            return add(x, self.post2(self.mlp(self.norm2(x))))
        if p == "parallel":  # x + attn(ln1(x)) + mlp(ln2(x))
            return add(add(x, self.attn(self.norm1(x))), self.mlp(self.norm2(x)))
        raise ValueError(f"unknown placement {p!r}; choose one of {PLACEMENTS}")


class ToyTransformer(nn.Module):
    """A small transformer: token + position embeddings, ``depth`` blocks, a head.

    placement: where the norms sit ("pre", "post", "res_post", "sandwich", "parallel", "deepnorm").
    kind / spelling: which norm and how its code is written (NORM_SPELLINGS).
    embed_norm: a norm of ``tok + pos`` before the first block (BERT style).
    final_norm: a norm after the last block (pre-norm stacks have one).
    add_order: how each residual add in the blocks is written (ADD_ORDERS).
    """

    def __init__(self, vocab=64, hidden=32, heads=4, depth=2, max_len=64, placement="pre", kind="layer_norm",
                 spelling="module", eps=None, alpha=None, embed_norm=False, final_norm=None, dropout=0.0,
                 add_order="x+f"):
        super().__init__()
        self.config = dict(vocab=vocab, hidden=hidden, heads=heads, depth=depth, placement=placement, kind=kind,
                           spelling=spelling, eps=eps, embed_norm=embed_norm, add_order=add_order)
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_len, hidden)
        self.embed_norm = make_norm(kind, spelling, hidden, eps) if embed_norm else None
        alpha = alpha if alpha is not None else (2 * depth) ** 0.25
        self.blocks = nn.ModuleList(_Block(hidden, heads, placement, kind, spelling, eps, alpha, dropout, add_order)
                                    for _ in range(depth))
        final_norm = placement in ("pre", "sandwich", "parallel") if final_norm is None else final_norm
        self.final_norm = make_norm(kind, spelling, hidden, eps) if final_norm else None
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        t = ids.shape[-1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        for block in self.blocks:
            x = block(x)
        if self.final_norm is not None:
            x = self.final_norm(x)
        return self.head(x)


# --------------------------------------------------------------------------- HF models

_TORCHVISION_OPS = ("nms", "qnms")  # the ops torchvision's Python code registers fakes for at import
_torchvision_checked: list = []     # one entry once checked: the library holding our declarations, or None


def prepare_torchvision() -> None:
    """Let a torchvision whose C extension cannot load (a CUDA wheel next to a CPU torch) import.

    Its pure-Python models still work, but ``import torchvision`` fails registering fake kernels
    for ``torchvision::nms``/``qnms``, ops its extension would have defined; transformers imports
    torchvision whenever it is installed, so every HF model would fail to build. Declaring the
    missing schemas first (a FRAGMENT of the namespace: another package may have declared it, or
    some of the ops, already) lets the import through, and says so once.

    normfuse calls this right before it first imports transformers (``hf_model``, ``hf:`` and
    config targets, a factory target's import), never when a module of it is imported. Nothing
    happens when torchvision is absent, already imported, its extension loads (it then defines
    the ops itself), or the ops exist; a failure to declare them is a warning, never an error."""
    if _torchvision_checked or "torchvision" in sys.modules:
        return
    _torchvision_checked.append(None)
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    for extension in Path(spec.submodule_search_locations[0]).glob("_C.*"):
        try:
            torch.ops.load_library(str(extension))
            return
        except OSError:
            break
    missing = [op for op in _TORCHVISION_OPS if not torch._C._jit_get_schemas_for_operator(f"torchvision::{op}")]
    if not missing:
        return
    names = ", ".join(f"torchvision::{op}" for op in missing)
    try:
        library = torch.library.Library("torchvision", "FRAGMENT")
        for op in missing:
            library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    except Exception as error:  # noqa: BLE001 - never fail on what another package did
        warnings.warn(f"normfuse: torchvision's C extension does not load and declaring {names} failed "
                      f"({type(error).__name__}: {error}); importing transformers may fail.", RuntimeWarning,
                      stacklevel=2)
        return
    _torchvision_checked[0] = library  # the declarations live as long as the process
    warnings.warn(f"normfuse: torchvision's C extension does not load here (a build for another torch?); declared "
                  f"the schemas of {names} so that its Python code, which transformers imports, loads.",
                  RuntimeWarning, stacklevel=2)


# Shrinking overrides applied to any HF config that has the field (2 layers, hidden 64).
TINY_HF = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=128, n_embd=64, n_layer=2, n_head=4, d_model=64, d_ff=128,
               num_layers=2, num_heads=4, d_kv=16, head_dim=16, num_decoder_layers=2, encoder_layers=2,
               decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
               decoder_ffn_dim=128, max_position_embeddings=128, n_positions=128, image_size=32, patch_size=8,
               layer_types=None)


def hf_config(model_type: str, tiny: bool = True, **overrides: Any):
    """A transformers config for ``model_type`` with its defaults, shrunk when ``tiny``."""
    prepare_torchvision()
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    for key, value in {**(TINY_HF if tiny else {}), **overrides}.items():
        derived = getattr(type(config), key, None)
        if isinstance(derived, property) and derived.fset is None and key not in overrides:
            continue  # computed from other fields (Falcon's head_dim): shrinks with them
        if hasattr(config, key) and (value is not None or key in overrides):
            setattr(config, key, value)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def hf_model(model_type: str, dtype: torch.dtype = torch.float32, tiny: bool = True, seed: int = 0,
             device: str | torch.device = "cpu", **overrides: Any) -> nn.Module:
    """A transformers base model built from its config (no weights downloaded), in eval mode."""
    from transformers import AutoModel

    config = hf_config(model_type, tiny, **overrides)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=dtype)
    return model.eval()


def example_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword inputs a HF model accepts: token ids inside its vocabulary, pixel values, ..."""
    config = getattr(model, "config", None)
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    if config is None or isinstance(config, dict):  # not a transformers model (e.g. ToyTransformer)
        vocab = getattr(getattr(model, "tok", None), "num_embeddings", 64)
        return {"ids": torch.randint(0, vocab, (batch, seq), generator=g).to(device)}
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        dtype = next(model.parameters()).dtype
        return {"pixel_values": torch.randn(batch, channels, size, size, generator=g).to(device, dtype)}
    if main == "input_features":
        bins = getattr(config, "num_mel_bins", 80)
        frames = 2 * getattr(config, "max_source_positions", 1500)
        dtype = next(model.parameters()).dtype
        inputs = {"input_features": torch.randn(batch, bins, frames, generator=g).to(device, dtype)}
        inputs["decoder_input_ids"] = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
        return inputs
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g).to(device)
    inputs = {"input_ids": ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids.clone()
    return inputs


# --------------------------------------------------------------------------- tensor parallel

class _TitanAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        bs, seq, _ = x.shape
        # (bs, seq, heads, head_dim): -1 heads, so each TP rank uses its local heads
        q, k, v = (w(x).view(bs, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(bs, seq, -1))


class _TitanFeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, 2 * dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attention, self.feed_forward = _TitanAttention(dim, heads), _TitanFeedForward(dim)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """torchtitan's llama layout (module names its TP plan addresses), small, no rotary embedding."""

    def __init__(self, vocab=64, dim=32, heads=4, depth=2, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_TitanBlock(dim, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab, bias=False)
        for p in self.parameters():  # norm weights away from 1, so their gradients matter
            nn.init.normal_(p, 1.0 if p.ndim == 1 else 0.0, 0.2)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def apply_titan_tp(model: "TitanLlama", mesh) -> "TitanLlama":
    """torchtitan's llama tensor-parallel plan (sequence-parallel norms) on ``mesh``, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
    return model
