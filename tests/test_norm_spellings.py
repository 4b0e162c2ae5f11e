"""Norms found by what they compute: a generator of spellings (tests/norm_spellings.py).

Every combination of how the last dim is named (``dim=``/``axis=``, negative or positive), how the
square is written (``pow(2)``, ``**2``, ``square()``, ``x*x``), the inverse square root (``rsqrt``,
``1/sqrt``, ``/ sqrt``, ``pow(-0.5)``, ``sqrt().reciprocal()``), eps on either side, the casts and
the weight, each norm reading a residual add. Each one is found, and either fused or refused with
a reason:

- fused with the add: outputs equal to eager bit for bit where the call computes the graph's own
  operations (an RMSNorm's ``rsqrt``/``pow(-0.5)``, in fp32, or upcast to fp32 and rounded to bf16 as
  models write it); else within the project's rule against fp64 (a division by sqrt instead of the
  call's rsqrt, the LayerNorm's two-pass variance: a few fp32 ulp, and in bf16 mostly equal);
- refused, with the reason in the report: statistics computed in bf16 (the graph rounds the mean
  and the rstd there; F.normalize of a bf16 row too), DeepSeek-V4's rstd rounded to bf16 before the
  multiply. ``F.normalize(x, dim=-1) * sqrt(d)`` in fp32 is the ``l2_norm`` call (eps clamps the L2 norm).

The fast test takes a covering subset (every value of every axis, in 48 combinations); the whole
grid (1920 norms per dtype) runs with ``-m slow``.
"""

import copy
import random

import pytest
import torch

import normfuse
from normfuse.tolerances import within_tolerance

import norm_spellings as ns

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

N = 32
AXES = (ns.KINDS, ns.DIMS, ns.SQUARES, ns.INVERSES, ns.EPS_SIDES, ns.CASTS, (True, False))


def covering(count: int = 48) -> list[ns.Spelling]:
    """``count`` distinct spellings in which every value of every axis appears: the first ones walk
    every axis at once, the rest are drawn from the grid with a fixed seed."""
    first = [ns.Spelling(*(axis[i % len(axis)] for axis in AXES)) for i in range(max(map(len, AXES)))]
    rest = [s for s in ns.GRID if s not in first]
    return first + random.Random(0).sample(rest, count - len(first))


def _exact(spec: ns.Spelling, dtype: torch.dtype) -> bool:
    """The call computes the graph's own operations: equal bit for bit."""
    same_ops = spec.kind == "rms_norm" and spec.inverse in ("rsqrt", "pow_half")
    return same_ops and (dtype != torch.bfloat16 or spec.casts != "none")


def _refusal(name: str, spec: ns.Spelling | None, dtype: torch.dtype) -> str | None:
    """The words of the reason a norm is refused with, None when it must be fused."""
    if name in ("normalize_w", "normalize_nw") and dtype == torch.bfloat16:
        return "F.normalize computes the row's L2 norm in torch.bfloat16"
    if name == "deepseek_v4" and dtype == torch.bfloat16:
        return "the rstd is rounded to torch.bfloat16 before the multiply"
    if dtype == torch.bfloat16 and (name in ("imagegpt", "ibert") or spec is not None and spec.casts == "none"):
        return "the row statistic is computed in torch.bfloat16"
    return None


def _run_grid(specs: list[ns.Spelling], dtype: torch.dtype) -> dict:
    norms = {s.name: ns.SpelledNorm(s, N) for s in specs}
    norms.update(ns.special_norms(N))
    by_name = {s.name: s for s in specs}
    model = ns.SpellingStack(norms).eval()
    model64 = copy.deepcopy(model).double()
    model = model.to(dtype)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 5, N, generator=g), torch.randn(len(norms), 2, 5, N, generator=g)
    ref64 = model64(x.double(), r.double())
    x, r = x.to(dtype), r.to(dtype)
    eager = model(x, r)
    normfuse.optimize(model)
    out = model(x, r)
    sites = {}
    for site in normfuse.report(model).sites:
        sites.setdefault(site.fqn.split(".")[1], []).append(site)
    outcome = {"fused_equal": 0, "fused_within": 0, "refused": 0}
    for i, name in enumerate(model.names):
        assert len(sites.get(name, [])) == 1, (name, sites.get(name))
        [site] = sites[name]
        spec = by_name.get(name)
        refusal = _refusal(name, spec, dtype)
        if refusal is not None:
            assert not site.fused and refusal in (site.reason or ""), (name, site.reason)
            assert torch.equal(out[i], eager[i]), name
            outcome["refused"] += 1
            continue
        assert site.fused and site.fused_add, (name, site.reason, site.add_reason)
        # the l2_norm call computes F.normalize's own steps on the reference path
        if spec is not None and _exact(spec, dtype) or name == "deepseek_v4" or name.startswith("normalize"):
            assert torch.equal(out[i], eager[i]), (name, (out[i].float() - eager[i].float()).abs().max())
            outcome["fused_equal"] += 1
        else:
            ok, err, err_eager, bound = within_tolerance(out[i], eager[i], ref64[i])
            assert ok, f"{name}: error {err:.3g} > bound {bound:.3g} (eager's {err_eager:.3g})"
            outcome["fused_within" if not torch.equal(out[i], eager[i]) else "fused_equal"] += 1
    return outcome


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spellings_covering(dtype):
    specs = covering()
    for field, axis in zip(ns.Spelling.__dataclass_fields__, AXES):
        assert {getattr(s, field) for s in specs} == set(axis), field
    outcome = _run_grid(specs, dtype)
    assert sum(outcome.values()) == 48 + len(ns.special_norms(N))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spellings_every_combination(dtype):
    outcome = _run_grid(ns.GRID, dtype)
    assert sum(outcome.values()) == len(ns.GRID) + len(ns.special_norms(N))
    print(dtype, outcome)


@pytest.mark.parametrize("name", ["imagegpt", "ibert", "deepseek_v4", "normalize_w", "normalize_nw"])
def test_written_norms_are_proved(name):
    """ImageGPT's and I-BERT's norms (axis=, a division by sqrt, eps first), DeepSeek-V4's
    unweighted RMSNorm and x-transformers' F.normalize RMSNorm in fp32 are fused with their add and
    proved by the checker."""
    torch.manual_seed(0)
    model = ns.SpellingStack({name: ns.special_norms(N)[name]}).eval()
    x, r = torch.randn(2, 5, N), torch.randn(1, 2, 5, N)
    result = normfuse.check(model, x, r)
    assert result.ok, result
    assert [s.symbolic.status for s in result.sites] == ["proved"], result
