"""Benchmark 1: static kernel report, compiled ahead of time without a GPU.

Every launch configuration the launcher picks (``_blocking``: block, warps, single pass
or looped) for N in 512..65536, each dtype and each op the pass emits (forward and
backward), is compiled for ``GPUTarget("cuda", 90, 32)``, ``("cuda", 80, 32)`` and
``("hip", "gfx942", 64)``. Reported per kernel:

* registers per thread, spills (cubin ``LOCAL`` bytes via the ``cuobjdump`` shipped in
  the triton wheel; AMD: VGPR/SGPR spill counts from the hsaco metadata), shared memory;
* an occupancy estimate (resident warps / the SM's or SIMD's maximum, from registers);
* from the PTX: global loads and stores per row element of each tensor, found by
  following each ``ld.global``/``st.global`` address back to the kernel parameter it
  was computed from. 1.0 means the tensor is read (written) exactly once per row.

Targets: no spills in single-pass configurations up to N = 32768 in bf16; the forward
reads each input once and writes each output once per row (the fp8 epilogue: q once, as bytes).

    python benchmarks/bench_static_kernels.py [--toy] [--targets cuda90 cuda80 gfx942] [--ops quant]
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NORMFUSE_TRITON_CPU") == "1":
    # kernels defined under the interpreter cannot be compiled: start again without it
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NORMFUSE_TRITON_CPU")}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import machine, markdown_table, parse_args, save_plot, write_csv, write_json

import torch

from normfuse.errors import NormfuseError

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from normfuse.kernels import add_norm as K
from normfuse.kernels import triton as KT

TARGETS = {"cuda90": GPUTarget("cuda", 90, 32), "cuda80": GPUTarget("cuda", 80, 32),
           "gfx942": GPUTarget("hip", "gfx942", 64)}
NS = [512, 1024, 2048, 3072, 4096, 5120, 8192, 16384, 32768, 65536]  # 3072, 5120: Flux-dev, Wan 2.1 14B
DTYPES = {"fp32": (torch.float32, tl.float32), "fp16": (torch.float16, tl.float16),
          "bf16": (torch.bfloat16, tl.bfloat16)}
FLOAT_ARGS = {"eps", "weight_offset", "residual_scale"}
INT_ARGS = {"N", "HW"}  # the kernels name pointers in capitals; N and HW (positions) are integers
STAT_PTRS = {"MEAN", "RSTD", "DW_PART", "DB_PART", "DW1_PART", "DB1_PART",  # fp32: per-row stats, dw/db partials,
             "QS", "SC",                                                    # quantization scales,
             "DSCALE_PART", "DSHIFT_PART", "DXGATE_PART"}                   # the adaLN chain's partials per run
BYTE_PTRS = {"Q"}  # the fp8 output, written as its bytes
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


class StaticReportError(NormfuseError):
    """The kernels changed in a way this report does not know yet."""


@dataclass
class Op:
    """One op the pass emits: which kernel pair, its flags (which operands it has, its options: kernel_args
    turns them into the kernel's arguments), its tensors."""

    name: str
    backward: bool
    flags: dict
    inputs: tuple          # tensors read once per row
    outputs: tuple         # tensors written once per row


# add_norm's modes (x1, rowscale, weight1/bias1, dropout) and its fp8 epilogue, off unless an op turns them on
NO_QUANT = dict(QUANT=False, QUANT_E5M2=False, QUANT_STATIC=False, QUANT_GROUP=0, SCALE_FORM=0, HAS_AMAX_MIN=False,
                HAS_SCALE_MIN=False, QUANT_APPLY=0, HAS_CLAMP=False, SCALE_RECIPROCAL=False)
NO_GATE = dict(HAS_GATE=False, GATE_AFTER=False, GATE_SILU=True, NORM_GROUP=0)
NO_MODES = dict(HAS_X1=False, HAS_ROWSCALE=False, HAS_W1=False, HAS_B1=False, HAS_DROPOUT=False, **NO_QUANT,
                **NO_GATE)
# y = F.rms_norm(x + r, w) quantized to e4m3 (y itself not stored: the next linear reads q)
QUANT_RMS = dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=False, STORE_SUM=True,
                 STORE_Y=False, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_X1=False,
                 HAS_ROWSCALE=False, HAS_W1=False, HAS_B1=False, HAS_DROPOUT=False)


def _quant(**flags) -> dict:
    return dict(QUANT_RMS, **NO_GATE, **dict(NO_QUANT, QUANT=True, HAS_CLAMP=True, **flags))
NO_MODES_BWD = dict(HAS_DY1=False, HAS_B1=False, HAS_DX1=False, HAS_ROWSCALE=False, HAS_DROPOUT=False, HAS_B=False,
                    **NO_GATE)
# gated RMSNorms, no residual (inside a Mamba2 / Qwen3-Next mixer): Mamba2's gate before the norm with
# statistics per group of 256 columns, Qwen3-Next's gate after it; both with llama rounding
GATED = dict(HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=True, STORE_SUM=False,
             STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_X1=False,
             HAS_ROWSCALE=False, HAS_W1=False, HAS_B1=False, HAS_DROPOUT=False, **NO_QUANT)
GATED_BWD = dict(HAS_DEXTRA=False, HAS_WEIGHT=True, HAS_BIAS=False, HAS_DRES=False, IS_RMS=True, ADD_AFTER_NORM=False,
                 HAS_DY1=False, HAS_B1=False, HAS_DX1=False, HAS_ROWSCALE=False, HAS_DROPOUT=False, HAS_B=False)

