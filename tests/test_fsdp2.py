"""FSDP2 on CPU: 2 processes, gloo backend.

``fully_shard`` per block + root, then ``normfuse.optimize(model)`` (or torchtitan's
per-block ``torch.compile`` with a normfuse backend): every norm fed by an add is fused
with it, including the adds that end a block (carried across the FSDP unit boundary as
a residual pair); 10 training steps have the gradients of the unsharded eager model
under the project's tolerance rule.
"""

import time

import pytest
import torch

import normfuse
from normfuse.tolerances import within_tolerance
from normfuse.zoo import ToyTransformer

from helpers import WORLD, run_on_ranks

BATCH, SEQ, DEPTH, STEPS, LR = 4, 8, 2, 10, 0.05


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", hidden=32, depth=DEPTH)
    for name, p in model.named_parameters():  # norm weights away from 1, so their gradients matter
        if "norm" in name:
            torch.nn.init.normal_(p, 1.0, 0.2)
    return model.to(dtype)


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (BATCH, SEQ), generator=g), torch.randn(BATCH, SEQ, 64, generator=g))
            for _ in range(STEPS)]


def loss_of(model, ids, target):
    return (model(ids).double() - target.double()).square().mean()


def train(model, shard=slice(None), gather=lambda g: g):
    """STEPS of SGD; the gradients of every step, by parameter name."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for ids, target in batches():
        opt.zero_grad()
        loss_of(model, ids[shard], target[shard]).backward()
        history.append({n.replace("_orig_mod.", ""): gather(p.grad).detach().clone()
                        for n, p in model.named_parameters()})
        opt.step()
    return history


def _sharded(rank, variant, compile_final_norm=False):
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    if variant == "optimize":
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        normfuse.optimize(model, cross_block=True)
    else:  # torchtitan: apply_compile (each block), then fully_shard; the pairs first
        normfuse.prepare(model)
        for block in model.blocks:
            block.compile(backend=variant)
        if compile_final_norm:  # so that the last pair's add is fused too
            model.final_norm.compile(backend=variant)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
    start = time.perf_counter()
    grads = train(model, shard, gather=lambda g: g.full_tensor())
    seconds = time.perf_counter() - start
    rep = normfuse.report(model)  # the compiled blocks' graphs too, found through their parameters
    return {"grads": grads, "seconds": seconds, "warnings": list(rep.warnings), "notes": list(rep.notes),
            "uncaptured": list(rep.uncaptured),
            "sites": [(s.fqn, s.fused, s.fused_add, s.input_is_add, s.reason) for s in rep.sites]}


def run_distributed(variant, compile_final_norm=False):
    return run_on_ranks(_sharded, variant, compile_final_norm)


@pytest.fixture(scope="module")
def references():
    """The unsharded eager model's gradients, fp32 and fp64, over the same 10 steps."""
    return train(make_model()), train(make_model(torch.float64))


def _check(results, references, final_norm_fused):
    eager, exact = references
    norms = [f"blocks.{i}.norm{j}" for i in range(DEPTH) for j in (1, 2)] + ["final_norm"]
    for rank, res in enumerate(results):
        assert not res["warnings"], res["warnings"]
        sites = res["sites"]
        # every norm under its own path; only block 0's first norm reads no add (the embedding's
        # add is in the root's region); every other norm is fused with the add that feeds it,
        # block i's first one with the add carried over from block i-1
        found = [s[0] for s in sites]
        assert found == (norms if final_norm_fused else norms[:-1]), sites
        assert res["uncaptured"] == ([] if final_norm_fused else ["final_norm"]), res
        assert [s[0] for s in sites if not s[3]] == ["blocks.0.norm1"], sites
        assert all(s[1] and s[2] for s in sites if s[3]), sites
        for step, grads in enumerate(res["grads"]):
            for name, grad in grads.items():
                ok, err, base, bound = within_tolerance(grad, eager[step][name], exact[step][name], torch.float32)
                assert ok, (rank, step, name, err, base, bound)


def test_fully_shard_then_optimize_fuses_across_units(references):
    results = run_distributed("optimize")
    assert any("hand the residual pair" in note for note in results[0]["notes"])
    _check(results, references, final_norm_fused=True)
    print(f"optimize: 10 steps in {results[0]['seconds']:.1f} s")


def _per_block(variant, references, compile_final_norm=False):
    results = run_distributed(variant, compile_final_norm)
    print(f"{variant}: 10 steps in {results[0]['seconds']:.1f} s")
    # the final norm runs eagerly outside the compiled blocks (reported as not captured),
    # unless it is compiled too
    _check(results, references, final_norm_fused=compile_final_norm)


def test_per_block_compile_normfuse_backend(references):
    _per_block("normfuse", references)


def test_per_block_compile_with_the_final_norm_compiled_too(references):
    _per_block("normfuse", references, compile_final_norm=True)


@pytest.mark.slow
def test_per_block_compile_normfuse_inductor_backend(references):
    _per_block("normfuse_inductor", references)


# --------------------------------------------------------------------------- torchtitan's layout

