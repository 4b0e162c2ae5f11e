"""Does converting a deep Post-Norm transformer to Pre-Norm make it trainable without warm-up?

A 24-block Post-Norm transformer (``y = LN(x + F(x))``) and its twin converted with
``normfuse.optimize(model, prenorm=True)`` (``y = x + F(LN(x))`` plus a final LN), from
the same initial weights, are trained side by side on a synthetic copy task with Adam,
one fixed learning rate and no warm-up. Writes two figures:

- ``examples/figures/prenorm_loss.png``: training loss of both;
- ``examples/figures/prenorm_grad_norms.png``: per-layer gradient norms at initialization
  (Xiong et al. 2020, Fig. 3: Post-Norm's grow toward the output, Pre-Norm's stay flat).

    python examples/prenorm_stability.py            # 200 steps, lr 3e-3: ~3 minutes on one idle CPU core
    python examples/prenorm_stability.py --lr 1e-3 --steps 400   # the milder setting

The task: ``k`` random tokens, a separator, then the same ``k`` tokens again; the loss is
the cross-entropy of predicting the copy (the second half), so chance level is ln(V-2).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import normfuse
from normfuse.verify.structure import check_structure
from normfuse.zoo import ToyTransformer

FIGURES = Path(__file__).resolve().parent / "figures"
SEP = 1  # token 0 is unused, 1 separates the two halves, 2.. are the payload


def copy_batch(batch: int, k: int, vocab: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (B, 2k+1) = payload, SEP, payload; targets (B, k): the payload, predicted from SEP on."""
    payload = torch.randint(2, vocab, (batch, k), generator=g)
    ids = torch.cat([payload, torch.full((batch, 1), SEP), payload], dim=1)
    return ids, payload


def copy_loss(model, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, float]:
    k = targets.shape[1]
    logits = model(ids)[:, k:2 * k]                     # (B, k, V): the positions that predict the copy
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    acc = (logits.argmax(-1) == targets).float().mean().item()
    return loss, acc


def ffn_grad_norms(model) -> list[float]:
    """Per block: the norm of the gradient of the feed-forward weights (W1 and W2 together)."""
    out = []
    for block in model.blocks:
        grads = [p.grad for p in (block.mlp.up.weight, block.mlp.down.weight)]
        out.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--k", type=int, default=8, help="tokens to copy")
    ap.add_argument("--vocab", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3, help="fixed Adam learning rate, no warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=FIGURES)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(args.seed)
    post = ToyTransformer(vocab=args.vocab, hidden=args.hidden, heads=4, depth=args.depth,
                          max_len=2 * args.k + 1, placement="post", kind="layer_norm")
    pre = normfuse.optimize(copy.deepcopy(post), prenorm=True)   # same initial weights, converted
    models = {"Post-Norm": post, "Pre-Norm (converted)": pre}

    g = torch.Generator().manual_seed(args.seed + 1)
    ids, targets = copy_batch(args.batch, args.k, args.vocab, g)

    # gradient norms at initialization, on one batch
    grad_norms = {}
    for name, model in models.items():
        model.train()
        model.zero_grad()
        copy_loss(model, ids, targets)[0].backward()
        grad_norms[name] = ffn_grad_norms(model)
        model.zero_grad()
    rep = normfuse.report(pre)
    converted = rep.counts()["converted"]
    ok, why = check_structure(rep.graph_modules)

    # training: same batches, same fixed learning rate, no warm-up
    opts = {name: torch.optim.Adam(m.parameters(), lr=args.lr) for name, m in models.items()}
    history = {name: {"loss": [], "acc": []} for name in models}
    start = time.time()
    for step in range(args.steps):
        ids, targets = copy_batch(args.batch, args.k, args.vocab, g)
        for name, model in models.items():
            loss, acc = copy_loss(model, ids, targets)
            opts[name].zero_grad()
            loss.backward()
            opts[name].step()
            history[name]["loss"].append(loss.item())
            history[name]["acc"].append(acc)
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  " + "  ".join(f"{n}: loss {h['loss'][-1]:.3f} acc {h['acc'][-1]:.2f}"
                                                 for n, h in history.items()), flush=True)
    seconds = time.time() - start

    summary = {
        "depth": args.depth, "hidden": args.hidden, "steps": args.steps, "batch": args.batch, "lr": args.lr,
        "chance_loss": math.log(args.vocab - 2), "converted_sites": converted, "structure_ok": ok,
        "structure": why, "train_seconds": round(seconds, 1),
        "final_loss": {n: sum(h["loss"][-20:]) / 20 for n, h in history.items()},
        "final_acc": {n: sum(h["acc"][-20:]) / 20 for n, h in history.items()},
        "grad_norm_first_last": {n: (v[0], v[-1]) for n, v in grad_norms.items()},
        "grad_norm_last_over_first": {n: v[-1] / v[0] for n, v in grad_norms.items()},
    }
    _plot(history, grad_norms, summary, args.out)
    print(json.dumps(summary, indent=2))
    return summary


def _plot(history: dict, grad_norms: dict, summary: dict, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = {"Post-Norm": "tab:red", "Pre-Norm (converted)": "tab:blue"}
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, h in history.items():
        ax.plot(h["loss"], color=colors[name], alpha=0.85, lw=1.2, label=name)
    ax.axhline(summary["chance_loss"], color="gray", ls="--", lw=1, label="chance")
    ax.set_xlabel("step")
    ax.set_ylabel("copy-task cross-entropy")
    ax.set_yscale("log")
    ax.set_title(f"{summary['depth']} blocks, Adam lr {summary['lr']:g}, no warm-up")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prenorm_loss.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for name, v in grad_norms.items():
        ax.plot(range(1, len(v) + 1), v, "o-", color=colors[name], ms=3, label=name)
    ax.set_xlabel("block (1 = next to the input)")
    ax.set_ylabel("||grad W_FFN|| at initialization")
    ax.set_yscale("log")
    ax.set_title("per-layer gradient norm at initialization")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "prenorm_grad_norms.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
