"""Each benchmark script runs end to end at a toy size and writes what it promises.

Not benchmarks: the toy sizes prove the plumbing (capture, rewrite, saved-tensor hooks,
AOT compilation, the GPU suite's providers under Triton's interpreter), not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, out: Path, env_drop=(), extra_env=None, timeout=300) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in env_drop}
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, str(BENCH / script), "--toy", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_pass_cost_memory_cpu_e2e_toy(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--toy", "--out", str(tmp_path),
                           "--only", "pass_cost", "memory", "cpu_e2e"], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "== summary" in proc.stdout

    cost = json.loads((tmp_path / "pass_cost.json").read_text())
    # llama with 1 and 2 layers: 2L + 1 sites (every layer's two norms and the final one)
    assert [(s["layers"], s["fused"]) for s in cost["summary"]] == [(1, 3), (2, 5)]
    assert all(s["pass_s"] > 0 and s["bare_capture_s"] > 0 for s in cost["summary"])

    mem = json.loads((tmp_path / "memory.json").read_text())
    assert {(m["model"], m["dtype"]) for m in mem["models"]} == {(m, d) for m in ("llama", "bert")
                                                                 for d in ("fp32", "bf16")}
    sites = {(s["site"], s["dtype"]): s for s in mem["sites"]}
    hf = sites[("HF LlamaRMSNorm (pre)", "bf16")]
    assert hf["fused"] == 1
    # bf16: HF keeps the fp32 upcast (4 B) and the rounded normalized value (2 B) per element;
    # the fused op keeps the bf16 sum (2 B) and one fp32 rstd per row
    assert hf["eager_bytes_per_elem"] >= 6.0
    assert hf["fused_bytes_per_elem"] == pytest.approx(2 + 4 / hf["N"])
    assert mem["verdict"]["all_sites_minimal"]
    # recompute_norm_output: the stack's 2 sites (q/k/v, gate/up) keep the bf16 sums only
    stack, llama = mem["recompute"]
    assert stack["recomputed_sites"] == 2 and llama["recomputed_sites"] == 2
    assert stack["recompute_bytes"] < stack["optimized_bytes"] < stack["eager_bytes"]
    assert llama["recompute_bytes"] < llama["optimized_bytes"]

    e2e = json.loads((tmp_path / "cpu_e2e.json").read_text())
    assert {(r["model"], r["step"]) for r in e2e["rows"]} == {(m, s) for m in ("llama", "bert")
                                                              for s in ("forward", "train")}
    assert all(r["fused"] == 3 and r["eager_ms_min"] > 0 and r["optimized_ms_min"] > 0 for r in e2e["rows"])
    # each site model is captured twice (no-grad and grad calls), one fused site per graph
    assert len(e2e["sites"]) == 3 and all(s["fused"] == s["graphs"] >= 1 for s in e2e["sites"])
    for name in ("pass_cost.png", "memory_sites.png", "cpu_e2e.png", "pass_cost.csv", "memory_models.csv",
                 "cpu_e2e.csv"):
        assert (tmp_path / name).stat().st_size > 0


def test_static_kernel_report_toy(tmp_path):
    pytest.importorskip("triton")
    # AOT compilation needs triton without the interpreter the test session turns on
    _run("bench_static_kernels.py", tmp_path, env_drop=("TRITON_INTERPRET", "NORMFUSE_TRITON_CPU"))
    report = json.loads((tmp_path / "static_kernels.json").read_text())
    rows = {(r["op"].split(" (")[0], r["target"]): r for r in report["rows"]}
    fwd = rows[("add_rms_norm", "cuda90")]
    assert fwd["N"] == 1024 and fwd["BLOCK_N"] == 1024 and not fwd["looped"]
    assert 0 < fwd["regs"] <= 255 and fwd["local"] == 0 and 0 < fwd["occupancy"] <= 1
    # bf16 rows of 1024 in one block: x and r read once, y and s written once, in 16-byte vectors
    assert fwd["ld_X"] == fwd["ld_R"] == fwd["st_Y"] == fwd["st_S"] == 1.0
    assert fwd["vec_bytes_X"] == 16
    assert fwd["fma_f32"] == 0  # the forward rounds each fp32 step as eager's separate ops do
    bwd = rows[("add_rms_norm backward", "cuda90")]
    assert bwd["ld_DY"] == bwd["ld_INP"] == bwd["st_DX"] == 1.0
    amd = rows[("add_rms_norm", "gfx942")]
    assert amd["regs"] > 0 and amd["local"] == 0
    assert report["verdict"]["kernels_compiled"] == 4


def test_gpu_suite_toy_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    _run("bench_gpu.py", tmp_path, extra_env={"NORMFUSE_TRITON_CPU": "1", "TRITON_INTERPRET": "1"})
    result = json.loads((tmp_path / "gpu.json").read_text())
    ok = [r for r in result["rows"] if "fwd_ms" in r]
    assert not [r for r in result["rows"] if "error" in r], [r["error"] for r in result["rows"] if "error" in r]
    providers = {(r["op"], r["provider"]) for r in ok}
    assert {("rms", "normfuse"), ("rms", "normfuse (llama rounding)"), ("rms", "eager F.rms_norm"),
            ("rms", "eager HF LlamaRMSNorm"), ("rms", "compile F.rms_norm"), ("ln", "normfuse"),
            ("ln", "eager F.layer_norm"), ("ln", "compile F.layer_norm")} <= providers
    assert all(r["timing"] == "cpu-interpreter" and r["fwd_ms"] > 0 and r["bwd_ms"] > 0 for r in ok)
    block = result["llama_block"]
    assert [b["variant"] for b in block] == ["eager", "normfuse"] and block[1]["fused"] == 3
    # QK-norm + RoPE: Qwen3's and Gemma 3's rounding, every provider forward and forward+backward, and
    # the fused kernel's outputs equal to HF eager's (bf16, the interpreter)
    qk = result["qk_rope"]
    assert [r["family"] for r in qk] == ["qwen3", "gemma3"]
    for r in qk:
        assert not [k for k in r if k.endswith("_error")], r
        for name in ("eager HF", "compile HF", "normfuse"):
            assert r[f"{name}_fwd_ms"] > 0 and r[f"{name}_fwd_bwd_ms"] > 0 and r[f"{name}_fwd_pct_copy"] > 0
        assert r["normfuse_max_abs_vs_eager"] == 0.0


def test_qk_rope_bytes_toy(tmp_path):
    _run("bench_qk_rope_bytes.py", tmp_path)
    result = json.loads((tmp_path / "qk_rope_bytes.json").read_text())
    rows = result["rows"]
    assert [(r["family"], r["site"]) for r in rows] == [
        (f, s) for f in ("qwen3", "gemma3_text", "olmo2") for s in ("q_norm", "k_norm")]
    assert result["verdict"]["all_in_one_qk_norm_rope_call"]
    for family in ("qwen3", "gemma3_text", "olmo2"):
        pair = [r for r in rows if r["family"] == family]
        assert sum(r["fused_fwd_kernels"] for r in pair) == sum(r["fused_bwd_kernels"] for r in pair) == 1
        q, k = pair
        # the launch moves at least q, k in and q_out, k_out out (bf16) and cos, sin; eager moves more
        floor = 2 * 2 * result["verdict"]["tokens"] * (q["heads"] + k["heads"]) * q["head_dim"]
        assert floor < q["fused_fwd_B"] + k["fused_fwd_B"] < q["eager_fwd_B"] + k["eager_fwd_B"]
        assert 1.5 * floor < q["fused_bwd_B"] + k["fused_bwd_B"] < q["eager_bwd_B"] + k["eager_bwd_B"]
    assert (tmp_path / "qk_rope_bytes.png").stat().st_size > 0


def test_residual_dtype_toy(tmp_path):
    _run("bench_residual_dtype.py", tmp_path)
    result = json.loads((tmp_path / "residual_dtype.json").read_text())
    assert [r["widened_sums"] for r in result["rows"]] == [5, 4]
    assert result["verdict"]["all_checks_ok"]
