"""Benchmark 5: the GPU suite. One script, about 8 minutes on one H200.

Forward and backward of each fused op against its peers, on M x N rows:

* eager PyTorch: ``s = x + r`` then ``F.rms_norm`` / ``F.layer_norm``; HF's decomposed
  ``LlamaRMSNorm``;
* ``torch.compile`` of the same (M marked dynamic: one compile per N and dtype);
* Liger-Kernel's and flash-attn's Triton norms, where they import;
* normfuse: ``add_norm`` (``F.rms_norm`` semantics, and HF Llama's "round, then * w").

M in {4096, 16384, 65536} tokens, N in {768, ..., 16384}, bf16 and fp32. Then the kernel
modes (x1, rowscale, dropout, a second norm) against the eager ops they replace, and add + RMSNorm +
fp8 quantization (per token, per group of 128, static) against eager and compiled quantization, and
the gated RMSNorms of Mamba2 and Qwen3-Next against HF's modules, eager and compiled. Each time is the
median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``; plain ``do_bench``
where capture fails), so Python overhead is not counted; GB/s counts the bytes a fused
kernel must move (forward: read x, r, write y, s; backward: read dy, ds, s, write dx),
and % is of the device's copy bandwidth, measured here with a large ``clone``. Then one
HF llama block forward+backward, eager vs ``normfuse.optimize``.

Last, QK-norm + RoPE (``qk_norm_rope``), bf16, B = 1 and T in {2048, 8192, 32768} tokens, in HF's
form (q, k from the projections' views, outputs (B, H, T, D)): Qwen3-8B's heads (32 q, 8 kv, head_dim
128; Qwen3's rounding) and Gemma 3's (transformers' Gemma3TextConfig defaults: 8 q, 4 kv, head_dim 256;
weight offset 1), forward and forward+backward, against HF's ``Qwen3RMSNorm`` / ``Gemma3RMSNorm``
then ``apply_rotary_pos_emb`` in eager, the same under ``torch.compile``, and Liger's RMSNorm then
Liger's RoPE where liger_kernel imports; GB/s by the bytes the fused kernel moves (``qk_rope_bytes``),
with each provider's largest output and gradient difference from HF eager.

Then a diffusion transformer's block tail (``dit``), bf16, batch 1, 4096 and 16384 tokens at Flux-dev's
hidden size (3072) and Wan 2.1 14B's (5120): ``s = r + gate * x``, ``y = layer_norm(s) * (1 + scale) +
shift`` with gate, scale and shift chunks of one embedding (per sample), in eager, under
``torch.compile``, and as one ``add_norm`` call (the gate its prologue, the modulation its epilogue);
GB/s by the bytes a fused kernel must move (forward: read x, r, write s, y; backward: read dy, ds, x,
s, write dx, dr).

Results go under ``$OUT`` (default ``benchmarks/results/gpu``). Without CUDA the script
runs the Triton kernels under Triton's interpreter at a toy size (``--toy``), to prove it
runs end to end; its numbers then mean nothing.

    python benchmarks/bench_gpu.py [--toy] [--budget-s 420] [--only ops llama_block modes quant gated qk_rope dit]
"""

from __future__ import annotations

import os
import sys
import time

import torch

if not torch.cuda.is_available():  # the Triton kernels under the interpreter (before triton is imported)
    os.environ.setdefault("NORMFUSE_TRITON_CPU", "1")
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

from common import machine, markdown_table, parse_args, save_plot, write_csv, write_json  # noqa: E402

import torch.nn.functional as F  # noqa: E402

from normfuse.kernels import qk_norm_rope  # noqa: E402
from normfuse.kernels.add_norm import add_norm  # noqa: E402
from normfuse.kernels.specs import Dropout, Fp8Quant, Gate, Modulation  # noqa: E402

CUDA = torch.cuda.is_available()
MS = [16384, 65536, 4096]           # the targets' shapes first: the time budget may cut the tail
NS = [1024, 2048, 4096, 8192, 768, 16384]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EPS = 1e-6


# ------------------------------------------------------------------ providers

class _HFLlamaRMSNorm(torch.nn.Module):
    """HF's decomposed RMSNorm (imported from transformers when it is there)."""

    def __new__(cls, n):
        try:
            from normfuse.zoo import prepare_torchvision
            prepare_torchvision()  # transformers imports torchvision, whose C extension may not load
            from transformers.models.llama.modeling_llama import LlamaRMSNorm
            return LlamaRMSNorm(n, eps=EPS)
        except ImportError:
            return super().__new__(cls)

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * h.to(x.dtype)


def _eager_rms(x, r, w, b):
    s = x + r
    return F.rms_norm(s, (s.shape[-1],), w, EPS), s


def _eager_ln(x, r, w, b):
    s = x + r
    return F.layer_norm(s, (s.shape[-1],), w, b, EPS), s


def _liger():
    """{op: factory(n, dtype, device) -> fn(x, r, w, b)} of Liger-Kernel's norms, if it imports."""
    from liger_kernel.transformers.layer_norm import LigerLayerNorm
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    out = {}
    try:
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm

        out["rms"] = lambda n, dtype, device: _module_fn(
            LigerFusedAddRMSNorm(n, eps=EPS, casting_mode="none").to(device, dtype), fused_add=True)
    except ImportError:  # older Liger: its RMSNorm after a separate add
        out["rms"] = lambda n, dtype, device: _module_fn(LigerRMSNorm(n, eps=EPS, casting_mode="none").to(device, dtype))
    out["ln"] = lambda n, dtype, device: _module_fn(LigerLayerNorm(n, eps=EPS).to(device, dtype))
    return out


