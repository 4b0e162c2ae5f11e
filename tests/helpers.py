"""Comparisons the tests share, all from the project's one tolerance table
(normfuse/tolerances.py)."""

from __future__ import annotations

import warnings

import torch

from normfuse.tolerances import atol, within_tolerance


def assert_close(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """The same computation in another order (a fused kernel's row reduction, Inductor's
    schedule): equal up to the table's atol for the dtype, scaled by the magnitude."""
    scale = max(1.0, expected.detach().abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol(expected.dtype) * scale, msg=msg or None)


def assert_within(candidate: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor, msg: str = "") -> None:
    """The project's rule against an fp64 reference: at most a small multiple of eager's error."""
    ok, err, err_eager, bound = within_tolerance(candidate, baseline, reference)
    assert ok, f"{msg} error {err:.3g} > bound {bound:.3g} (eager's error {err_eager:.3g})"


WORLD = 2  # processes of the distributed tests (gloo on CPU)


def _rank_main(rank: int, init_file: str, out_dir: str, body, args: tuple) -> None:
    import os
    import traceback

    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
        result = body(rank, *args)
        # every rank's collectives done before any rank tears its group down: a rank that
        # destroys the group while the other still communicates ends in gloo's C++ terminate
        # ("terminate called without an active exception", no Python traceback)
        dist.barrier()
        path = os.path.join(out_dir, f"rank{rank}.pt")
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)  # whole or absent: the parent may read it after a teardown death
    except Exception:  # noqa: BLE001 - the parent reads this file and fails with it
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(body, *args) -> list:
    """``body(rank, *args)`` in WORLD processes joined by gloo; each rank's return value, in
    rank order. ``body`` must be a module-level function (it is pickled by name)."""
    import os
    import tempfile

    import pytest
    import torch.distributed as dist
    import torch.multiprocessing as mp
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    with tempfile.TemporaryDirectory() as tmp:
        results = [os.path.join(tmp, f"rank{r}.pt") for r in range(WORLD)]
        try:
            mp.spawn(_rank_main, args=(os.path.join(tmp, "init"), tmp, body, args), nprocs=WORLD, join=True)
        except Exception as error:  # a rank that dies without a Python error (a signal) writes no traceback
            errors = [open(os.path.join(tmp, f)).read() for f in os.listdir(tmp) if f.endswith(".err")]
            if errors or not all(os.path.exists(path) for path in results):
                raise AssertionError(f"a rank failed ({type(error).__name__}: {error}):\n"
                                     + ("\n".join(errors) or "no traceback written")) from None
            # every rank passed the barrier and saved its result: the death came in gloo's
            # teardown ("terminate called without an active exception", seen under a loaded
            # machine: two xdist workers, two ranks each), after the work this test checks
            warnings.warn(f"a rank died after saving its result ({error}); its result is used", RuntimeWarning)
        return [torch.load(path, weights_only=False) for path in results]


def optimized_with_fault(model, plant):
    """``normfuse.optimize`` of a deep copy whose rewritten graphs ``plant(gm)`` then edits (a
    planted fault the checker must find at its site), each kept as the graph that ran."""
    import copy

    import normfuse
    from normfuse.runs import tracked

    optimized = normfuse.optimize(copy.deepcopy(model))
    fusing = optimized.forward.make_backend

    def make_backend():
        inner = fusing()

        def backend(gm, example_inputs):
            compiled = inner(gm, example_inputs)
            plant(gm)
            return tracked(gm.forward, compiled.normfuse_record)

        return backend

    optimized.forward.make_backend = make_backend
    return optimized


def eager_and_optimized(model, *args):
    """(the model's output, the output of ``normfuse.optimize`` of a deep copy, its report) on ``args``,
    without grad."""
    import copy

    import normfuse

    with torch.no_grad():
        ref = model(*args)
        optimized = normfuse.optimize(copy.deepcopy(model))
        out = optimized(*args)
    return ref, out, normfuse.report(optimized)


def plant_rope_fault(gm, fault: str) -> None:
    """Edit the first qk_norm_rope call of a rewritten graph the way a buggy rewrite would (a fault the
    checker must refute, or for the rounding one, catch numerically)."""
    from normfuse.verify.sites import fused_calls

    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("rotary_dim") is not None)
    kw = dict(call.kwargs)
    if fault == "wrong_half":      # the partner of column j taken as in the other layout
        kw["layout"] = "gptj" if kw["layout"] == "neox" else "neox"
    elif fault == "rotated_sign":  # sin for cos: the rotated half enters with the other sign and table
        kw["cos"], kw["sin"] = kw["sin"], kw["cos"]
    elif fault == "rotary_dim":    # GLM: the whole head rotated instead of its first half
        assert kw["rotary_dim"] < call.args[0].meta["example_value"].shape[-1]
        kw["rotary_dim"] *= 2
    elif fault == "no_bf16_round":  # y * cos + rot(y) * sin in fp32, rounded once
        assert kw["rope_dtype"] == torch.bfloat16
        kw["norm_out_dtype"] = kw["rope_dtype"] = torch.float32
    else:
        raise ValueError(fault)
    call.kwargs = kw
    gm.recompile()
