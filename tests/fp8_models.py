"""A small Llama whose norm outputs are quantized to fp8 by the linears reading them
(``Fp8Llama``, ``Fp8Linear``, ``FP8_RECIPES``; ``token_ids`` and ``optimized_copy`` to run them): the models of tests/test_quant_pass.py and
tests/test_quant_spellings.py."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.zoo import make_norm


def token_ids(seed=0):
    """A batch of token ids for these models: (2, 8)."""
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))


def optimized_copy(model):
    """``normfuse.optimize`` of a copy, on a fresh dynamo."""
    torch._dynamo.reset()
    return normfuse.optimize(copy.deepcopy(model))


def _llama_rms_norm(dim: int) -> nn.Module:
    return make_norm("rms_norm", "llama", dim)  # HF LlamaRMSNorm's spelling, eps 1e-6


# how an Fp8Linear quantizes its input (the spellings normfuse/passes/parts/quant.py reads):
# static per-tensor scale; dynamic per row (amax / qmax, or Python's qmax / amax with a multiply);
# dynamic per group of 128 or 64 columns (DeepSeek-V3's 1x128 activation tiles)
FP8_RECIPES = ("static", "row", "row_reciprocal", "group128", "group64")


class Fp8Linear(nn.Module):
    """A linear whose input is quantized to float8_e4m3fn in its forward, written as fp8 serving
    and training code writes it; the matmul runs on the dequantized input (CPU has no fp8 GEMM),
    so the model runs anywhere and its numbers are those of the quantized activations."""

    def __init__(self, n_in, n_out, recipe="row"):
        super().__init__()
        if recipe not in FP8_RECIPES:
            raise ValueError(f"unknown recipe {recipe!r}; choose one of {FP8_RECIPES}")
        self.recipe = recipe
        self.weight = nn.Parameter(torch.randn(n_out, n_in) / n_in ** 0.5)
        self.register_buffer("input_scale", torch.tensor([0.02]))  # static: calibrated, fp32

    def quantize(self, x):
        """(q, scale): x in float8_e4m3fn and the scale that dequantizes it."""
        qmax = torch.finfo(torch.float8_e4m3fn).max
        if self.recipe == "static":
            scale = self.input_scale.float()
            return (x.float() / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale
        if self.recipe.startswith("row"):
            amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
            if self.recipe == "row":
                scale = amax / qmax
                return (x.float() / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn), scale
            inverse = qmax / amax  # Python's qmax / amax: a reciprocal, then a multiply
            return (x.float() * inverse).clamp(-qmax, qmax).to(torch.float8_e4m3fn), inverse.reciprocal()
        group = int(self.recipe.removeprefix("group"))
        tiles = x.float().unflatten(-1, (-1, group))
        scale = tiles.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / qmax
        q = (tiles / scale).clamp(-qmax, qmax).to(torch.float8_e4m3fn)
        return q.flatten(-2), scale

    def forward(self, x):
        q, scale = self.quantize(x)
        if self.recipe.startswith("group"):
            group = int(self.recipe.removeprefix("group"))
            dequantized = (q.float().unflatten(-1, (-1, group)) * scale).flatten(-2)
        else:
            dequantized = q.float() * scale
        return F.linear(dequantized.to(x.dtype), self.weight.to(x.dtype))


class _Fp8Block(nn.Module):
    """A Llama block (HF LlamaRMSNorm spelling) whose fused qkv and gate-up linears read fp8."""

    def __init__(self, dim, heads, recipe):
        super().__init__()
        self.heads = heads
        self.input_layernorm, self.post_attention_layernorm = _llama_rms_norm(dim), _llama_rms_norm(dim)
        self.qkv, self.o = Fp8Linear(dim, 3 * dim, recipe), nn.Linear(dim, dim, bias=False)
        self.gate_up, self.down = Fp8Linear(dim, 4 * dim, recipe), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        b, t, n = x.shape
        q, k, v = self.qkv(self.input_layernorm(x)).view(b, t, 3, self.heads, n // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, n))
        gate, up = self.gate_up(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Fp8Llama(nn.Module):
    """A small Llama whose norm outputs are quantized to fp8 by the linears reading them
    (``recipe``: one of FP8_RECIPES); the final norm feeds a plain head."""

    def __init__(self, vocab=64, dim=256, heads=4, depth=2, recipe="row", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Fp8Block(dim, heads, recipe) for _ in range(depth))
        self.norm = _llama_rms_norm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        for name, p in self.named_parameters():  # norm weights away from 1, so their rounding shows
            if p.ndim == 1:
                nn.init.normal_(p, 1.0, 0.2)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))