def _flash_attn():
    from flash_attn.ops.triton.layer_norm import layer_norm_fn, rms_norm_fn
    return {
        "rms": lambda n, dtype, device: (lambda x, r, w, b: rms_norm_fn(x, w, None, residual=r, eps=EPS,
                                                                        prenorm=True)),
        "ln": lambda n, dtype, device: (lambda x, r, w, b: layer_norm_fn(x, w, b, residual=r, eps=EPS,
                                                                         prenorm=True)),
    }


def providers(op: str, toy: bool) -> dict:
    """name -> factory(n, dtype, device) -> fn(x, r, w, b) returning (y, s)."""
    compile_backend = "inductor" if CUDA else "aot_eager"  # no C++ build on the toy run

    def compiled(fn):
        def factory(n, dtype, device):
            return torch.compile(fn, backend=compile_backend)
        return factory

    if op == "rms":
        table = {
            "normfuse": lambda n, d, dev: (lambda x, r, w, b: add_norm(x, r, w, kind="rms_norm", eps=EPS)),
            "normfuse (llama rounding)": lambda n, d, dev: (
                lambda x, r, w, b: add_norm(x, r, w, kind="rms_norm", eps=EPS, norm_round_dtype=x.dtype)),
            "eager F.rms_norm": lambda n, d, dev: _eager_rms,
            "eager HF LlamaRMSNorm": _hf_factory,
            "compile F.rms_norm": compiled(_eager_rms),
        }
    else:
        table = {
            "normfuse": lambda n, d, dev: (lambda x, r, w, b: add_norm(x, r, w, b, kind="layer_norm", eps=EPS)),
            "eager F.layer_norm": lambda n, d, dev: _eager_ln,
            "compile F.layer_norm": compiled(_eager_ln),
        }
    for name, load in (("liger", _liger), ("flash-attn", _flash_attn)):
        try:
            table[name] = load()[op]
        except Exception as error:  # noqa: BLE001 - a peer that does not import is reported, not fatal
            UNAVAILABLE[name] = f"{type(error).__name__}: {error}"
    return table


def _module_fn(module: torch.nn.Module, fused_add: bool = False):
    """fn(x, r, w, b) -> (y, s) calling ``module`` with ``w`` (and ``b``) as its parameters."""
    from torch.func import functional_call

    def fn(x, r, w, b):
        params = {"weight": w} if b is None else {"weight": w, "bias": b}
        if fused_add:
            return functional_call(module, params, (x, r))
        s = x + r
        return functional_call(module, params, (s,)), s
    return fn


def _hf_factory(n, dtype, device):
    return _module_fn(_HFLlamaRMSNorm(n).to(device, dtype))


UNAVAILABLE: dict[str, str] = {}
SECTIONS = ("ops", "llama_block", "modes", "quant", "gated", "qk_rope", "dit")


# ------------------------------------------------------------------ timing

def _time_ms(fn, toy: bool) -> tuple[float, str]:
    """Median milliseconds of fn(): CUDA-graph replays where capture works."""
    if not CUDA:
        fn()
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0), "cpu-interpreter"
    import triton.testing
    fn()
    torch.cuda.synchronize()
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median"), "cudagraph"
    except Exception:  # noqa: BLE001 - a provider that cannot be captured is timed without graphs
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"), "do_bench"


def copy_bandwidth(toy: bool) -> float:
    """GB/s of a large device clone (bytes read + written)."""
    n = (1 << 16) if toy else (1 << 30)  # 4 GiB of fp32 on the GPU
    x = torch.empty(n, dtype=torch.float32, device="cuda" if CUDA else "cpu").uniform_()
    ms, _ = _time_ms(lambda: x.clone(), toy)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9


