"""Train with FSDP2 and with tensor + sequence parallelism, optimized by normfuse.

    python examples/train_fsdp2_tp.py

Two CPU processes (gloo). A small model with torchtitan's llama layout is trained for
10 steps twice:
- FSDP2: ``fully_shard`` per block and on the root, then ``normfuse.optimize(model)``;
- TP + SP: torchtitan's llama plan (ColwiseParallel / RowwiseParallel, SequenceParallel
  norms, PrepareModuleInput), then ``normfuse.optimize(model)``.
Each prints what normfuse fused (every norm fed by an add is fused with it, across the
FSDP units too) and how far its losses are from the same model trained in one process.
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import normfuse
from normfuse.zoo import TitanLlama, apply_titan_tp

WORLD, STEPS, BATCH, SEQ, VOCAB = 2, 10, 4, 16, 64


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(STEPS)]


def train(model, rows=slice(None)):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for tokens, labels in batches():
        loss = F.cross_entropy(model(tokens[rows]).flatten(0, 1), labels[rows].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def run(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    reference = train(TitanLlama(vocab=VOCAB))  # one process, the whole batch, eager

    for name in ("FSDP2", "TP+SP"):
        torch._dynamo.reset()
        model = TitanLlama(vocab=VOCAB)
        if name == "FSDP2":
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)  # data parallel: half the batch
        else:
            apply_titan_tp(model, mesh)
            rows = slice(None)                                                  # every rank sees the batch
        # under FSDP2 each block is a graph of its own: the residual pair crosses (cross_block)
        normfuse.optimize(model)
        start = time.perf_counter()
        losses = train(model, rows)
        seconds = time.perf_counter() - start
        if name == "FSDP2":  # each rank's loss is over its half: average them
            losses = [loss.clone() for loss in losses]
            for loss in losses:
                dist.all_reduce(loss)
                loss /= WORLD
        counts = normfuse.report(model).counts()
        if rank == 0:
            gap = max(abs(a.item() - b.item()) for a, b in zip(losses, reference))
            print(f"{name}: {counts['sites']} norm sites, {counts['fused']} fused, "
                  f"{counts['fused_with_add']} of {counts['input_is_add']} add-fed ones with their add; "
                  f"{STEPS} steps in {seconds:.1f} s (first includes compiling); "
                  f"loss {losses[0].item():.4f} -> {losses[-1].item():.4f}, "
                  f"max |loss - one-process eager loss| {gap:.2e}")
    dist.barrier()  # both ranks done communicating before either tears the group down
    dist.destroy_process_group()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)
