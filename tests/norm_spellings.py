"""A generator of norm spellings: every combination of how code bases write a row statistic, its
inverse square root, eps, the square and the casts, each as a small module with a residual add
feeding the norm.

``spelled_norm(spec)`` writes one norm; ``SpellingStack`` holds many (one site each, named by
its spec) so that one capture covers a whole grid. The grid (``GRID``) is every combination of
the axes below; ``SPECIAL`` adds the forms outside it (F.normalize, DeepSeek-V4's rounded rsqrt).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# how the last dim is named: dim=-1, dim=ndim-1, axis=-1, axis=ndim-1 (I-BERT: axis=2)
DIMS = ("dim-1", "dim+", "axis-1", "axis+")
# how the square is written
SQUARES = ("pow", "starstar", "square", "mul")
# how the inverse square root is written
INVERSES = ("rsqrt", "one_div_sqrt", "div_sqrt", "pow_half", "reciprocal")
# eps after or before the statistic
EPS_SIDES = ("stat+eps", "eps+stat")
# where the casts are: none (the input's dtype throughout), fp32 inside and one rounding at the end
# (Gemma / F.layer_norm), n rounded before the weight (Llama)
CASTS = ("none", "round_last", "round_n")
KINDS = ("rms_norm", "layer_norm")


@dataclass(frozen=True)
class Spelling:
    kind: str = "rms_norm"
    dim: str = "dim-1"
    square: str = "pow"
    inverse: str = "rsqrt"
    eps: str = "stat+eps"
    casts: str = "none"
    weight: bool = True

    @property
    def name(self) -> str:
        return "_".join([self.kind, self.dim.replace("-", "m").replace("+", "p"), self.square, self.inverse,
                         "eps_first" if self.eps == "eps+stat" else "eps_last", self.casts,
                         "w" if self.weight else "nw"])


GRID = [Spelling(*combo) for combo in itertools.product(KINDS, DIMS, SQUARES, INVERSES, EPS_SIDES, CASTS, (True, False))]


def _mean(t, how: str):
    last = t.ndim - 1
    if how == "dim-1":
        return t.mean(-1, keepdim=True)
    if how == "dim+":
        return torch.mean(t, dim=last, keepdim=True)
    if how == "axis-1":
        return torch.mean(t, axis=-1, keepdim=True)
    return t.mean(axis=last, keepdim=True)


def _square(t, how: str):
    return {"pow": lambda: t.pow(2), "starstar": lambda: t ** 2, "square": lambda: torch.square(t),
            "mul": lambda: t * t}[how]()


def _plus_eps(stat, eps: float, side: str):
    return stat + eps if side == "stat+eps" else eps + stat


def _normalized(v, denom, how: str):
    """v times the inverse square root of denom, written ``how``."""
    if how == "rsqrt":
        return v * torch.rsqrt(denom)
    if how == "one_div_sqrt":
        return v * (1 / torch.sqrt(denom))
    if how == "div_sqrt":
        return v / torch.sqrt(denom)
    if how == "pow_half":
        return v * denom.pow(-0.5)
    return v * torch.sqrt(denom).reciprocal()


class SpelledNorm(nn.Module):
    """One norm written the ``spec`` way, over the last dim of its input."""

    def __init__(self, spec: Spelling, n: int, eps: float = 1e-5):
        super().__init__()
        self.spec, self.eps = spec, eps
        g = torch.Generator().manual_seed(hash(spec.name) % 2**31)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n, generator=g)) if spec.weight else None
        self.bias = nn.Parameter(0.1 * torch.randn(n, generator=g)) if spec.weight and spec.kind == "layer_norm" \
            else None

    def forward(self, x):
        s = self.spec
        dtype = x.dtype
        h = x if s.casts == "none" else x.float()
        if s.kind == "layer_norm":
            v = h - _mean(h, s.dim)
            stat = _mean(_square(v, s.square), s.dim)
        else:
            v = h
            stat = _mean(_square(h, s.square), s.dim)
        n = _normalized(v, _plus_eps(stat, self.eps, s.eps), s.inverse)
        if s.casts == "round_n":
            n = n.to(dtype)
        if self.weight is not None:
            n = self.weight * n
        if self.bias is not None:
            n = n + self.bias
        return n.to(dtype)


class NormalizeRMSNorm(nn.Module):
    """x-transformers' RMSNorm: ``F.normalize(x, dim=-1) * dim ** 0.5 * g`` (x / max(||x||_2, eps))."""

    def __init__(self, n: int, weight: bool = True, upcast: bool = False):
        super().__init__()
        self.scale, self.upcast = n ** 0.5, upcast
        self.g = nn.Parameter(torch.ones(n)) if weight else None

    def forward(self, x):
        h = F.normalize(x.float() if self.upcast else x, dim=-1) * self.scale
        h = h if self.g is None else h * self.g
        return h.to(x.dtype)


class UnweightedRMSNorm(nn.Module):
    """DeepSeek-V4's unweighted RMSNorm: the rsqrt rounded to x's dtype before the multiply."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)


class ImageGPTLayerNorm(nn.Module):
    """ImageGPT's RMS norm, as transformers writes it."""

    def __init__(self, n: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, tensor):
        return tensor / torch.sqrt(torch.mean(torch.square(tensor), axis=-1, keepdim=True) + self.eps) * self.weight


class IBertLayerNorm(nn.Module):
    """I-BERT's LayerNorm outside quant mode, as transformers writes it."""

    def __init__(self, n: int, eps: float = 1e-12):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        mean = x.mean(axis=2, keepdim=True)
        y = x - mean
        var = torch.mean(y**2, axis=2, keepdim=True)
        x = y / torch.sqrt(self.eps + var)
        return x * self.weight + self.bias


def special_norms(n: int) -> dict[str, nn.Module]:
    return {"normalize_w": NormalizeRMSNorm(n), "normalize_nw": NormalizeRMSNorm(n, weight=False),
            "normalize_fp32": NormalizeRMSNorm(n, upcast=True), "deepseek_v4": UnweightedRMSNorm(),
            "imagegpt": ImageGPTLayerNorm(n), "ibert": IBertLayerNorm(n)}


class SpellingStack(nn.Module):
    """Many norms side by side, norm i reading its own residual add ``x + r[i]``: one site per norm.
    Returns every norm's output, in the order of ``names``."""

    def __init__(self, norms: dict[str, nn.Module]):
        super().__init__()
        self.names = list(norms)
        self.norms = nn.ModuleDict(norms)

    def forward(self, x, r):  # x: (B, S, C), r: (len(names), B, S, C)
        return tuple(self.norms[name](x + r[i]) for i, name in enumerate(self.names))
