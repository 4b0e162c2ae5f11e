"""Shared by the benchmark scripts: where results go, the machine's description, timing.

Each script is ``python benchmarks/<name>.py [--toy] [--out DIR]`` and writes its CSV /
JSON (and a PNG where a plot helps) under ``benchmarks/results/`` by default.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch.nn as nn

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

if str(HERE.parent) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(HERE.parent))


def parse_args(description: str, argv=None, extra: Callable[[argparse.ArgumentParser], None] | None = None):
    """--toy (seconds, for the smoke test) and --out (the results folder) for every script."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--toy", action="store_true", help="tiny sizes: proves the script runs end to end")
    p.add_argument("--out", type=Path, default=None, help=f"results folder (default {RESULTS})")
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    args.out = Path(args.out) if args.out is not None else RESULTS
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def machine() -> dict[str, Any]:
    """Date, host, CPU, versions: stored next to every result."""
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__,
    }
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def write_csv(path: Path, rows: list[dict[str, Any]]) -> Path:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    return path


class Clock:
    """Wall time and this process's CPU time of a block. On a shared machine the CPU time
    is the steadier of the two: other processes' load inflates wall time, not it."""

    def __enter__(self):
        gc.collect()
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def best_of(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """min and median seconds of ``fn()`` over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"min": min(times), "median": statistics.median(times)}


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def markdown_table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A GitHub table of ``rows`` (floats to 3 significant digits)."""
    if not rows:
        return "(no rows)\n"
    columns = columns or list(rows[0])

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def save_plot(path: Path, draw: Callable[[Any], None]) -> Path | None:
    """Draw with matplotlib (Agg) when it is installed; None otherwise."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    draw(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def hf_overrides(model_type: str, hidden: int, layers: int) -> dict[str, Any]:
    """Config overrides that size a HF model: hidden size, layers, heads (head dim 32)."""
    heads = max(1, hidden // 32)
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                  num_hidden_layers=layers, vocab_size=256, max_position_embeddings=512)
    if model_type == "llama":
        common.update(num_key_value_heads=heads, head_dim=hidden // heads)
    if model_type == "bert":
        # dropout off: the pass fuses norms whose add it can see (dropout in training mode is not an identity)
        common.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return common


class ResidualNormSite(nn.Module):
    """One residual site: ``s = x + r; y = norm(s)``; pre-norm sites also hand ``s`` on."""

    def __init__(self, norm: nn.Module, pre: bool):
        super().__init__()
        self.norm, self.pre = norm, pre

    def forward(self, x, r):
        s = x + r
        y = self.norm(s)
        return (y, s) if self.pre else y


def site_norms(n: int, dtype) -> dict:
    """One norm site each of the spellings the models use: name -> (module, is pre-norm)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    return {
        "HF LlamaRMSNorm (pre)": (LlamaRMSNorm(n, eps=1e-6).to(dtype), True),
        "nn.RMSNorm (pre)": (nn.RMSNorm(n, eps=1e-6).to(dtype), True),
        "nn.LayerNorm (post, BERT)": (nn.LayerNorm(n, eps=1e-12).to(dtype), False),
    }


def reset_dynamo() -> None:
    """Between models: dynamo's recompile limit otherwise silently falls back to eager."""
    import torch._dynamo
    torch._dynamo.reset()