OPS = [
    Op("add_rms_norm (HF llama: round, then * w)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=True, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, **NO_MODES), ("X", "R"),
       ("Y", "S")),
    Op("add_layer_norm (w, b; BERT, GPT-2)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, **NO_MODES), ("X", "R"),
       ("Y", "S")),
    Op("rms_norm (standalone)", False,
       dict(HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=True, STORE_SUM=False,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, **NO_MODES), ("X",),
       ("Y",)),
    Op("rms_norm_add (res-post, sandwich)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=False, ADD_AFTER_NORM=True, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, **NO_MODES), ("X", "R"),
       ("S",)),
    Op("add_rms_norm backward", True,
       dict(HAS_DEXTRA=True, HAS_WEIGHT=True, HAS_BIAS=False, HAS_DRES=True, IS_RMS=True, ADD_AFTER_NORM=False,
            **NO_MODES_BWD),
       ("DY", "DE", "INP"), ("DX", "DRES")),
    Op("add_layer_norm backward", True,
       dict(HAS_DEXTRA=True, HAS_WEIGHT=True, HAS_BIAS=True, HAS_DRES=True, IS_RMS=False, ADD_AFTER_NORM=False,
            **NO_MODES_BWD),
       ("DY", "DE", "INP"), ("DX", "DRES")),
    # flash-attn's modes: a parallel block's two branches, drop path, dropout and a second norm
    Op("add_layer_norm + x1, rowscale, dropout, weight1/bias1", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_X1=True,
            HAS_ROWSCALE=True, HAS_W1=True, HAS_B1=True, HAS_DROPOUT=True, **NO_QUANT, **NO_GATE),
       ("X", "R", "X1"), ("Y", "S", "Y1")),
    Op("add_layer_norm + modes backward", True,
       dict(HAS_DEXTRA=True, HAS_WEIGHT=True, HAS_BIAS=True, HAS_DRES=True, IS_RMS=False, ADD_AFTER_NORM=False,
            HAS_DY1=True, HAS_B1=True, HAS_DX1=True, HAS_ROWSCALE=True, HAS_DROPOUT=True, HAS_B=False, **NO_GATE),
       ("DY", "DE", "INP", "DY1"), ("DX", "DRES", "DX1")),
    # the fp8 epilogue (vLLM/FlashInfer's add + RMSNorm + quant): a dynamic scale per token, one per
    # group of 128 columns, a static scale
    Op("add_rms_norm + fp8 quant, scale per row", False, _quant(HAS_AMAX_MIN=True), ("X", "R"), ("S", "Q")),
    Op("add_rms_norm + fp8 quant, scale per group of 128", False, _quant(QUANT_GROUP=128, HAS_AMAX_MIN=True),
       ("X", "R"), ("S", "Q")),
    Op("add_rms_norm + fp8 quant, static scale", False, _quant(QUANT_STATIC=True), ("X", "R"), ("S", "Q")),
    # a diffusion transformer's block tail (DiT, Flux, Wan): s = r + gate * x, y = layer_norm(s) * scale + shift
    Op("add_layer_norm + gated branch + modulation (DiT, Flux, Wan)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=False, HAS_BIAS=False, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_XGATE=True,
            HAS_MOD=True, **NO_MODES), ("X", "R"), ("Y", "S")),
    # Wan 2.2 TI2V / LTX: a per-token scale, the factor 1 + scale computed in the epilogue
    Op("add_layer_norm + modulation, factor 1 + scale (Wan 2.2, LTX)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=False, HAS_BIAS=False, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_MOD=True,
            ONE_PLUS=True, **NO_MODES), ("X", "R"), ("Y", "S")),
    # SD3.5's AdaLayerNormZeroX: one norm, its y modulated twice (y and y1)
    Op("add_layer_norm + two modulations (DiT, SD3.5)", False,
       dict(HAS_RESIDUAL=True, HAS_WEIGHT=False, HAS_BIAS=False, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
            STORE_Y=True, ADD_AFTER_NORM=False, SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True, HAS_MOD=True,
            HAS_MOD1=True, **NO_MODES), ("X", "R"), ("Y", "S", "Y1")),
    # ... and its backward in the kernels: dscale, dshift and dx_gate per sample (partial rows per program)
    Op("add_layer_norm + gated branch + modulation backward (DiT, Flux, Wan)", True,
       dict(HAS_DEXTRA=True, HAS_WEIGHT=False, HAS_BIAS=False, HAS_DRES=True, IS_RMS=False, ADD_AFTER_NORM=False,
            ADALN=("per_sample", True), **NO_MODES_BWD),
       ("DY", "DE", "INP", "XB"), ("DX", "DRES")),
    # ... per token (Wan 2.2, LTX): the scale's and the shift's gradients stored per row
    Op("add_layer_norm + modulation backward, per token, factor 1 + scale (Wan 2.2, LTX)", True,
       dict(HAS_DEXTRA=True, HAS_WEIGHT=False, HAS_BIAS=False, HAS_DRES=True, IS_RMS=False, ADD_AFTER_NORM=False,
            ADALN=("per_token", False), ONE_PLUS=True, **NO_MODES_BWD),
       ("DY", "DE", "INP", "MS", "MH"), ("DX", "DRES", "DSCALE", "DSHIFT")),
    Op("gated rms_norm (Mamba2: gate before, groups of 256)", False,
       dict(GATED, HAS_GATE=True, GATE_AFTER=False, GATE_SILU=True, NORM_GROUP=256), ("X", "Z"), ("Y",)),
    Op("gated rms_norm (Qwen3-Next: gate after)", False,
       dict(GATED, HAS_GATE=True, GATE_AFTER=True, GATE_SILU=True, NORM_GROUP=0), ("X", "Z"), ("Y",)),
    Op("gated rms_norm (Mamba2) backward", True,
       dict(GATED_BWD, HAS_GATE=True, GATE_AFTER=False, GATE_SILU=True, NORM_GROUP=256), ("DY", "INP", "Z"),
       ("DX", "DZ")),
    Op("gated rms_norm (Qwen3-Next) backward", True,
       dict(GATED_BWD, HAS_GATE=True, GATE_AFTER=True, GATE_SILU=True, NORM_GROUP=0), ("DY", "INP", "Z"),
       ("DX", "DZ")),
]