# A torchtitan-shaped llama (normfuse.zoo.TitanLlama: `layers` of blocks with attention_norm,
# wq/wk/wv/wo, ffn_norm, a SwiGLU feed-forward; a final nn.RMSNorm) under FSDP2 as torchtitan
# applies it: fully_shard per block, then the root. Each variant is one way users write it.
TITAN_DEPTH, TITAN_STEPS = 4, 2
TITAN_NORMS = [f"layers.{i}.{n}" for i in range(TITAN_DEPTH) for n in ("attention_norm", "ffn_norm")] + ["norm"]
TITAN_VARIANTS = {
    "fully_shard_then_optimize": dict(),
    "optimize_then_fully_shard": dict(optimize_first=True),
    "keep_unsharded_after_forward": dict(reshard_after_forward=False),
    "mixed_precision_bf16": dict(mixed_precision=True),
    "checkpoint_per_block": dict(checkpoint=True),
    "checkpoint_per_block_cross_checkpoints": dict(checkpoint=True, cross_checkpoints=True),
}


def titan_model(dtype=torch.float32):
    from normfuse.zoo import TitanLlama
    return TitanLlama(depth=TITAN_DEPTH).to(dtype)


def titan_batches():
    g = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 64, (BATCH, SEQ), generator=g), torch.randn(BATCH, SEQ, 64, generator=g))
            for _ in range(TITAN_STEPS)]


def titan_train(model, shard=slice(None), gather=lambda g: g, autocast_dtype=None):
    """TITAN_STEPS of SGD; each step's gradients by parameter name (wrapper prefixes dropped)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for ids, target in titan_batches():
        opt.zero_grad()
        loss_of(model, ids[shard], target[shard]).backward()
        history.append({n.replace("_checkpoint_wrapped_module.", ""): gather(p.grad).detach().float().clone()
                        for n, p in model.named_parameters()})
        opt.step()
    return history


def _titan_sharded(rank, names):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    results = {}
    for name in names:
        v = TITAN_VARIANTS[name]
        torch._dynamo.reset()
        model = titan_model()
        options = dict(cross_checkpoints=v.get("cross_checkpoints", False))
        if v.get("checkpoint"):  # torchtitan's apply_ac: checkpoint_wrapper per block, before FSDP
            for i, block in enumerate(model.layers):
                model.layers.register_module(str(i), checkpoint_wrapper(block, preserve_rng_state=False))
        if v.get("optimize_first"):
            normfuse.optimize(model, **options)
        shard_options = dict(reshard_after_forward=v.get("reshard_after_forward", True))
        if v.get("mixed_precision"):
            shard_options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, **shard_options)
        fully_shard(model, **shard_options)
        if not v.get("optimize_first"):
            normfuse.optimize(model, **options)
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        grads = titan_train(model, shard, gather=lambda g: g.full_tensor())
        rep = normfuse.report(model)
        results[name] = {"grads": grads, "warnings": list(rep.warnings), "uncaptured": list(rep.uncaptured),
                         "text": str(rep),
                         "sites": [(s.fqn, s.fused, s.fused_add, s.input_is_add, s.reason) for s in rep.sites]}
    return results


@pytest.fixture(scope="module")
def titan_results():
    return run_on_ranks(_titan_sharded, list(TITAN_VARIANTS))


@pytest.fixture(scope="module")
def titan_references():
    """The unsharded eager model's gradients: fp32, bf16 (the mixed-precision baseline) and fp64."""
    return {dtype: titan_train(titan_model(dtype)) for dtype in (torch.float32, torch.bfloat16, torch.float64)}


@pytest.mark.parametrize("name", list(TITAN_VARIANTS))
def test_titan_layout_under_fsdp2_every_norm_fused(name, titan_results, titan_references):
    v = TITAN_VARIANTS[name]
    for rank, res in enumerate(r[name] for r in titan_results):
        sites = res["sites"]
        assert not res["warnings"], res["warnings"]
        # every norm found, each under its own path (one compiled graph serves several blocks)
        assert [s[0] for s in sites] == TITAN_NORMS, res["text"]
        assert all(s[1] for s in sites) and not res["uncaptured"], res["text"]
        # the add feeding each norm is fused with it: all 8 add-fed norms (the first one reads the
        # embedding); checkpointed blocks keep the sum for their recompute unless
        # cross_checkpoints hands them the pair: only the last block's pair (to the final norm)
        with_add = [s[0] for s in sites if s[2]]
        assert all(s[2] for s in sites if s[3]), res["text"]
        if v.get("checkpoint") and not v.get("cross_checkpoints"):
            expected = [f"layers.{i}.ffn_norm" for i in range(TITAN_DEPTH)] + ["norm"]
        else:
            expected = TITAN_NORMS[1:]
        assert with_add == expected, res["text"]
        eager = titan_references[torch.bfloat16 if v.get("mixed_precision") else torch.float32]
        exact = titan_references[torch.float64]
        dtype = torch.bfloat16 if v.get("mixed_precision") else torch.float32
        for step, grads in enumerate(res["grads"]):
            assert grads.keys() == eager[step].keys()
            for pname, grad in grads.items():
                ok, err, base, bound = within_tolerance(grad, eager[step][pname], exact[step][pname], dtype)
                assert ok, (rank, step, pname, err, base, bound)


