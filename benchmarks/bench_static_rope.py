"""Benchmark 7: static report of the qk_norm_rope kernels, compiled ahead of time without a GPU.

Each launch configuration ``normfuse.kernels.triton_rope`` picks (heads per tile, column blocks,
warps) for head_dim 64 / 128 / 256 with R = D, D / 2, D / 4, both layouts, forward and backward,
per-head norms (32 query heads, 8 key heads) and OLMo 2's whole-row norm (head_dim 128), and the
diffusion transformers' at their real sizes (``DIFFUSION``: Wan 2.1 14B's norm over 40 heads of 128
with half tables, LTX-Video's 2048-wide row as one head, Flux's 24 heads), is compiled
for ``GPUTarget("cuda", 90, 32)``, ``("cuda", 80, 32)`` and ``("hip", "gfx942", 64)`` with the
helpers of bench_static_kernels.py. Reported per kernel: registers, spills (cubin LOCAL + STACK;
AMD spill counts), occupancy, and from the PTX the global loads of q (and stores of the output, dx)
per element of a tile: 1.0 means each element is read (written) once.

Targets: no spills; q read once and q_out written once per element in the forward (per element of
the tile's column blocks: ``masked_columns`` is the fraction of them past D, predicated off).

    python benchmarks/bench_static_rope.py [--toy] [--targets cuda90 cuda80 gfx942] [--dtypes bf16]
"""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("NORMFUSE_TRITON_CPU") == "1":
    # kernels defined under the interpreter cannot be compiled: start again without it
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NORMFUSE_TRITON_CPU")}
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import time

from common import machine, markdown_table, parse_args, write_csv, write_json

import triton
from triton.compiler import ASTSource

from bench_static_kernels import (DTYPES, TARGETS, Leaf, cuda_occupancy, cuda_resources, hip_occupancy,
                                  hip_resources, kernel_source, launch_options, ptx_accesses)
from normfuse.kernels import triton_rope as KR

HQ, HK = 32, 8  # Qwen3-8B's heads (GQA); the tile takes the larger count
# diffusion transformers' q/k RoPEs at their real sizes: (name, heads, D, row norm, layout, half table,
# LayerNorm)
DIFFUSION = [("Wan 2.1 14B: norm over 40 x 128, stored pairs, half tables", 40, 128, True, "gptj", True, False),
             ("LTX-Video: the (B, S, 2048) row as one head", 1, 2048, False, "gptj", False, False),
             ("Flux: 24 heads x 128, interleaved pairs", 24, 128, False, "gptj", False, False),
             ("CogVideoX 1.5 5B: 48 heads x 64 LayerNorms, interleaved pairs", 48, 64, False, "gptj", False, True),
             ("CogView4: 32 heads x 128 LayerNorms, halves", 32, 128, False, "neox", False, True)]
FLOAT_ARGS = {"eps", "weight_offset"}
SIZE_ARGS = {"S", "HQ", "HK"}  # the capital integers (D and R are constexprs)
FP32_PTRS = {"RSTD_Q", "RSTD_K", "DWQ_PART", "DWK_PART", "DBQ_PART", "DBK_PART"}
BIAS_PTRS = ("BQ", "BK", "DBQ_PART", "DBK_PART")  # a LayerNorm's biases and their gradients' partials
OPERANDS = {"Q", "K", "QO", "KO", "DQO", "DKO"}  # (pointer, batch, position and head strides)