def _kernel(op: Op, looped: bool):
    if op.backward:
        return K._add_norm_bwd_looped_kernel if looped else K._add_norm_bwd_kernel
    return K._add_norm_fwd_looped_kernel if looped else K._add_norm_fwd_kernel


# ------------------------------------------------------------------ kernel signatures

@dataclass(frozen=True)
class Leaf:
    """One value a kernel receives: its AOT type ("*bf16", "i32", "fp32", ... or "constexpr" with
    ``value``), whether a launch specializes it as divisible by 16, and the name the PTX report gives it
    (pointers in capitals, as the kernels name them)."""

    type: str
    name: str = "?"
    value: object = None
    divisible: bool = False


def _leaves(arg, path: tuple):
    """(path, Leaf) of every leaf of an argument, tuples nested in tuples included (an operand inside
    an operand: x's gate in X)."""
    if not isinstance(arg, tuple):
        yield path, arg
        return
    for j, item in enumerate(arg):
        yield from _leaves(item, path + (j,))


def _types(arg):
    return tuple(_types(item) for item in arg) if isinstance(arg, tuple) else arg.type


def kernel_source(fn, args: dict) -> tuple[ASTSource, list[str]]:
    """The ASTSource of ``fn`` for ``args`` (per parameter: a constexpr value for a constexpr parameter,
    else a Leaf, or a tuple of Leafs for a tuple argument: an operand's (pointer, strides) or a group of
    scalars), and the names of the compiled kernel's parameters in order (its non-constexpr leaves)."""
    signature, constexprs, attrs, names = {}, {}, {}, []
    for i, name in enumerate(fn.arg_names):
        if fn.params[i].is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = args[name]
            continue
        arg = args[name]
        for path, leaf in _leaves(arg, (i,)):
            if leaf.type == "constexpr":
                constexprs[path] = leaf.value
                continue
            names.append(leaf.name)
            if leaf.divisible:
                attrs[path] = [["tt.divisibility", 16]]
        signature[name] = _types(arg)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), names


def pointer(name: str, tl_dtype, present: bool = True) -> Leaf:
    """A tensor's pointer as the launcher passes it (16-byte aligned), or None (absent: a constexpr)."""
    if not present:
        return Leaf("constexpr", name)
    ptr_type = "fp32" if name in STAT_PTRS else "u8" if name in BYTE_PTRS else _ptr_type(tl_dtype)
    return Leaf(f"*{ptr_type}", name, divisible=True)


def operand(name: str, tl_dtype, present: bool = True, strides: int = 1, constant: dict = None) -> tuple:
    """A (pointer, strides) operand: strides divisible by 16 (contiguous rows of N a multiple of 16),
    ``constant`` {index: value} of strides a launch specializes (a stride of 1)."""
    constant = constant or {}
    return (pointer(name, tl_dtype, present),
            *(Leaf("constexpr", value=constant[j]) if j in constant else
              Leaf("i32", f"stride_{name}_{j}", divisible=True) for j in range(1, strides + 1)))


def broadcast(name: str, tl_dtype) -> tuple:
    """A broadcast operand per sample: (pointer, outer stride divisible by 16, period, inner stride 0)."""
    return (pointer(name, tl_dtype), Leaf("i32", f"stride_{name}", divisible=True), Leaf("i32", f"period_{name}"),
            Leaf("constexpr", value=0))


def scalar(name: str, present: bool = True, type_: str = "fp32") -> Leaf:
    return Leaf(type_, name.lower()) if present else Leaf("constexpr", name.lower())