# --------------------------------------------------------------------------- a checkpoint flag

# The loops that checkpoint when a flag of the model says so (tests/loops.py), under FSDP2 per
# block + root, then optimize. Flag off: whether the loop checkpoints is read at each forward, so
# every add is fused as in a plain loop. Flag on: torch.utils.checkpoint runs its block with dynamo
# disabled once FSDP2's hooks have broken the owner's graph, so optimize compiles each such block
# on its own (cross_block.checkpointed_sharded_blocks): every norm fused, each block's first norm
# without the add its checkpoint keeps the sum of.
FLAG_CASES = [(loop, flag) for loop in ("if_else", "conditional_expression", "helper_method") for flag in (False, True)]


def flagged_model(loop, checkpointing, dtype=torch.float32):
    from loops import flagged_loop
    model = flagged_loop(loop, checkpointing, depth=DEPTH)
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "norm" in name:
            torch.nn.init.normal_(p, 1.0, 0.2)
    return model.to(dtype).train()


def _flagged_sharded(rank, cases):
    from torch.distributed.fsdp import fully_shard

    results = {}
    for loop, flag, *user_compiled in cases:
        torch._dynamo.reset()
        model = flagged_model(loop, flag)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        if user_compiled:  # the caller compiled a block with a backend of their own before optimize
            model.blocks[0].compile(backend="eager")
        theirs = model.blocks[0]._compiled_call_impl
        notes = normfuse.prepare(model).notes
        normfuse.optimize(model)
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        grads = train(model, shard, gather=lambda g: g.full_tensor())
        rep = normfuse.report(model)
        results[loop, flag, *user_compiled] = {
            "grads": grads, "notes": notes, "text": str(rep), "report_notes": list(rep.notes),
            "sites": [(s.fqn, s.fused, s.fused_add, s.input_is_add) for s in rep.sites],
            "kept": theirs is not None and model.blocks[0]._compiled_call_impl is theirs}
    return results


USER_COMPILED = ("if_else", True, "user")


@pytest.fixture(scope="module")
def flagged_results():
    return run_on_ranks(_flagged_sharded, FLAG_CASES + [USER_COMPILED])


def test_a_block_the_caller_compiled_is_left_as_compiled_with_a_note(flagged_results):
    """optimize compiles the FSDP2 blocks a checkpointed loop runs on their own, but not one the
    caller compiled already (with a backend of their own): that one is left as it is, and the report
    says so and how to fuse its norms."""
    eager, exact = train(flagged_model("if_else", True)), train(flagged_model("if_else", True, torch.float64))
    for res in (r[USER_COMPILED] for r in flagged_results):
        assert res["kept"], res["text"]
        assert any(n.startswith("blocks.0: compiled by the caller, left as compiled") for n in res["report_notes"]), \
            res["report_notes"]
        sites = {s[0] for s in res["sites"]}
        assert not any(fqn.startswith("blocks.0.") for fqn in sites) and "blocks.1.norm1" in sites, res["text"]
        for step, grads in enumerate(res["grads"]):
            for name, grad in grads.items():
                ok, err, base, bound = within_tolerance(grad, eager[step][name], exact[step][name], torch.float32)
                assert ok, (step, name, err, base, bound)


@pytest.mark.parametrize("loop,flag", FLAG_CASES)
def test_fsdp2_with_a_checkpoint_flag_fuses_as_the_flag_says(loop, flag, flagged_results):
    eager, exact = train(flagged_model(loop, flag)), train(flagged_model(loop, flag, torch.float64))
    norms = [f"blocks.{i}.norm{j}" for i in range(DEPTH) for j in (1, 2)] + ["final_norm"]
    for rank, res in enumerate(r[loop, flag] for r in flagged_results):
        sites = {s[0]: s for s in res["sites"]}  # per module (a checkpoint's recompute may run a graph of its own)
        assert sorted(sites) == sorted(norms) and all(s[1] for s in sites.values()), res["text"]
        with_add = sorted(fqn for fqn, s in sites.items() if s[2])
        [note] = [n for n in res["notes"] if n.startswith("cross-block")]
        if flag:  # each checkpoint keeps its block's input, the sum: a block's first norm takes it alone
            assert with_add == sorted(n for n in norms if not n.endswith("norm1")), res["text"]
            assert "(holds now)" in note, note
        else:  # every add-fed norm with its add, as in a plain loop
            assert with_add == sorted(norms[1:]), res["text"]
            assert "checkpointed blocks" not in note and "(does not hold now)" in note, note
        for step, grads in enumerate(res["grads"]):
            for name, grad in grads.items():
                ok, err, base, bound = within_tolerance(grad, eager[step][name], exact[step][name], torch.float32)
                assert ok, (rank, step, name, err, base, bound)