def measure(op: str, name: str, factory, m: int, n: int, dtype, device, toy: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, n, device=device, dtype=dtype, generator=g).requires_grad_()
    r = torch.randn(m, n, device=device, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(n, device=device, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(n, device=device, dtype=dtype, generator=g).requires_grad_() if op == "ln" else None
    fn = factory(n, dtype, device)
    if name.startswith("compile"):
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(r, 0)
    row = {"op": op, "provider": name, "M": m, "N": n, "dtype": str(dtype)[6:]}
    with torch.no_grad():
        row["fwd_ms"], row["timing"] = _time_ms(lambda: fn(x, r, w, b), toy)
    y, s = fn(x, r, w, b)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    params = [t for t in (x, r, w, b) if t is not None]
    row["bwd_ms"], _ = _time_ms(lambda: torch.autograd.grad((y, s), params, (dy, ds), retain_graph=True), toy)
    elem = x.element_size()
    row["fwd_GBps"] = 4 * m * n * elem / (row["fwd_ms"] * 1e-3) / 1e9
    row["bwd_GBps"] = 4 * m * n * elem / (row["bwd_ms"] * 1e-3) / 1e9
    return row


def _mode_inputs(mode: str, m: int, n: int, dtype, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g)
    t = {"x": randn(m, n).requires_grad_(), "r": randn(m, n).requires_grad_(), "w": randn(n).requires_grad_()}
    if mode == "x1":
        t["x1"] = randn(m, n).requires_grad_()
    if mode == "rowscale":
        t["rs"] = (torch.rand(m, device=device, generator=g) > 0.1).to(dtype) / 0.9
    if mode == "two_norms":
        t["w1"] = randn(n).requires_grad_()
    return t


def _mode_eager(mode: str, t: dict, p: float):
    """What a model computes without fusion: the branch step, the add, the norm (or two)."""
    x = t["x"]
    if mode == "x1":
        x = x + t["x1"]
    elif mode == "rowscale":
        x = x * t["rs"][:, None]
    elif mode == "dropout":
        x = F.dropout(x, p)
    s = x + t["r"]
    n = s.shape[-1]
    ys = [F.rms_norm(s, (n,), t["w"], EPS)]
    if mode == "two_norms":
        ys.append(F.rms_norm(s, (n,), t["w1"], EPS))
    return (*ys, s)


def _mode_fused(mode: str, t: dict, p: float):
    options = {"x1": dict(x1=t.get("x1")), "rowscale": dict(rowscale=t.get("rs")), "dropout": dict(dropout=Dropout(p)),
               "two_norms": dict(weight1=t.get("w1"))}[mode]
    return add_norm(t["x"], t["r"], t["w"], kind="rms_norm", eps=EPS, **options)


def modes(toy: bool) -> list[dict]:
    """The kernel modes (x1, rowscale, dropout, a second norm) against the eager ops they
    replace, bf16, forward and backward."""
    device = "cuda" if CUDA else "cpu"
    shapes = [(8, 64)] if toy else [(16384, 2048), (16384, 4096), (65536, 4096)]
    rows = []
    for mode in ("x1", "rowscale", "dropout", "two_norms"):
        for m, n in shapes:
            t = _mode_inputs(mode, m, n, torch.bfloat16, device)
            leaves = [v for v in t.values() if v.requires_grad]
            row = {"mode": mode, "M": m, "N": n}
            for name, fn in (("eager", _mode_eager), ("normfuse", _mode_fused)):
                with torch.no_grad():
                    row[f"{name}_fwd_ms"], _ = _time_ms(lambda: fn(mode, t, 0.1), toy)
                outs = [o for o in fn(mode, t, 0.1) if o is not None]
                cots = [torch.randn_like(o) for o in outs]
                row[f"{name}_bwd_ms"], _ = _time_ms(
                    lambda: torch.autograd.grad(outs, leaves, cots, retain_graph=True), toy)
            row["fwd_speedup"] = row["eager_fwd_ms"] / row["normfuse_fwd_ms"]
            row["bwd_speedup"] = row["eager_bwd_ms"] / row["normfuse_bwd_ms"]
            rows.append(row)
            print(f"  mode {mode} M={m} N={n}: fwd {row['fwd_speedup']:.2f}x, bwd {row['bwd_speedup']:.2f}x",
                  flush=True)
    return rows


# the fp8 epilogue: (add_norm options, the eager quantization of y) per mode, e4m3
def _quant_eager(group=None, static=None, apply="div", torchao=False):
    def quantize(y):
        yf = y.float() if group is None else y.float().unflatten(-1, (y.shape[-1] // group, group))
        if static is not None:
            scale = static
        else:
            amax = yf.abs().amax(-1, keepdim=True).clamp(min=1e-12)
            scale = 448.0 / amax if torchao else amax / 448.0
        v = yf / scale if apply == "div" else yf * scale
        q = v.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).reshape(y.shape)
        return q, (scale.reciprocal() if torchao else scale)
    return quantize


QUANT_MODES = {  # name: (add_norm's Fp8Quant given the static scale, eager quantization given it)
    "per-token amax/448, div": (lambda sc: Fp8Quant(amax_min=1e-12, clamp=448.0),
                                lambda sc: _quant_eager()),
    "per-token torchao 448/amax, mul": (
        lambda sc: Fp8Quant(amax_min=1e-12, scale_form="max*(1/amax)", apply="mul", clamp=448.0,
                            scale_out="reciprocal"),
        lambda sc: _quant_eager(apply="mul", torchao=True)),
    "per-group 128": (lambda sc: Fp8Quant(group=128, amax_min=1e-12, clamp=448.0),
                      lambda sc: _quant_eager(group=128)),
    "static, div": (lambda sc: Fp8Quant(scale=sc, clamp=448.0), lambda sc: _quant_eager(static=sc)),
    "static, mul": (lambda sc: Fp8Quant(scale=sc, apply="mul", clamp=448.0),
                    lambda sc: _quant_eager(static=sc, apply="mul")),
}


def quant_modes(toy: bool) -> list[dict]:
    """add + RMSNorm + fp8 quantization (e4m3, bf16 activations), forward (serving): normfuse's one
    kernel against the eager ops it replaces (the add, F.rms_norm, then amax / scale / divide / clamp
    / cast), against ``torch.compile`` of those, and against normfuse's add_norm followed by the
    same quantization in eager ops. GB/s counts what the fused kernel must move: read x and r, write
    s, q (1 byte) and the fp32 scales."""
    device = "cuda" if CUDA else "cpu"
    shapes = [(8, 256)] if toy else [(4096, 4096), (16384, 4096), (16384, 8192), (65536, 8192)]
    compile_backend = "inductor" if CUDA else "aot_eager"
    rows = []
    for mode, (options, eager_quant) in QUANT_MODES.items():
        for m, n in shapes:
            g = torch.Generator(device=device).manual_seed(0)
            x, r = (torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
            w = torch.randn(n, device=device, dtype=torch.bfloat16, generator=g)
            static = torch.tensor([0.02], device=device)
            quant, quantize = options(static), eager_quant(static)

            def fused():
                q, scale, _, s = add_norm(x, r, w, kind="rms_norm", eps=EPS, quant=quant)
                return q, scale, s

            def eager():
                y, s = _eager_rms(x, r, w, None)
                return (*quantize(y), s)

            def fused_then_eager_quant():
                y, s = add_norm(x, r, w, kind="rms_norm", eps=EPS)
                return (*quantize(y), s)
            providers = {"normfuse add_norm+quant": fused, "eager": eager,
                         "compile eager": torch.compile(eager, backend=compile_backend),
                         "normfuse add_norm, eager quant": fused_then_eager_quant}
            scales = 0 if "static" in mode else m * (n // 128 if "group" in mode else 1)
            moved = 3 * m * n * 2 + m * n + 4 * scales
            row = {"mode": mode, "M": m, "N": n, "bytes": moved}
            for name, fn in providers.items():
                try:
                    with torch.no_grad():
                        ms, _ = _time_ms(fn, toy)
                    row[f"{name}_ms"], row[f"{name}_GBps"] = ms, moved / (ms * 1e-3) / 1e9
                except Exception as error:  # noqa: BLE001 - one provider failing must not end the run
                    row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            for name in providers:
                if f"{name}_ms" in row and "normfuse add_norm+quant_ms" in row and name != "normfuse add_norm+quant":
                    row[f"x_vs_{name}"] = row[f"{name}_ms"] / row["normfuse add_norm+quant_ms"]
            rows.append(row)
            print(f"  quant {mode} M={m} N={n}: " + ", ".join(
                f"{k[:-5]} {v:.0f} GB/s" for k, v in row.items() if k.endswith("_GBps")), flush=True)
    return rows


def _hf_gated(kind: str, n: int, group: int):
    """HF's gated RMSNorm module of ``kind`` ("mamba2": gate before, statistics per group;
    "qwen3_next": gate after), or None when transformers does not import."""
    try:
        from normfuse.zoo import prepare_torchvision
        prepare_torchvision()
        if kind == "mamba2":
            from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated
            return MambaRMSNormGated(n, group, eps=EPS)
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated
        return Qwen3NextRMSNormGated(n, eps=EPS)
    except ImportError:
        return None


def gated_modes(toy: bool) -> list[dict]:
    """Gated RMSNorms, bf16, forward and backward: normfuse's one kernel against HF's module (Mamba2:
    the gate before the norm, statistics per group of N / 8 columns; Qwen3-Next: the gate after) in
    eager and under ``torch.compile``. GB/s counts what a fused kernel must move: forward read x, z,
    write y; backward read dy, x, z, write dx, dz."""
    device = "cuda" if CUDA else "cpu"
    shapes = [(8, 256)] if toy else [(16384, 4096), (16384, 8192), (65536, 8192)]
    compile_backend = "inductor" if CUDA else "aot_eager"
    rows = []
    for kind in ("mamba2", "qwen3_next"):
        for m, n in shapes:
            module = _hf_gated(kind, n, n // 8)
            if module is None:
                UNAVAILABLE["transformers gated norms"] = "transformers does not import"
                return rows
            module = module.to(device, torch.bfloat16)
            g = torch.Generator(device=device).manual_seed(0)
            x, z = (torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                    for _ in range(2))
            w = module.weight
            if kind == "mamba2":
                options = dict(gate=Gate(z, "before"), norm_group=n // 8, norm_round_dtype=torch.bfloat16)
            else:
                options = dict(gate=Gate(z, "after"), norm_round_dtype=torch.bfloat16)

            def fused():
                return add_norm(x, None, w, kind="rms_norm", eps=EPS, **options)[0]
            providers = {"normfuse": fused, "eager HF": lambda: module(x, z),
                         "compile HF": torch.compile(lambda: module(x, z), backend=compile_backend)}
            elem = x.element_size()
            row = {"module": kind, "M": m, "N": n}
            for name, fn in providers.items():
                try:
                    with torch.no_grad():
                        row[f"{name}_fwd_ms"], _ = _time_ms(fn, toy)
                    out = fn()
                    dy = torch.randn_like(out)
                    row[f"{name}_bwd_ms"], _ = _time_ms(
                        lambda: torch.autograd.grad(out, (x, z, w), dy, retain_graph=True), toy)
                    row[f"{name}_fwd_GBps"] = 3 * m * n * elem / (row[f"{name}_fwd_ms"] * 1e-3) / 1e9
                    row[f"{name}_bwd_GBps"] = 5 * m * n * elem / (row[f"{name}_bwd_ms"] * 1e-3) / 1e9
                except Exception as error:  # noqa: BLE001 - one provider failing must not end the run
                    row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
            for name in ("eager HF", "compile HF"):
                for step in ("fwd", "bwd"):
                    if f"{name}_{step}_ms" in row and f"normfuse_{step}_ms" in row:
                        row[f"{step}_x_vs_{name}"] = row[f"{name}_{step}_ms"] / row[f"normfuse_{step}_ms"]
            rows.append(row)
            print(f"  gated {kind} M={m} N={n}: " + ", ".join(
                f"{k[:-5]} {v:.0f} GB/s" for k, v in row.items() if k.endswith("_GBps")), flush=True)
    return rows


# QK-norm + RoPE: (q heads, kv heads, head_dim) per family. Qwen3-8B's published config (32, 8, 128);
# Gemma 3: transformers' Gemma3TextConfig defaults (8, 4, 256), Gemma-3 4B's attention
QK_FAMILIES = {"qwen3": (32, 8, 128), "gemma3": (8, 4, 256)}
QK_TOKENS = [8192, 32768, 2048]  # B = 1, S = T


def _hf_qk(family: str):
    """(norm module class, apply_rotary_pos_emb) of HF's ``family``, or None when transformers does not import."""
    try:
        from normfuse.zoo import prepare_torchvision
        prepare_torchvision()
        if family == "qwen3":
            from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm as Norm
            from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb
        else:
            from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm as Norm
            from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb
        return Norm, apply_rotary_pos_emb
    except ImportError:
        return None


def _qk_eager_fn(family: str, d: int, device):
    """fn(q, k, wq, wk, cos, sin) -> (q_out, k_out) as HF's attention computes it: q (B, S, H, D) from the
    projection's view; Qwen3 normalizes and then transposes to (B, H, S, D), Gemma 3 transposes first;
    then ``apply_rotary_pos_emb`` (rotate_half) with cos, sin (B, S, D) unsqueezed at the heads axis."""
    from torch.func import functional_call
    Norm, rope = _hf_qk(family)
    norm = Norm(d, eps=EPS).to(device, torch.bfloat16)

    def fn(q, k, wq, wk, cos, sin):
        if family == "qwen3":
            q = functional_call(norm, {"weight": wq}, (q,)).transpose(1, 2)
            k = functional_call(norm, {"weight": wk}, (k,)).transpose(1, 2)
        else:
            q = functional_call(norm, {"weight": wq}, (q.transpose(1, 2),))
            k = functional_call(norm, {"weight": wk}, (k.transpose(1, 2),))
        return rope(q, k, cos, sin)
    return fn


def _qk_liger_fn(family: str, d: int, device):
    """Liger-Kernel's RMSNorm on q and k (HF's rounding: casting mode "llama" for Qwen3, "gemma" with
    offset 1 for Gemma 3), then Liger's RoPE kernel on the (B, H, S, D) views; raises ImportError
    when liger_kernel is not installed."""
    from torch.func import functional_call

    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    if family == "qwen3":
        norm = LigerRMSNorm(d, eps=EPS, offset=0.0, casting_mode="llama", in_place=False)
    else:
        norm = LigerRMSNorm(d, eps=EPS, offset=1.0, casting_mode="gemma", init_fn="zeros", in_place=False)
    norm = norm.to(device, torch.bfloat16)

    def fn(q, k, wq, wk, cos, sin):
        q = functional_call(norm, {"weight": wq}, (q,)).transpose(1, 2)
        k = functional_call(norm, {"weight": wk}, (k,)).transpose(1, 2)
        return liger_rotary_pos_emb(q, k, cos, sin)
    return fn


def _qk_normfuse_fn(family: str, d: int, device):
    options = (dict(norm_round_dtype=torch.bfloat16) if family == "qwen3" else dict(weight_offset=1.0))

    def fn(q, k, wq, wk, cos, sin):
        return qk_norm_rope(q, k, wq, wk, cos, sin, eps=EPS, transpose_out=True, **options)
    return fn


def qk_rope_bytes(t: int, h: int, hk: int, d: int) -> tuple[int, int]:
    """(forward, backward) bytes the fused kernel must move, bf16, B = 1, S = t. Forward: read q, k,
    q_weight, k_weight, cos, sin; write q_out, k_out (the rstd the training forward also stores is
    not counted). Backward: read dq_out, dk_out, q, k, cos, sin, the weights and the fp32 rstd of each
    head row; write dq, dk, dq_weight, dk_weight."""
    qk = 2 * t * (h + hk) * d          # q and k (or q_out and k_out, dq and dk, ...)
    tables = 2 * 2 * t * d             # cos and sin, (1, S, D)
    weights = 2 * 2 * d
    rstd = 4 * t * (h + hk)
    return 2 * qk + weights + tables, 3 * qk + tables + 2 * weights + rstd


def qk_rope(toy: bool) -> list[dict]:
    """QK-norm + RoPE, bf16, forward and forward+backward, in HF's form (q, k (1, T, H, D) from the
    projections' views, out (1, H, T, D)), Qwen3's and Gemma 3's rounding: HF's eager modules, the
    same function under ``torch.compile``, Liger's RMSNorm then Liger's RoPE (where it imports), and
    normfuse's ``qk_norm_rope`` (one launch for q and k, ``transpose_out=True``). GB/s by
    ``qk_rope_bytes``; "fwd_bwd" times the forward and the backward of one step together, by the
    forward's plus the backward's bytes. ``max_abs_vs_eager``: the largest difference of q_out, k_out
    from eager's; ``grad_max_abs_vs_eager``: of dq, dk, dq_weight, dk_weight."""
    device = "cuda" if CUDA else "cpu"
    compile_backend = "inductor" if CUDA else "aot_eager"
    families = {"qwen3": (4, 2, 128), "gemma3": (2, 1, 256)} if toy else QK_FAMILIES
    tokens = [16] if toy else QK_TOKENS
    rows = []
    for family, (h, hk, d) in families.items():
        if _hf_qk(family) is None:
            UNAVAILABLE["transformers qk norms"] = "transformers does not import"
            return rows
        eager = _qk_eager_fn(family, d, device)
        factories = {"eager HF": lambda: eager,
                     "compile HF": lambda: torch.compile(eager, backend=compile_backend, dynamic=True),
                     "liger rms_norm + rope": lambda: _qk_liger_fn(family, d, device),
                     "normfuse": lambda: _qk_normfuse_fn(family, d, device)}
        fns = {}
        for name, make in factories.items():
            try:
                fns[name] = make()
            except Exception as error:  # noqa: BLE001 - a peer that does not import is reported, not fatal
                UNAVAILABLE[f"qk_rope {name}"] = f"{type(error).__name__}: {error}"
        for t in tokens:
            g = torch.Generator(device=device).manual_seed(0)

            def randn(*shape):
                return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g)
            q = randn(1, t, h * d).view(1, t, h, d).requires_grad_()   # q_proj(x).view(B, S, H, D)
            k = randn(1, t, hk * d).view(1, t, hk, d).requires_grad_()
            wq, wk = (randn(d).requires_grad_() for _ in range(2))
            angles = torch.arange(t, device=device)[:, None] * 1e6 ** (-torch.arange(0, d, 2, device=device) / d)
            emb = torch.cat((angles, angles), dim=-1)[None]            # (1, S, D), HF's rotary embedding
            cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
            dq, dk = randn(1, h, t, d), randn(1, hk, t, d)
            fwd_bytes, bwd_bytes = qk_rope_bytes(t, h, hk, d)
            row = {"family": family, "T": t, "H": h, "Hk": hk, "D": d, "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes}
            reference = None
            for name, fn in fns.items():
                try:
                    with torch.no_grad():
                        ms, row["timing"] = _time_ms(lambda: fn(q, k, wq, wk, cos, sin), toy)
                    row[f"{name}_fwd_ms"], row[f"{name}_fwd_GBps"] = ms, fwd_bytes / (ms * 1e-3) / 1e9

                    def step():
                        q_out, k_out = fn(q, k, wq, wk, cos, sin)
                        return torch.autograd.grad((q_out, k_out), (q, k, wq, wk), (dq, dk))
                    ms, _ = _time_ms(step, toy)
                    row[f"{name}_fwd_bwd_ms"] = ms
                    row[f"{name}_fwd_bwd_GBps"] = (fwd_bytes + bwd_bytes) / (ms * 1e-3) / 1e9
                    with torch.no_grad():
                        outs = fn(q, k, wq, wk, cos, sin)
                    grads = step()
                    if name == "eager HF":
                        reference = outs, grads
                    elif reference is not None:
                        for what, mine, theirs in (("max_abs_vs_eager", outs, reference[0]),
                                                   ("grad_max_abs_vs_eager", grads, reference[1])):
                            row[f"{name}_{what}"] = max((a.float() - b.float()).abs().max().item()
                                                        for a, b in zip(mine, theirs))
                except Exception as error:  # noqa: BLE001 - one provider failing must not end the run
                    row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                if CUDA:
                    torch.cuda.empty_cache()
            for name in fns:
                for step_name in ("fwd", "fwd_bwd"):
                    if name != "normfuse" and f"{name}_{step_name}_ms" in row and f"normfuse_{step_name}_ms" in row:
                        row[f"{step_name}_x_vs_{name}"] = (row[f"{name}_{step_name}_ms"]
                                                           / row[f"normfuse_{step_name}_ms"])
            rows.append(row)
            print(f"  qk_rope {family} T={t}: " + ", ".join(
                f"{k_[:-5]} {v:.0f} GB/s" for k_, v in row.items() if k_.endswith("_GBps")), flush=True)
    return rows


DIT_MODELS = {"flux-dev": 3072, "wan2.1-14b": 5120}  # hidden sizes
DIT_TOKENS = [4096, 16384]


def dit_chain(toy: bool) -> list[dict]:
    """The adaLN block tail (module docstring), forward and forward+backward, per model and token count."""
    device = "cuda" if CUDA else "cpu"
    shapes = [("toy", 64, 8)] if toy else [(name, c, t) for name, c in DIT_MODELS.items() for t in DIT_TOKENS]
    compile_backend = "inductor" if CUDA else "aot_eager"

    def eager(x, r, gate, scale, shift):
        s = r + gate * x
        return F.layer_norm(s, (s.shape[-1],), None, None, EPS) * (1 + scale) + shift, s

    def fused(x, r, gate, scale, shift):
        return add_norm(x, r, None, None, kind="layer_norm", eps=EPS, x_gate=gate,
                        modulation=Modulation(1 + scale, shift))

    rows = []
    for name, c, t in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        x, r = (torch.randn(1, t, c, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                for _ in range(2))
        emb = torch.randn(1, 6 * c, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
        shift, scale, gate = (piece[:, None] for piece in emb.chunk(6, dim=-1)[:3])
        args = (x, r, gate, scale, shift)
        providers = {"eager": eager, "compile": torch.compile(eager, backend=compile_backend), "normfuse": fused}
        row = {"model": name, "T": t, "C": c}
        elem = x.element_size()
        for provider, fn in providers.items():
            try:
                with torch.no_grad():
                    row[f"{provider}_fwd_ms"], _ = _time_ms(lambda: fn(*args), toy)
                y, s = fn(*args)
                dy, ds = torch.randn_like(y), torch.randn_like(s)
                row[f"{provider}_fwd_bwd_ms"], _ = _time_ms(
                    lambda: torch.autograd.grad(fn(*args), (x, r, emb), (dy, ds)), toy)
                row[f"{provider}_fwd_GBps"] = 4 * t * c * elem / (row[f"{provider}_fwd_ms"] * 1e-3) / 1e9
                row[f"{provider}_fwd_bwd_GBps"] = 10 * t * c * elem / (row[f"{provider}_fwd_bwd_ms"] * 1e-3) / 1e9
                if provider != "eager":
                    want, got = eager(*args), fn(*args)
                    row[f"{provider}_max_diff"] = max((a.float() - b.float()).abs().max().item()
                                                      for a, b in zip(got, want))
            except Exception as error:  # noqa: BLE001 - one provider failing must not end the run
                row[f"{provider}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        for peer in ("eager", "compile"):
            for step in ("fwd", "fwd_bwd"):
                if f"{peer}_{step}_ms" in row and f"normfuse_{step}_ms" in row:
                    row[f"{step}_x_vs_{peer}"] = row[f"{peer}_{step}_ms"] / row[f"normfuse_{step}_ms"]
        rows.append(row)
        print(f"  dit {name} T={t}: " + ", ".join(
            f"{k[:-5]} {v:.0f} GB/s" for k, v in row.items() if k.endswith("_GBps")), flush=True)
    return rows


def llama_block(toy: bool) -> list[dict]:
    """One HF llama decoder block (inside LlamaModel, 1 layer) forward+backward."""
    import copy

    import normfuse
    from normfuse import zoo
    device = "cuda" if CUDA else "cpu"
    dtype = torch.bfloat16 if CUDA else torch.float32
    size = (dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
            if toy else dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                             num_key_value_heads=32, head_dim=128))
    base = zoo.hf_model("llama", dtype=dtype, device=device, num_hidden_layers=1, vocab_size=1024, **size)
    base.train()
    batch, seq = (1, 4) if toy else (4, 2048)
    inputs = zoo.example_inputs(base, batch=batch, seq=seq)
    rows = []
    for name in ("eager", "normfuse"):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        if name == "normfuse":
            normfuse.optimize(model)

        def step(model=model):
            model(**inputs).last_hidden_state.float().square().mean().backward()
        step()
        if CUDA:
            import triton.testing
            ms = triton.testing.do_bench(step, warmup=3, rep=200, return_mode="median", grad_to_none=None)
        else:
            ms, _ = _time_ms(step, toy)
        rows.append({"model": "llama block", "variant": name, "tokens": batch * seq,
                     "hidden": size["hidden_size"], "dtype": str(dtype), "fwd_bwd_ms": ms,
                     "fused": sum(s.fused for s in normfuse.report(model).sites) if name == "normfuse" else 0})
    rows[1]["speedup"] = rows[0]["fwd_bwd_ms"] / rows[1]["fwd_bwd_ms"]
    return rows


def main(argv=None) -> dict:
    def options(p):
        p.add_argument("--budget-s", type=float, default=420, help="stop starting new shapes after this many seconds")
        p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="run only these sections")
    args = parse_args(__doc__.splitlines()[0], argv, options)
    explicit = "--out" in (sys.argv[1:] if argv is None else argv)
    out = args.out if explicit else Path(os.environ["OUT"]) if os.environ.get("OUT") else args.out / "gpu"
    out.mkdir(parents=True, exist_ok=True)
    if not CUDA and not args.toy:
        print("no CUDA device: running the toy size under Triton's interpreter")
        args.toy = True
    device = "cuda" if CUDA else "cpu"
    ms, ns = ([8], [64]) if args.toy else (MS, NS)
    dtypes = {"bf16": torch.bfloat16} if args.toy else DTYPES  # the interpreter is slow
    torch._dynamo.config.cache_size_limit = 256
    torch._functorch.config.donated_buffer = False  # the backward is replayed (retain_graph=True)
    t_start = time.perf_counter()
    bandwidth = copy_bandwidth(args.toy)
    print(f"copy bandwidth: {bandwidth:.0f} GB/s", flush=True)
    rows, skipped = [], []
    for op in ("rms", "ln") if "ops" in args.only else ():
        table = providers(op, args.toy)
        for dtype_name, dtype in dtypes.items():
            for m in ms:
                for n in ns:
                    if time.perf_counter() - t_start > args.budget_s:
                        skipped.append(f"{op} {dtype_name} M={m} N={n}")
                        continue
                    for name, factory in table.items():
                        try:
                            row = measure(op, name, factory, m, n, dtype, device, args.toy)
                        except Exception as error:  # noqa: BLE001 - one provider failing must not end the run
                            row = {"op": op, "provider": name, "M": m, "N": n, "dtype": str(dtype)[6:],
                                   "error": f"{type(error).__name__}: {str(error)[:200]}"}
                        row["fwd_pct_copy"] = 100 * row.get("fwd_GBps", 0) / bandwidth
                        row["bwd_pct_copy"] = 100 * row.get("bwd_GBps", 0) / bandwidth
                        rows.append(row)
                        if CUDA:
                            torch.cuda.empty_cache()
                    print(f"  {op} {dtype_name} M={m} N={n}: " + ", ".join(
                        f"{r['provider']} {r.get('fwd_GBps', float('nan')):.0f}/{r.get('bwd_GBps', float('nan')):.0f}"
                        for r in rows if (r["op"], r["M"], r["N"], r["dtype"]) == (op, m, n, str(dtype)[6:])), flush=True)
    # ratios against every peer on the same shape
    for r in rows:
        if r["provider"].startswith("normfuse") and "fwd_ms" in r:
            peers = [p for p in rows if (p["op"], p["M"], p["N"], p["dtype"]) == (r["op"], r["M"], r["N"], r["dtype"])
                     and not p["provider"].startswith("normfuse") and "fwd_ms" in p]
            for p in peers:
                r[f"fwd_x_vs_{p['provider']}"] = p["fwd_ms"] / r["fwd_ms"]
                r[f"bwd_x_vs_{p['provider']}"] = p["bwd_ms"] / r["bwd_ms"]
    block, mode_rows = [], []
    def runs(section: str, grace_s: float) -> bool:  # chosen, and started before the budget (+ grace) is spent
        return section in args.only and time.perf_counter() - t_start < args.budget_s + grace_s
    if runs("llama_block", 60):
        block = llama_block(args.toy)
    if runs("modes", 120):
        mode_rows = modes(args.toy)
    quant_rows = quant_modes(args.toy) if runs("quant", 180) else []
    gated_rows = gated_modes(args.toy) if runs("gated", 240) else []
    qk_rows = qk_rope(args.toy) if runs("qk_rope", 300) else []
    dit_rows = dit_chain(args.toy) if runs("dit", 360) else []
    for r in qk_rows + dit_rows:  # % of the copy bandwidth measured above
        for key in [k for k in r if k.endswith("_GBps")]:
            r[key[:-5] + "_pct_copy"] = 100 * r[key] / bandwidth
    ours = [r for r in rows if r["provider"] == "normfuse" and "fwd_ms" in r]
    big = [r for r in ours if r["N"] >= 1024 and r["M"] >= 16384]
    verdict = {
        "copy_GBps": bandwidth, "seconds": time.perf_counter() - t_start, "skipped_shapes": skipped,
        "unavailable_peers": UNAVAILABLE, "toy": args.toy, "device": torch.cuda.get_device_name() if CUDA else "cpu",
        "min_fwd_pct_copy_N1024_M16384": min((r["fwd_pct_copy"] for r in big), default=None),
        "min_bwd_pct_copy_N1024_M16384": min((r["bwd_pct_copy"] for r in big), default=None),
        "min_x_vs_any_peer": min((v for r in ours for k, v in r.items() if k.startswith(("fwd_x_vs", "bwd_x_vs"))),
                                 default=None),
        "min_fwd_x_vs_hf_eager": min((r2.get("fwd_x_vs_eager HF LlamaRMSNorm", float("inf"))
                                      for r2 in rows if r2["provider"] == "normfuse (llama rounding)"), default=None),
    }
    if rows:
        write_csv(out / "gpu_ops.csv", rows)
    if block:
        write_csv(out / "gpu_llama_block.csv", block)
    if mode_rows:
        write_csv(out / "gpu_modes.csv", mode_rows)
    if quant_rows:
        write_csv(out / "gpu_quant.csv", quant_rows)
    if gated_rows:
        write_csv(out / "gpu_gated.csv", gated_rows)
    if qk_rows:
        write_csv(out / "gpu_qk_rope.csv", qk_rows)
    if dit_rows:
        write_csv(out / "gpu_dit.csv", dit_rows)
    verdict["min_dit_x_vs_peer"] = {step: min((v for r in dit_rows for k, v in r.items()
                                               if k.startswith(f"{step}_x_vs_")), default=None)
                                    for step in ("fwd", "fwd_bwd")}
    verdict["min_quant_x_vs_eager"] = min((r["x_vs_eager"] for r in quant_rows if "x_vs_eager" in r), default=None)
    verdict["min_gated_x_vs_eager_hf"] = min((v for r in gated_rows for k, v in r.items()
                                              if k.endswith("_x_vs_eager HF")), default=None)
    verdict["min_qk_rope_x_vs_peer"] = {step: min((v for r in qk_rows for k, v in r.items()
                                                   if k.startswith(f"{step}_x_vs_")), default=None)
                                        for step in ("fwd", "fwd_bwd")}
    verdict["min_qk_rope_normfuse_pct_copy"] = {
        step: min((r[f"normfuse_{step}_pct_copy"] for r in qk_rows if f"normfuse_{step}_pct_copy" in r), default=None)
        for step in ("fwd", "fwd_bwd")}
    write_json(out / "gpu.json", {"machine": machine(), "verdict": verdict, "rows": rows, "llama_block": block,
                                  "modes": mode_rows, "quant": quant_rows, "gated": gated_rows, "qk_rope": qk_rows,
                                  "dit": dit_rows})

    def draw(ax):
        for prov in sorted({r["provider"] for r in rows if r["op"] == "rms" and r["dtype"] == "bfloat16"}):
            pts = [(r["N"], r.get("fwd_pct_copy", 0)) for r in rows if r["op"] == "rms" and r["provider"] == prov
                   and r["dtype"] == "bfloat16" and r["M"] == ms[0]]
            if pts:
                ax.plot(*zip(*sorted(pts)), "o-", label=prov, markersize=3)
        ax.set(xscale="log", xlabel="N", ylabel="% of copy bandwidth", title=f"add + RMSNorm forward, bf16, M={ms[0]}")
        ax.legend(fontsize=6)
    if rows:
        save_plot(out / "gpu_rms_fwd.png", draw)

    def draw_qk(ax):
        names = sorted({k[:-len("_fwd_bwd_pct_copy")] for r in qk_rows for k in r if k.endswith("_fwd_bwd_pct_copy")})
        for family in sorted({r["family"] for r in qk_rows}):
            for name in names:
                pts = [(r["T"], r[f"{name}_fwd_bwd_pct_copy"]) for r in qk_rows
                       if r["family"] == family and f"{name}_fwd_bwd_pct_copy" in r]
                if pts:
                    ax.plot(*zip(*sorted(pts)), "o-" if family == "qwen3" else "s--", label=f"{family} {name}",
                            markersize=3)
        ax.set(xscale="log", xlabel="tokens", ylabel="% of copy bandwidth",
               title="QK-norm + RoPE forward+backward, bf16")
        ax.legend(fontsize=6)
    if qk_rows:
        save_plot(out / "gpu_qk_rope.png", draw_qk)
    print(markdown_table([r for r in rows if "fwd_ms" in r],
                         ["op", "provider", "dtype", "M", "N", "fwd_GBps", "fwd_pct_copy", "bwd_GBps", "bwd_pct_copy",
                          "timing"]))
    if block:
        print(markdown_table(block))
    if qk_rows:
        print(markdown_table(qk_rows, ["family", "T", "H", "Hk", "D"] + [
            k for k in qk_rows[0] if k.endswith(("_GBps", "_pct_copy")) or "_x_vs_" in k]))
    print("verdict:", verdict)
    return verdict


if __name__ == "__main__":
    main()