def kernel_args(op: Op, tl_dtype, block: int) -> dict:
    """The row kernels' arguments for ``op``: its flags say which operands exist (absent: None) and
    set the constexpr options."""
    f = op.flags
    if op.backward:
        has_dy1 = f["HAS_DY1"]
        present = dict(DY=True, DE=f["HAS_DEXTRA"], INP=True, DY1=has_dy1, Z=f["HAS_GATE"], DX=True,
                       DRES=f["HAS_DRES"], DX1=f["HAS_DX1"], DZ=f["HAS_GATE"])
        vectors = dict(MEAN=True, RSTD=True, W=f["HAS_WEIGHT"], B=f["HAS_B"], W1=has_dy1, RS=f["HAS_ROWSCALE"],
                       DW_PART=f["HAS_WEIGHT"], DB_PART=f["HAS_BIAS"], DW1_PART=has_dy1,
                       DB1_PART=has_dy1 and f["HAS_B1"])
        constexprs = dict(IS_RMS=f["IS_RMS"], ADD_AFTER_NORM=f["ADD_AFTER_NORM"],
                          GATE_OPTS=(f["GATE_AFTER"], f["GATE_SILU"]), NORM_GROUP=f["NORM_GROUP"], BLOCK_N=block)
        scalars = dict(n_rows=scalar("n_rows", type_="i32"), rows_per_program=scalar("rows_per_program", type_="i32"))
    else:
        quant, static = f["QUANT"], f["QUANT_STATIC"]
        present = dict(X=True, R=f["HAS_RESIDUAL"], Y=f["STORE_Y"], S=f["STORE_SUM"], X1=f["HAS_X1"],
                       Y1=f["HAS_W1"] or f.get("HAS_MOD1", False),
                       Z=f["HAS_GATE"], Q=quant, QS=quant and not static)
        vectors = dict(W=f["HAS_WEIGHT"], B=f["HAS_BIAS"], MEAN=True, RSTD=True, RS=f["HAS_ROWSCALE"], W1=f["HAS_W1"],
                       B1=f["HAS_B1"], SC=quant and static)
        constexprs = dict(DTYPES=(tl_dtype,) * 4, IS_RMS=f["IS_RMS"], ROUND_FIRST=f["ROUND_FIRST"],
                          ADD_AFTER_NORM=f["ADD_AFTER_NORM"], SCALE_RESIDUAL=f["SCALE_RESIDUAL"],
                          ROUND_SUM_FIRST=f["ROUND_SUM_FIRST"], GATE_OPTS=(f["GATE_AFTER"], f["GATE_SILU"], tl_dtype),
                          NORM_GROUP=f["NORM_GROUP"],
                          QUANT_OPTS=(f["QUANT_E5M2"], f["QUANT_GROUP"], f["SCALE_FORM"], f["QUANT_APPLY"],
                                      f["SCALE_RECIPROCAL"]), BLOCK_N=block)
        scalars = dict(n_rows=scalar("n_rows", type_="i32"), rows_per_program=scalar("rows_per_program", type_="i32"),
                       eps=scalar("eps"),
                       QUANT=(scalar("quant_max"), scalar("quant_amax_min", f["HAS_AMAX_MIN"]),
                              scalar("quant_scale_min", f["HAS_SCALE_MIN"]), scalar("quant_clamp", f["HAS_CLAMP"])))
    args = {name: operand(name, tl_dtype, on) for name, on in present.items()}
    if not op.backward:  # the residual has x's rows (period None; a broadcast table of positions has one)
        args["R"] = (*args["R"], Leaf("constexpr", value=None))
        # x's gate (the gated residual branch) and the modulation's scale and shift: (pointer, outer
        # stride, period, inner stride), per sample (a chunk of one embedding: inner stride 0)
        args["X"] = (*args["X"], broadcast("XG", tl_dtype) if f.get("HAS_XGATE") else Leaf("constexpr", value=None))
        has_mod = f.get("HAS_MOD", False)
        second = (broadcast("MS1", tl_dtype), broadcast("MH1", tl_dtype)) if f.get("HAS_MOD1") else \
            (tuple(Leaf("constexpr", value=v) for v in (None, 0, 1, 0)),) * 2  # no second modulation
        args["MOD"] = (broadcast("MS", tl_dtype), broadcast("MH", tl_dtype), *second) if has_mod else \
            Leaf("constexpr", value=None)
        constexprs["MOD_OPTS"] = (False, tl_dtype, tl_dtype, f.get("ONE_PLUS", False)) if has_mod else None
    if op.backward:
        args["ADALN"], constexprs["ADALN_OPTS"] = _adaln_args(f, tl_dtype)
    constexprs["L2"] = False
    args.update({name: pointer(name, tl_dtype, on) for name, on in vectors.items()})
    args.update(scalars, **constexprs, N=Leaf("i32", "N", divisible=True), weight_offset=scalar("weight_offset"),
                residual_scale=scalar("residual_scale"),
                DROPOUT=(scalar("seed", f["HAS_DROPOUT"], "i64"), scalar("dropout_p"), scalar("dropout_scale")))
    return args


def _adaln_args(f: dict, tl_dtype) -> tuple[tuple, tuple]:
    """The backward kernels' ADALN and ADALN_OPTS: the modulation's scale and shift (and the gated
    branch's x_gate with its x) per sample, their gradients summed per run into fp32 partial rows, or per
    token, stored per row; absent: (None, 0, 1, 0) operands and no outputs."""
    absent = tuple(Leaf("constexpr", value=v) for v in (None, 0, 1, 0))
    layout, gated = f.get("ADALN", (None, False))
    if layout is None:
        none = Leaf("constexpr", value=None)
        return (absent, absent, absent, (none, Leaf("constexpr", value=0)), none, none, none), (False, 0, 0, 0)
    if layout == "per_sample":
        scale, shift = broadcast("MS", tl_dtype), broadcast("MH", tl_dtype)
        outs, mode = ("DSCALE_PART", "DSHIFT_PART", "DXGATE_PART"), 1
    else:  # per token: a row of each per row of x (outer stride, period, inner stride)
        scale, shift = ((pointer(name, tl_dtype), Leaf("i32", f"stride_{name}", divisible=True),
                         Leaf("i32", f"period_{name}"), Leaf("i32", f"inner_{name}", divisible=True))
                        for name in ("MS", "MH"))
        outs, mode = ("DSCALE", "DSHIFT", "DXGATE"), 2
    x_gate = broadcast("XG", tl_dtype) if gated else absent
    xb = operand("XB", tl_dtype, gated)
    grads = (pointer(outs[0], tl_dtype), pointer(outs[1], tl_dtype), pointer(outs[2], tl_dtype, gated))
    return (scale, shift, x_gate, xb, *grads), (f.get("ONE_PLUS", False), mode, mode, mode if gated else 0)