def configurations(heads_dims, dtypes):
    """(direction, layout, row_norm, D, R, dtype) of the report."""
    for backward in (False, True):
        for layout in ("neox", "gptj"):
            for row_norm, D in heads_dims:
                for R in (D, D // 2, D // 4):
                    for dtype in dtypes:
                        yield backward, layout, row_norm, D, R, dtype


def _pointer(name: str, dtype: str) -> Leaf:
    return Leaf("*fp32" if name in FP32_PTRS else f"*{dtype}", name, divisible=True)


def _strides(name: str, n: int) -> tuple:
    return tuple(Leaf("i32", f"stride_{name}_{j}", divisible=True) for j in range(1, n + 1))


def source(backward: bool, layout: str, row_norm: bool, D: int, R: int, dtype: str, heads: int = HQ,
           half_table: bool = False, layer: bool = False) -> tuple[ASTSource, int, dict, list]:
    """The kernel as the launcher specializes it for q and k of ``dtype`` (Qwen3's rounding: the norm
    rounded first, RoPE in ``dtype``; weights in ``dtype``), contiguous rows; strides and D divisible
    by 16; ``layer``: LayerNorms with weights and biases (else RMSNorms, no bias). Returns (source,
    warps, tile, the compiled parameters' names)."""
    fn = KR._qk_rope_bwd_kernel if backward else KR._qk_rope_fwd_kernel
    hb, half, pas, pas2 = KR._tile(heads, D, R, row_norm, KR._TILE_BWD if backward else KR._TILE_FWD)
    tl_dtype = DTYPES[dtype][1]
    args = dict(D=D, R=R, ROW_NORM=row_norm, NEOX=layout == "neox", HALF_TABLE=half_table, ROUND_FIRST=True,
                LAYER=layer, DTYPES=(tl_dtype,) * 4, HB=hb, HALF=half, PASS=pas, PASS2=pas2,
                ROPE=(_pointer("COS", dtype), _pointer("SIN", dtype), *_strides("ROPE", 3)))
    if not layer:
        args.update({name: Leaf("constexpr", name) for name in BIAS_PTRS})  # None: no bias
    for name in fn.arg_names:
        if name in args:
            continue
        if name in OPERANDS:
            args[name] = (_pointer(name, dtype), *_strides(name, 3))
        elif name in FLOAT_ARGS:
            args[name] = Leaf("fp32", name)
        elif name.isupper() and name not in SIZE_ARGS:  # pointers are named in capitals
            args[name] = _pointer(name, dtype)
        else:
            args[name] = Leaf("i32", name)
    src, names = kernel_source(fn, args)
    return src, KR._warps(hb, KR._columns(half, pas, pas2), backward), dict(HB=hb, HALF=half, PASS=pas, PASS2=pas2), \
        names


def compile_one(backward, layout, row_norm, D, R, dtype, target, heads=HQ, half_table=False, layer=False) -> dict:
    src, warps, tile, names = source(backward, layout, row_norm, D, R, dtype, heads, half_table, layer)
    t0 = time.perf_counter()
    kernel = triton.compile(src, target=TARGETS[target], options=launch_options(backward, warps))
    row = {"compile_s": time.perf_counter() - t0, "warps": warps, **tile, "shared": kernel.metadata.shared}
    if target.startswith("cuda"):
        res = cuda_resources(kernel.asm["cubin"])
        row.update(res)
        row["occupancy"] = cuda_occupancy(res["regs"], warps, kernel.metadata.shared, TARGETS[target].arch)
        # a tile is HB heads x (2 HALF + PASS + PASS2) columns, the power-of-two blocks of the halves and
        # the pass-through; past D they are masked off (predicated instructions, no memory traffic)
        threads = warps * TARGETS[target].warp_size
        columns = 2 * tile["HALF"] + (tile["PASS"] + tile["PASS2"] if D > R else 0)
        row["masked_columns"] = (columns - D) / columns
        per_tile = tile["HB"] * columns * DTYPES[dtype][0].itemsize
        accesses = {}  # per tensor: an address computed from a size (S) as well still reads that tensor
        for names, rec in ptx_accesses(kernel.asm["ptx"], names).items():
            tensors = set(names.split("/")) - SIZE_ARGS
            if len(tensors) == 1:
                total = accesses.setdefault(tensors.pop(), dict.fromkeys(rec, 0))
                for field_, value in rec.items():
                    total[field_] += value
        for name in (("DQO", "Q", "DQ") if backward else ("Q", "QO")):
            rec = accesses.get(name)
            if rec is None:
                continue
            key = "ld" if name != ("DQ" if backward else "QO") else "st"
            size = rec["load_bytes"] if key == "ld" else rec["store_bytes"]
            row[f"{key}_{name}"] = size * threads / per_tile
            row[f"vec_bytes_{name}"] = (rec["load_bytes"] // max(rec["loads"], 1) if key == "ld"
                                        else rec["store_bytes"] // max(rec["stores"], 1))
    else:
        res = hip_resources(kernel.asm["amdgcn"])
        row.update(res)
        row["occupancy"] = hip_occupancy(res["regs"], res["agprs"], warps)
    return row


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: (
        p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS)),
        p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))))
    heads_dims = [(False, 64), (False, 128), (False, 256), (True, 128)]
    targets, dtypes = args.targets, args.dtypes
    if args.toy:  # both layouts and both norm widths, forward and backward: 8 kernels
        heads_dims, targets, dtypes = [(False, 128), (True, 128)], ["cuda90"], ["bf16"]
    rows = []
    t_start = time.perf_counter()
    kernels = [(None, HQ, False, False, *c) for c in configurations(heads_dims, dtypes)
               if not args.toy or c[4] == c[3] // 2]
    if args.toy:  # and the LayerNorm, one head norm each way
        kernels += [("LayerNorm", HQ, False, True, backward, "neox", False, 128, 64, "bf16") for backward in (False, True)]
    else:
        kernels += [(model, heads, half, layer, backward, layout, row_norm, D, D, dtype)
                    for model, heads, D, row_norm, layout, half, layer in DIFFUSION for backward in (False, True)
                    for dtype in dtypes]
    for model, heads, half_table, layer, backward, layout, row_norm, D, R, dtype in kernels:
        for target in targets:
            row = {"kernel": "backward" if backward else "forward", "layout": layout,
                   "norm": "row" if row_norm else "head", "D": D, "R": R, "dtype": dtype, "target": target,
                   "model": model or "", "heads": heads,
                   **compile_one(backward, layout, row_norm, D, R, dtype, target, heads, half_table, layer)}
            problems = []
            if row["local"] + row.get("stack", 0) > 0:
                problems.append(f"spills {row['local'] + row.get('stack', 0)}")
            if target.startswith("cuda") and not backward:
                problems += [f"{t} {row[f'{k}_{t}']:g}x per element" for k, t in (("ld", "Q"), ("st", "QO"))
                             if abs(row.get(f"{k}_{t}", 1.0) - 1.0) > 1e-6]
            row["problems"] = "; ".join(problems)
            rows.append(row)
        print(f"  {'bwd' if backward else 'fwd'} {layout} {'row' if row_norm else 'head'} D={D} R={R} {dtype} "
              f"regs(sm90)={next((r.get('regs') for r in rows[::-1] if r['target'] == 'cuda90'), None)}",
              flush=True)
    verdict = {
        "kernels_compiled": len(rows), "seconds": time.perf_counter() - t_start,
        "no_spills": not any("spills" in r["problems"] for r in rows),
        "max_regs_cuda90": max((r["regs"] for r in rows if r["target"] == "cuda90"), default=None),
        "forward_reads_q_once_writes_once": not any("per element" in r["problems"] for r in rows),
        "problems": [f"{r['model'] + ': ' if r['model'] else ''}{r['kernel']} {r['layout']} {r['norm']} D={r['D']} "
                     f"R={r['R']} {r['dtype']} {r['target']}: "
                     f"{r['problems']}" for r in rows if r["problems"]],
    }
    write_csv(args.out / "static_rope.csv", rows)
    payload = {"machine": machine(), "verdict": verdict, "rows": rows}
    write_json(args.out / "static_rope.json", payload)
    print(markdown_table([r for r in rows if r["target"] == "cuda90"],
                         ["kernel", "model", "layout", "norm", "heads", "D", "R", "dtype", "HB", "warps", "regs", "local",
                          "stack",
                          "occupancy", "masked_columns", "ld_Q", "st_QO", "vec_bytes_Q", "ld_DQO", "st_DQ",
                          "problems"]))
    print("verdict:", {k: v for k, v in verdict.items() if k != "problems"})
    for p in verdict["problems"][:40]:
        print("  problem:", p)
    return payload


if __name__ == "__main__":
    main()
