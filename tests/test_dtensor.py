"""Tensor + sequence parallel (DTensor) on CPU: 2 processes, gloo backend.

The fused ops run on DTensors through their sharding rules (normfuse.kernels.sharding);
a llama-shaped model parallelized with torchtitan's llama plan (ColwiseParallel,
RowwiseParallel, SequenceParallel norms, PrepareModuleInput) runs optimized with every
add-fed norm fused, and its loss and gradients equal the one-process model's.
"""


import torch
import torch.nn.functional as F

import normfuse
from normfuse.tolerances import within_tolerance
from normfuse.zoo import TitanLlama, apply_titan_tp

from helpers import WORLD, run_on_ranks

VOCAB, DEPTH, BATCH, SEQ = 64, 2, 2, 8


def Llama():  # noqa: N802 - a model factory
    return TitanLlama(vocab=VOCAB, depth=DEPTH)


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model, tokens, labels):
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())


def full_grads(model):
    from torch.distributed.tensor import DTensor
    return {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in model.named_parameters()}


def _ops_worker(rank, results):
    """The ops on DTensors directly: each placement, forward and backward."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    from normfuse.kernels.add_norm import add_norm, norm_add
    from normfuse.kernels.sharding import register
    assert register()
    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(0)
    x, r, w, b = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 16, generator=g), \
        torch.randn(16, generator=g), torch.randn(16, generator=g)
    for op in ("add_norm", "norm_add"):
        for kind in ("rms_norm", "layer_norm"):
            for placement in (Shard(0), Shard(1), Replicate()):
                def run(dist_args):
                    leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
                    args = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_()
                            for t, p in zip(leaves, [placement, placement, Replicate(), Replicate()])] \
                        if dist_args else leaves
                    bias = args[3] if kind == "layer_norm" else None
                    fn = add_norm if op == "add_norm" else norm_add
                    extra = {"return_norm": True} if op == "norm_add" else {}
                    first, second = fn(args[0], args[1], args[2], bias, kind=kind, eps=1e-6, **extra)
                    (first.square().sum() + second.sin().sum()).backward()
                    outs = [first, second] + [a.grad for a in args[:3]] + ([args[3].grad] if bias is not None else [])
                    return [o.full_tensor() if hasattr(o, "full_tensor") else o for o in outs], first
                got, first = run(True)
                want, _ = run(False)
                results[f"{op}/{kind}/{placement}"] = (
                    [tuple(p for p in first.placements)] == [(placement,)],
                    max((a - e).abs().max().item() for a, e in zip(got, want)))
    # the rewriter's check: a site whose DTensor input is sharded on the normalized dim stays
    # as it was, with this reason (eager PyTorch itself cannot run such a norm here)
    from normfuse.kernels.sharding import refusal
    results["refusals"] = [refusal([distribute_tensor(x, mesh, [p])]) for p in (Shard(2), Shard(1), Replicate())]
    try:
        add_norm(distribute_tensor(x, mesh, [Shard(2)]), None, distribute_tensor(w, mesh, [Replicate()]), None,
                 kind="rms_norm", eps=1e-6)
        results["last_dim_error"] = None
    except Exception as error:  # noqa: BLE001 - the message is the result
        results["last_dim_error"] = f"{type(error).__name__}: {error}"


def _tp_worker(rank, results):
    from torch.distributed.tensor import init_device_mesh
    mesh = init_device_mesh("cpu", (WORLD,))
    tokens, labels = batch()
    model = normfuse.optimize(apply_titan_tp(Llama(), mesh))
    loss = loss_of(model, tokens, labels)
    loss.backward()
    results["loss"] = loss.detach()
    results["grads"] = full_grads(model)
    rep = normfuse.report(model)
    results["counts"] = rep.counts()
    results["sites"] = [(s.fqn, s.fused, s.fused_add, s.input_is_add, s.reason) for s in rep.sites]
    results["warnings"] = list(rep.warnings)


def _rank(rank, name):
    results = {}
    {"ops": _ops_worker, "tp": _tp_worker}[name](rank, results)
    return results


def run_distributed(name):
    return run_on_ranks(_rank, name)


def test_ops_on_dtensors_match_local_tensors():
    for rank, results in enumerate(run_distributed("ops")):
        last, rows, replicated = results.pop("refusals")
        assert "sharded on the normalized (last) dim" in last and rows is None and replicated is None
        error = results.pop("last_dim_error")
        assert error is not None and "sharded on its last dim" in error and "Shard the rows" in error
        assert len(results) == 12
        for case, (placement_kept, max_err) in results.items():
            assert placement_kept, case
            assert max_err < 1e-4, (rank, case, max_err)


def test_torchtitan_tp_plan_fuses_every_add_fed_norm_and_matches_one_process():
    results = run_distributed("tp")
    torch._dynamo.reset()
    tokens, labels = batch()
    eager, reference = Llama(), Llama().double()
    eager_loss, ref_loss = loss_of(eager, tokens, labels), loss_of(reference, tokens, labels)
    (eager_loss + ref_loss).backward()
    eager_grads, ref_grads = full_grads(eager), full_grads(reference)
    for rank, res in enumerate(results):
        fused = [s for s in res["sites"] if s[1]]
        assert not res["warnings"], res["warnings"]
        # 2 norms per block + the final one; every norm fed by an add is fused with it
        assert res["counts"]["sites"] >= 2 * DEPTH + 1, res["sites"]
        add_fed = [s for s in res["sites"] if s[3]]
        assert len(add_fed) == 2 * DEPTH and all(s[1] and s[2] for s in add_fed), res["sites"]
        assert len(fused) == res["counts"]["sites"], res["sites"]
        assert within_tolerance(res["loss"], eager_loss.detach(), ref_loss.detach(), torch.float32)[0]
        for name, grad in res["grads"].items():
            ok, err, base, bound = within_tolerance(grad, eager_grads[name], ref_grads[name], torch.float32)
            assert ok, (rank, name, err, base, bound)