def source(op: Op, dtype: str, block: int, looped: bool) -> tuple[ASTSource, list[str]]:
    """The kernel as the launcher would launch it: types, constexprs, 16-divisibility of
    pointers, strides and N (true for contiguous rows with N a multiple of 16); and the names of
    its compiled parameters."""
    fn = _kernel(op, looped)
    args = kernel_args(op, DTYPES[dtype][1], block)
    missing = [name for name in fn.arg_names if name not in args]
    if missing:
        raise StaticReportError(f"kernel {fn.__name__} has parameters {missing} that op {op.name!r} does not "
                                f"set; add them to kernel_args in benchmarks/bench_static_kernels.py.")
    return kernel_source(fn, args)


def _is_pointer(name: str) -> bool:
    return name.isupper() and name not in INT_ARGS


def _ptr_type(tl_dtype) -> str:
    return {tl.float32: "fp32", tl.float16: "fp16", tl.bfloat16: "bf16"}[tl_dtype]


# ------------------------------------------------------------------ PTX: global accesses per tensor

_PARAM = re.compile(r"ld\.param\.\w+\s+(%\w+),\s*\[(\w+)_param_(\d+)\]")
_INSTR = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s+(.*?);\s*$")
_REG = re.compile(r"%\w+")
_ACCESS = re.compile(r"^(ld|st)\.global(?:\.[\w:]+)*?(?:\.v(\d))?\.([bsuf])(\d+)$")


def ptx_accesses(ptx: str, arg_names: list[str]) -> dict[str, dict[str, int]]:
    """{tensor: {"load_bytes": per thread, "store_bytes": ..., "loads": n, "stores": n}}: each
    global access attributed to the pointer parameter its address was computed from (``arg_names``: the
    compiled kernel's parameters, kernel_source's names)."""
    origin: dict[str, set] = {}
    out: dict[str, dict[str, int]] = {}
    for line in ptx.splitlines():
        m = _PARAM.search(line)
        if m:
            index = int(m.group(3))
            name = arg_names[index] if index < len(arg_names) else "?"  # past them: the compiler's scratch
            origin[m.group(1)] = {name} if _is_pointer(name) else set()
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        opcode, operands = m.groups()
        access = _ACCESS.match(opcode)
        if access:
            kind, vec, _, bits = access.groups()
            addr = re.search(r"\[\s*(%\w+)", operands)
            ptrs = origin.get(addr.group(1), set()) if addr else set()
            name = "/".join(sorted(ptrs)) or "?"
            rec = out.setdefault(name, {"load_bytes": 0, "store_bytes": 0, "loads": 0, "stores": 0})
            width = int(vec or 1) * int(bits) // 8
            rec["load_bytes" if kind == "ld" else "store_bytes"] += width
            rec["loads" if kind == "ld" else "stores"] += 1
            if kind == "ld":
                for reg in _REG.findall(operands.split("[")[0]):
                    origin[reg] = set()
            continue
        regs = _REG.findall(operands)
        if not regs or opcode.startswith(("st.", "bra", "bar", "ret", "setp", "@")):
            continue
        dst, srcs = regs[0], regs[1:]
        origin[dst] = set().union(*(origin.get(r, set()) for r in srcs)) if srcs else set()
    return out


# ------------------------------------------------------------------ resources and occupancy

def cuda_resources(cubin: bytes) -> dict[str, int]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if not m:
        raise StaticReportError(f"cuobjdump printed no resource line for the kernel:\n{text}")
    return dict(zip(("regs", "stack", "shared_static", "local"), map(int, m.groups())))


