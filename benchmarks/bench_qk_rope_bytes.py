"""HBM bytes of the q/k norm + RoPE sites, eager against fused, as ``normfuse audit`` prices them.

No GPU needed: each model is built on the meta device from its transformers config (the config's
own sizes, ``--layers 2``), captured once by dynamo with fake tensors, and audited
(``normfuse.audit``, the cost model of ``normfuse/cost.py``). Per family, the q_norm and k_norm
sites of the first layer, forward and backward bytes:

* eager: every kernel of the site as the graph runs it, the RoPE after the norm included
  (upcast, mean of squares, rsqrt, the multiplies, the downcasts; then ``q * cos``,
  ``rotate_half``, ``* sin``, the sum), each reading and writing HBM;
* fused: the one ``qk_norm_rope`` launch, which the audit splits between the two sites: the q site
  (the call's lead) carries the reads of q, k, cos, sin and the writes of q_out, k_out and the rstd
  (backward: dq_out, dk_out, q, k, cos, sin, rstd in, dq, dk out), the k site its weight and output
  (backward: its output's gradient and its weight's); the two together are the launch.

The bytes are an estimate counted per kernel from the graph, not a timing. Batch 1 x 2048 tokens,
bf16 (the audit's defaults for a transformers config).

    python benchmarks/bench_qk_rope_bytes.py [--toy] [--families qwen3 gemma3_text olmo2]
"""

from __future__ import annotations

import time
import warnings

from common import machine, markdown_table, parse_args, reset_dynamo, save_plot, write_csv, write_json

FAMILIES = ("qwen3", "gemma3_text", "olmo2")


def audit_family(family: str, layers: int, seq: int) -> tuple[list[dict], dict]:
    """(rows, totals): the q/k sites of layer 0 of ``hf:<family>``, and the whole report's totals."""
    from normfuse.auditing import audit
    from normfuse.targets import load_target

    reset_dynamo()
    model, args, kwargs = load_target(f"hf:{family}", layers=layers, dtype="bf16", device="meta", batch=1, seq=seq)
    config = model.config
    rep = audit(model, *args, name=f"hf:{family}", **kwargs)
    rows = []
    for layer in range(layers):
        for which in ("q", "k"):
            found = [s for s in rep.sites if (s.site.fqn or "").endswith(f"layers.{layer}.self_attn.{which}_norm")]
            if len(found) != 1:
                raise RuntimeError(f"hf:{family}: {len(found)} sites named layers.{layer}.self_attn.{which}_norm "
                                   f"in the audit (expected 1): {[s.site.fqn for s in rep.sites]}")
            s = found[0]
            rows.append({
                "family": family, "layer": layer, "site": f"{which}_norm", "status": s.status, "tokens": rep.tokens,
                "norm_rows": s.rows, "hidden": config.hidden_size,
                "heads": config.num_attention_heads if which == "q" else config.num_key_value_heads,
                "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                "rope": s.site.rope,
                "eager_fwd_B": s.eager.fwd, "fused_fwd_B": s.fused.fwd,
                "eager_bwd_B": s.eager.bwd, "fused_bwd_B": s.fused.bwd,
                "eager_fwd_kernels": s.eager.fwd_kernels, "fused_fwd_kernels": s.fused.fwd_kernels,
                "eager_bwd_kernels": s.eager.bwd_kernels, "fused_bwd_kernels": s.fused.bwd_kernels,
            })
    # every layer prices its sites alike: keep layer 0, after checking that
    keys = [k for k in rows[0] if k.endswith(("_B", "_kernels"))]
    for r in rows:
        twin = next(t for t in rows if t["layer"] == 0 and t["site"] == r["site"])
        if any(r[k] != twin[k] for k in keys):
            raise RuntimeError(f"hf:{family}: layer {r['layer']}'s {r['site']} is priced unlike layer 0's")
    rows = [r for r in rows if r["layer"] == 0]
    for r in rows:
        r["fwd_ratio"] = r["eager_fwd_B"] / r["fused_fwd_B"]
        r["bwd_ratio"] = r["eager_bwd_B"] / r["fused_bwd_B"] if r["fused_bwd_B"] else None
    return rows, rep.totals()


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: p.add_argument(
        "--families", nargs="+", default=list(FAMILIES), help="transformers model types to audit"))
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="normfuse")
    # --toy: the same audit at 64 tokens (the meta device costs nothing either way)
    seq = 64 if args.toy else 2048
    rows, totals, start = [], {}, time.perf_counter()
    for family in args.families:
        fam_rows, totals[family] = audit_family(family, layers=2, seq=seq)
        rows += fam_rows
        print(f"  {family}: " + ", ".join(
            f"{r['site']} fwd {r['eager_fwd_B'] / 1e6:.2f} -> {r['fused_fwd_B'] / 1e6:.2f} MB, "
            f"bwd {r['eager_bwd_B'] / 1e6:.2f} -> {r['fused_bwd_B'] / 1e6:.2f} MB" for r in fam_rows), flush=True)
    verdict = {
        "seconds": time.perf_counter() - start, "tokens": seq, "layers": 2, "dtype": "bfloat16",
        "all_in_one_qk_norm_rope_call": all("qk_norm_rope" in r["status"] and r["rope"] for r in rows),
        # the q and k sites together: the pair of norms and their RoPE, against one qk_norm_rope call
        "pair_fwd_ratio": {f: sum(r["eager_fwd_B"] for r in rows if r["family"] == f)
                           / sum(r["fused_fwd_B"] for r in rows if r["family"] == f) for f in args.families},
        "pair_bwd_ratio": {f: sum(r["eager_bwd_B"] for r in rows if r["family"] == f)
                           / sum(r["fused_bwd_B"] for r in rows if r["family"] == f) for f in args.families},
    }
    write_csv(args.out / "qk_rope_bytes.csv", rows)
    write_json(args.out / "qk_rope_bytes.json", {"machine": machine(), "verdict": verdict, "rows": rows,
                                                  "audit_totals": totals})

    def draw(ax):
        bars = (("eager_fwd_B", "eager forward", "#c44e52", None), ("fused_fwd_B", "fused forward", "#4c72b0", None),
                ("eager_bwd_B", "eager backward", "#c44e52", "//"), ("fused_bwd_B", "fused backward", "#4c72b0", "//"))
        width = 0.2
        labels = [f"{r['family']}\n{r['site']}\n{r['heads']} x {r['head_dim']}" for r in rows]
        for i, (key, label, color, hatch) in enumerate(bars):
            xs = [j + (i - 1.5) * width for j in range(len(rows))]
            ax.bar(xs, [r[key] / 1e6 for r in rows], width, label=label, color=color, hatch=hatch,
                   edgecolor="white" if hatch else None, alpha=1.0 if "fused" in key else 0.8)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set(yscale="log", ylim=(1, 2e4), ylabel="MB per layer (normfuse audit)",
               title=f"q/k norm + RoPE sites, 1 x {seq} tokens, bf16: eager vs fused")
        ax.title.set_fontsize(9)
        ax.legend(fontsize=7, ncol=2, loc="upper center")
    save_plot(args.out / "qk_rope_bytes.png", draw)
    print(markdown_table(rows, ["family", "site", "heads", "head_dim", "eager_fwd_B", "fused_fwd_B", "fwd_ratio",
                                "eager_bwd_B", "fused_bwd_B", "bwd_ratio", "eager_fwd_kernels",
                                "eager_bwd_kernels"]))
    print("verdict:", verdict)
    return verdict


if __name__ == "__main__":
    main()