def cuda_occupancy(regs: int, warps: int, shared: int, arch: int) -> float:
    """Resident warps / 64 on sm80/sm90: registers (256-register granules per warp,
    65536 per SM), shared memory (164 KiB sm80, 228 KiB sm90) and 32 blocks per SM."""
    per_warp = -(-max(regs, 1) * 32 // 256) * 256
    blocks_regs = 65536 // (per_warp * warps)
    smem = (164 if arch == 80 else 228) * 1024
    blocks_smem = smem // shared if shared else 32
    blocks = min(blocks_regs, blocks_smem, 32, 64 // warps)
    return blocks * warps / 64


def hip_resources(amdgcn: str) -> dict[str, int]:
    def field_(name):
        m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
        return int(m.group(1)) if m else 0
    return {"regs": field_("vgpr_count"), "agprs": field_("agpr_count"), "sgprs": field_("sgpr_count"),
            "local": field_("vgpr_spill_count") + field_("sgpr_spill_count"),
            "shared_static": field_("group_segment_fixed_size"), "stack": field_("private_segment_fixed_size")}


def hip_occupancy(vgprs: int, agprs: int, warps: int) -> float:
    """Waves per SIMD / 8 on gfx942: 512 registers per lane (VGPRs + AGPRs, granule 8); a
    block's waves spread over the CU's 4 SIMDs."""
    total = -(-(vgprs + agprs) // 8) * 8
    per_simd = min(8, 512 // max(total, 8))
    blocks = max(1, (per_simd * 4) // warps) if warps <= per_simd * 4 else 0
    return min(blocks * warps, per_simd * 4) / 32


# ------------------------------------------------------------------ one configuration

def configurations(ns: list[int], dtypes: list[str]):
    """(op, dtype, N, block, warps, looped), as ``_blocking`` picks them, deduplicated on
    what is compiled (all N past the single-pass limit share one looped kernel)."""
    seen = set()
    for op in OPS:
        for dtype in dtypes:
            size = DTYPES[dtype][0].itemsize
            for n in ns:
                two_norms = op.flags.get("HAS_W1", False) or op.flags.get("HAS_DY1", False)
                block, warps, looped = K._blocking(n, size, backward=op.backward, two_norms=two_norms,
                                                   quant=op.flags.get("QUANT", False),
                                                   gated=op.flags.get("HAS_GATE", False)
                                                   or op.flags.get("ADALN", (None,))[0] == "per_sample")
                key = (op.name, dtype, block, warps, looped)
                yield op, dtype, n, block, warps, looped, key in seen
                seen.add(key)


def launch_options(backward: bool, warps: int) -> dict:
    """The compile options the ops launch with: the forward kernels contract no fp32 product into an add."""
    return {"num_warps": warps} if backward else {"num_warps": warps, "enable_fp_fusion": False}


def compile_one(op: Op, dtype: str, block: int, warps: int, looped: bool, target: str) -> dict:
    src, names = source(op, dtype, block, looped)
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=TARGETS[target], options=launch_options(op.backward, warps))
    row = {"compile_s": time.perf_counter() - t0, "shared": kernel.metadata.shared}
    threads = warps * TARGETS[target].warp_size
    if target.startswith("cuda"):
        res = cuda_resources(kernel.asm["cubin"])
        row.update(res)
        row["occupancy"] = cuda_occupancy(res["regs"], warps, kernel.metadata.shared, TARGETS[target].arch)
        row["fma_f32"] = kernel.asm["ptx"].count("fma.rn.f32")  # contracted fp32 steps (forward: none, as eager)
        elem = DTYPES[dtype][0].itemsize
        for name, rec in ptx_accesses(kernel.asm["ptx"], names).items():
            if name in STAT_PTRS or name == "?":
                row[f"{name}_ld_st_instr"] = f"{rec['loads']}/{rec['stores']}"
                continue
            per_row = block * (1 if name in BYTE_PTRS else elem)  # one pass over a row block, all threads
            if rec["load_bytes"]:
                row[f"ld_{name}"] = rec["load_bytes"] * threads / per_row
            if rec["store_bytes"]:
                row[f"st_{name}"] = rec["store_bytes"] * threads / per_row
            row[f"vec_bytes_{name}"] = max(rec["load_bytes"] // max(rec["loads"], 1),
                                           rec["store_bytes"] // max(rec["stores"], 1))
    else:
        res = hip_resources(kernel.asm["amdgcn"])
        row.update(res)
        row["occupancy"] = hip_occupancy(res["regs"], res["agprs"], warps)
    return row


def check(row: dict, op: Op) -> list[str]:
    """The targets, as the problems found in this row (empty: met)."""
    problems = []
    # cuda: LOCAL spill bytes, and a stack frame (arrays the compiler moved to local memory)
    spilled = row["local"] + row.get("stack", 0)
    if not row["looped"] and spilled > 0 and (row["dtype"] != "bf16" or row["N"] <= 32768):
        unit = ("bytes of local memory per thread (LOCAL + STACK)" if row["target"].startswith("cuda")
                else "registers (VGPR+SGPR spill count)")
        problems.append(f"spills {spilled} {unit}")
    if row["target"].startswith("cuda") and not row["looped"]:
        for name in op.inputs:
            v = row.get(f"ld_{name}")
            if v is not None and abs(v - 1.0) > 1e-6:
                problems.append(f"{name} read {v:g}x per row")
        for name in op.outputs:
            v = row.get(f"st_{name}")
            if v is not None and abs(v - 1.0) > 1e-6:
                problems.append(f"{name} written {v:g}x per row")
    return problems


# ------------------------------------------------------------------ channel norms (strided kernels)

# The channel-norm kernels (a tile of BLOCK_HW positions x all C channels, the channels strided):
# their tile comes from ``_strided_tile`` for C up to one tile (forward 4096, backward 2048); the
# positions are many (56 x 56 = 3136, a multiple of 16). Strides as a launch on NCHW-contiguous
# operands specializes them: the positions' stride is 1 (a constexpr), the channels' H*W and the
# outer C*H*W divisible by 16; y, dy, dx and dresidual have contiguous rows (channel stride 1).
STRIDED_CS = [64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096]
STRIDED_POSITIONS = 3136
# (op, backward, flags, {tensor: "channels-first" | "rows"}, inputs, outputs)
STRIDED_OPS = [
    ("channel add_layer_norm (timm LayerNorm2d after x + f(x))", False,
     dict(HAS_RESIDUAL=True, HAS_WEIGHT=True, HAS_BIAS=True, IS_RMS=False, ROUND_FIRST=False, STORE_SUM=True,
          SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True),
     {"x": "channels-first", "r": "channels-first", "y": "rows", "s": "channels-first"}, ("X", "R"), ("Y", "S")),
    ("channel rms_norm (RmsNorm2d written out: y in x's layout)", False,
     dict(HAS_RESIDUAL=False, HAS_WEIGHT=True, HAS_BIAS=False, IS_RMS=True, ROUND_FIRST=False, STORE_SUM=False,
          SCALE_RESIDUAL=False, ROUND_SUM_FIRST=True),
     {"x": "channels-first", "r": "channels-first", "y": "rows", "s": "channels-first"}, ("X",), ("Y",)),
    ("channel add_layer_norm backward", True,
     dict(HAS_DEXTRA=True, HAS_WEIGHT=True, HAS_BIAS=True, HAS_DRES=True, IS_RMS=False),
     {"dy": "rows", "de": "channels-first", "i": "channels-first", "dx": "rows", "dr": "rows"},
     ("DY", "DE", "INP"), ("DX", "DRES")),
    ("channel add_rms_norm backward", True,
     dict(HAS_DEXTRA=True, HAS_WEIGHT=True, HAS_BIAS=False, HAS_DRES=True, IS_RMS=True),
     {"dy": "rows", "de": "channels-first", "i": "channels-first", "dx": "rows", "dr": "rows"},
     ("DY", "DE", "INP"), ("DX", "DRES")),
]


# a channel-norm kernel's operands: the layout key of each (STRIDED_OPS), and when the op has it
STRIDED_OPERANDS = {"X": ("x", None), "R": ("r", "HAS_RESIDUAL"), "Y": ("y", None), "S": ("s", "STORE_SUM"),
                    "DY": ("dy", None), "DE": ("de", "HAS_DEXTRA"), "INP": ("i", None), "DX": ("dx", None),
                    "DRES": ("dr", "HAS_DRES")}
STRIDED_VECTORS = {"W": "HAS_WEIGHT", "B": "HAS_BIAS", "MEAN": None, "RSTD": None, "DW_PART": "HAS_WEIGHT",
                   "DB_PART": "HAS_BIAS"}


def strided_source(fn, flags: dict, layouts: dict, dtype: str, block_hw: int, block_n: int) -> tuple:
    """A channel-norm kernel as a launch on NCHW operands specializes it (see STRIDED_OPS): operands
    (pointer, outer, position and channel strides) with the contiguous dim's stride the constant 1 of a
    launch and the others divisible by 16; and its compiled parameters' names."""
    tl_dtype = DTYPES[dtype][1]
    args = {}
    for name in fn.arg_names:
        if name in STRIDED_OPERANDS:
            key, flag = STRIDED_OPERANDS[name]
            unit = {"channels-first": 2, "rows": 3}[layouts[key]]  # (outer 1, position 2, channel 3)
            args[name] = operand(name, tl_dtype, flag is None or flags[flag], 3, {unit: 1})
        elif name in STRIDED_VECTORS:
            flag = STRIDED_VECTORS[name]
            args[name] = pointer(name, tl_dtype, flag is None or flags[flag])
        elif name in FLOAT_ARGS:
            args[name] = scalar(name)
        elif name in ("HW", "N"):
            args[name] = Leaf("i32", name, divisible=True)
        elif name == "DTYPES":
            args[name] = (tl_dtype,) * 3
        elif name in ("BLOCK_HW", "BLOCK_N"):
            args[name] = block_hw if name == "BLOCK_HW" else block_n
        elif name in flags:
            args[name] = flags[name]
        else:
            args[name] = scalar(name, type_="i32")
    return kernel_source(fn, args)


def strided_rows(dtypes: list[str], targets: list[str]) -> list[dict]:
    """Registers, spills and global accesses per element of the channel-norm kernels."""
    rows, compiled = [], {}
    for name, backward, flags, layouts, inputs, outputs in STRIDED_OPS:
        fn = KT._add_norm_bwd_strided_kernel if backward else KT._add_norm_fwd_strided_kernel
        for dtype in dtypes:
            elem = DTYPES[dtype][0].itemsize
            for c in STRIDED_CS:
                if triton.next_power_of_2(c) > (KT._STRIDED_TILE_BWD if backward else KT._STRIDED_TILE):
                    continue  # past one tile: the row kernels on a copy
                block_hw, block_n, warps = KT._strided_tile(STRIDED_POSITIONS, c, backward)
                for target in targets:
                    key = (name, dtype, block_hw, block_n, warps, target)
                    if key not in compiled:
                        t0 = time.perf_counter()
                        src, names = strided_source(fn, flags, layouts, dtype, block_hw, block_n)
                        kernel = triton.compile(src, target=TARGETS[target], options=launch_options(backward, warps))
                        row = {"compile_s": time.perf_counter() - t0, "shared": kernel.metadata.shared}
                        threads = warps * TARGETS[target].warp_size
                        if target.startswith("cuda"):
                            res = cuda_resources(kernel.asm["cubin"])
                            row.update(res)
                            row["occupancy"] = cuda_occupancy(res["regs"], warps, kernel.metadata.shared,
                                                              TARGETS[target].arch)
                            for tensor, rec in ptx_accesses(kernel.asm["ptx"], names).items():
                                if tensor in STAT_PTRS or tensor == "?":
                                    continue
                                per_tile = block_hw * block_n * elem
                                if rec["load_bytes"]:
                                    row[f"ld_{tensor}"] = rec["load_bytes"] * threads / per_tile
                                if rec["store_bytes"]:
                                    row[f"st_{tensor}"] = rec["store_bytes"] * threads / per_tile
                                row[f"vec_bytes_{tensor}"] = max(rec["load_bytes"] // max(rec["loads"], 1),
                                                                 rec["store_bytes"] // max(rec["stores"], 1))
                        else:
                            res = hip_resources(kernel.asm["amdgcn"])
                            row.update(res)
                            row["occupancy"] = hip_occupancy(res["regs"], res["agprs"], warps)
                        compiled[key] = row
                    row = {"op": name, "dtype": dtype, "C": c, "target": target, "BLOCK_HW": block_hw,
                           "BLOCK_N": block_n, "warps": warps, **compiled[key]}
                    problems = []
                    if row["local"] + row.get("stack", 0) > 0:
                        problems.append(f"spills {row['local'] + row.get('stack', 0)}")
                    if target.startswith("cuda") and block_n == c:  # no masked-off channels in the tile
                        problems += [f"{t} read {row[f'ld_{t}']:g}x" for t in inputs
                                     if abs(row.get(f"ld_{t}", 1.0) - 1.0) > 1e-6]
                        problems += [f"{t} written {row[f'st_{t}']:g}x" for t in outputs
                                     if abs(row.get(f"st_{t}", 1.0) - 1.0) > 1e-6]
                    row["problems"] = "; ".join(problems)
                    rows.append(row)
            print(f"  {name:58s} {dtype} done", flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS)),
        p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES)),
        p.add_argument("--ops", nargs="+", default=None, metavar="WORD",
                       help="only the ops whose name contains one of these words (e.g. quant)")))
    if args.toy:
        ns, dtypes, targets, ops = [1024], ["bf16"], ["cuda90", "gfx942"], OPS[:1] + OPS[4:5]
    else:
        ns, dtypes, targets, ops = NS, args.dtypes, args.targets, OPS
    if args.ops:
        ops = [op for op in ops if any(word in op.name for word in args.ops)]
    rows, compiled = [], {}
    t_start = time.perf_counter()
    for op, dtype, n, block, warps, looped, duplicate in configurations(ns, dtypes):
        if op not in ops:
            continue
        for target in targets:
            key = (op.name, dtype, block, warps, looped, target)
            if key not in compiled:
                compiled[key] = compile_one(op, dtype, block, warps, looped, target)
            row = {"op": op.name, "dtype": dtype, "N": n, "target": target, "BLOCK_N": block, "warps": warps,
                   "looped": looped, **compiled[key]}
            row["problems"] = "; ".join(check(row, op))
            rows.append(row)
        if not duplicate:
            print(f"  {op.name:42s} {dtype} N={n:6d} block={block:6d} warps={warps:2d} looped={looped!s:5s} "
                  f"regs(sm90)={compiled.get((op.name, dtype, block, warps, looped, 'cuda90'), {}).get('regs')}",
                  flush=True)
    strided = strided_rows(dtypes, targets) if not args.ops or any("channel" in w for w in args.ops) else []
    problems = [r for r in rows if r["problems"]]
    verdict = {
        "channel_norm_kernels_no_spills": not any("spills" in r["problems"] for r in strided),
        "channel_norm_kernels_max_regs_cuda90": max((r["regs"] for r in strided if r["target"] == "cuda90"),
                                                    default=None),
        "channel_norm_problems": [f"{r['op']} {r['dtype']} C={r['C']} {r['target']}: {r['problems']}"
                                  for r in strided if r["problems"]],
        "kernels_compiled": len(compiled), "rows": len(rows), "seconds": time.perf_counter() - t_start,
        "no_spills_single_pass_bf16_to_32768": not any(
            "spills" in r["problems"] for r in rows if not r["looped"] and r["dtype"] == "bf16" and r["N"] <= 32768),
        "max_regs_cuda90": max((r["regs"] for r in rows if r["target"] == "cuda90"), default=None),
        "forward_reads_once_writes_once": not any(
            "per row" in r["problems"] for r in rows if not r["looped"] and "backward" not in r["op"]),
        "problems": [f"{r['op']} {r['dtype']} N={r['N']} {r['target']}: {r['problems']}" for r in problems],
    }
    write_csv(args.out / "static_kernels.csv", rows)
    payload = {"machine": machine(), "verdict": verdict, "rows": rows, "channel_norm_rows": strided}
    write_json(args.out / "static_kernels.json", payload)

    def draw(ax):
        for op in ops:
            pts = [(r["N"], r["regs"]) for r in rows if r["op"] == op.name and r["dtype"] == "bf16"
                   and r["target"] == "cuda90"]
            if pts:
                ax.plot(*zip(*pts), "o-", label=op.name, markersize=3)
        ax.axhline(255, color="gray", linestyle=":", label="sm90 limit (255)")
        ax.set(xscale="log", xlabel="N (bf16)", ylabel="registers / thread (sm90)", title="Registers per thread")
        ax.legend(fontsize=6)
    save_plot(args.out / "static_kernels.png", draw)
    cols = ["op", "dtype", "N", "target", "BLOCK_N", "warps", "looped", "regs", "local", "shared", "occupancy",
            "ld_X", "ld_R", "st_Y", "st_S", "st_Q", "ld_DY", "ld_INP", "st_DX", "problems"]
    print(markdown_table([r for r in rows if r["target"] == "cuda90" and r["dtype"] == "bf16"], cols))
    print(markdown_table([r for r in strided if r["target"] == "cuda90" and r["dtype"] == "bf16"],
                         ["op", "dtype", "C", "BLOCK_HW", "BLOCK_N", "warps", "regs", "local", "stack", "occupancy",
                          "ld_X", "ld_R", "st_Y", "st_S", "vec_bytes_X", "vec_bytes_Y", "ld_DY", "ld_INP", "st_DX",
                          "vec_bytes_INP", "problems"]))
    print("verdict:", {k: v for k, v in verdict.items() if k not in ("problems", "channel_norm_problems")})
    for p in verdict["channel_norm_problems"][:40]:
        print("  problem:", p)
    for p in verdict["problems"][:40]:
        print("  problem:", p)
    return payload


if __name__ == "__main__":
    main()
