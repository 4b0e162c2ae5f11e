"""Fuzzing the pass over randomly built small transformer stacks.

Hypothesis draws a ``ToyTransformer`` (placement, norm kind, spelling of the norm, dtype,
eps, hidden size, how the residual add is written, depth, embedding / final norms, sequence
length) and captures its graph three ways:

- ``make_fx`` (ATen graphs, as AOT / post-grad graphs look): every spelling, fastest
  capture that resolves Python control flow;
- ``torch.fx.symbolic_trace`` with ShapeProp metadata (torch-level graphs, norm modules as
  ``call_module``): the spellings that trace symbolically (T5's ``weight.dtype`` check and
  ``x.ndim - 1`` do not), and the add spelled four ways must fuse exactly like ``x + f``;
- ``normfuse.optimize`` (dynamo), forward and backward, in training mode with live dropout
  for a third of the examples.

Properties, for every example: the pass never raises and never falls back with a warning;
it reports every norm of the model (fused, or left with a reason); the rewritten graph's
outputs meet the tolerance rule against an fp64 run of the model.

The default run keeps a few hundred examples (derandomized, so CI is stable); the
``slow`` marker runs many more with fresh randomness: ``pytest -m slow tests/test_fuzz.py``.
"""

import copy
import itertools
import os
import warnings

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

import normfuse
from normfuse.tolerances import atol, error_factor, within_tolerance
from normfuse.verify.numeric import Fp64Mode
from normfuse.zoo import ADD_ORDERS, NORM_SPELLINGS, PLACEMENTS, ToyTransformer, _Attention, _MLP

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NORMS_PER_BLOCK = {"pre": 2, "post": 2, "res_post": 2, "sandwich": 4, "parallel": 2, "deepnorm": 2}
# spellings whose code needs concrete values (a parameter's dtype, x.ndim): not symbolically traceable
NOT_SYMBOLIC = {"t5", "square_div_sqrt"}

SLOW_EXAMPLES = int(os.environ.get("NORMFUSE_FUZZ_EXAMPLES", "2000"))


def _profile(examples: int, slow: bool = False):
    return settings(max_examples=SLOW_EXAMPLES if slow else examples, deadline=None, derandomize=not slow,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@st.composite
def stacks(draw, spellings=None):
    kind = draw(st.sampled_from(sorted(NORM_SPELLINGS)))
    choices = [s for s in NORM_SPELLINGS[kind] if spellings is None or s in spellings]
    hidden = draw(st.sampled_from([2, 4, 6, 8, 12, 16, 20, 32, 40, 64]))
    # LayerNorm over 2 values with eps = 0 outputs +-1 whatever the input: its gradient is 0,
    # and every computed gradient, eager's too, is rounding noise times rstd, unbounded as the
    # two values meet. The relative rule compares noise with noise there, so eps > 0 at N = 2.
    tiny_eps = [0.0, 1e-12] if not (kind == "layer_norm" and hidden == 2) else []
    return dict(
        placement=draw(st.sampled_from(PLACEMENTS)),
        kind=kind,
        spelling=draw(st.sampled_from(choices)),
        dtype=draw(st.sampled_from(DTYPES)),
        eps=draw(st.one_of(st.sampled_from([*tiny_eps, 1e-6, 1e-5, 0.1]), st.floats(1e-8, 1e-1))),
        hidden=hidden,
        add_order=draw(st.sampled_from(ADD_ORDERS)),
        depth=draw(st.integers(1, 2)),
        embed_norm=draw(st.booleans()),
        final_norm=draw(st.sampled_from([None, True, False])),
        seq=draw(st.integers(1, 9)),
        seed=draw(st.integers(0, 2**16)),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.3])),  # live in training mode (the optimize fuzz)
    )


def _stack(cfg, spelling=None):
    """The ToyTransformer ``cfg`` draws (its norms written ``spelling`` when given)."""
    return ToyTransformer(hidden=cfg["hidden"], heads=2, depth=cfg["depth"], placement=cfg["placement"],
                          kind=cfg["kind"], spelling=spelling or cfg["spelling"], eps=cfg["eps"],
                          embed_norm=cfg["embed_norm"], final_norm=cfg["final_norm"], add_order=cfg["add_order"],
                          dropout=cfg["dropout"])


def _build(cfg):
    torch.manual_seed(cfg["seed"])
    model = _stack(cfg)
    with torch.no_grad():  # weights of exactly 1 (or 0 for Gemma) hide rounding-order faults
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    ids = torch.randint(0, 64, (2, cfg["seq"]), generator=torch.Generator().manual_seed(cfg["seed"]))
    return model.eval(), ids


def _torch_layer_norm_twin(model, cfg):
    """``model`` with its hand-written LayerNorms as torch's own (the same parameters), or None.
    The fused op's CPU path is torch's LayerNorm, forward and backward, and torch's backward
    formula rounds otherwise than autograd through the written-out ops: both are eager
    computations of the model's function, and either one's error is a baseline. Found by the
    long fuzz: the fused gradients at 24x the written-out model's error on one norm weight, and
    to the ulp those of the same model with nn.LayerNorm (fp32, res_post, manual_div, eps 0,
    hidden 4: rows with std 0.03)."""
    if cfg["kind"] != "layer_norm" or not cfg["spelling"].startswith("manual"):
        return None
    twin = _stack(cfg, spelling="module")
    twin.load_state_dict(model.state_dict())
    return twin.to(cfg["dtype"]).train(model.training)


def _expected_sites(model, cfg):
    return (NORMS_PER_BLOCK[cfg["placement"]] * cfg["depth"] + (model.embed_norm is not None)
            + (model.final_norm is not None))


def _fuse_quietly(gm):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, rep = normfuse.fuse_graph(gm)
    fallbacks = [str(w.message) for w in record if "normfuse" in str(w.message)]
    assert not fallbacks, fallbacks  # a fallback is a pass failure: the fuzzer found a bug
    return rep


def _check_report(rep, expected_sites, cfg):
    assert len(rep.sites) == expected_sites, (cfg, str(rep))
    for s in rep.sites:
        assert s.fused or (isinstance(s.reason, str) and s.reason), (cfg, s)


def _check_outputs(out, eager, ref64, dtype, cfg, what="output", noise=0.0):
    """The tolerance rule; ``noise``: a floor for eager's error relative to the reference's
    size (``_two_column_noise``), 0 but at N = 2."""
    ok, err, base, bound = within_tolerance(out.float(), eager.float(), ref64, dtype)
    if not ok and noise and out.isfinite().all() and eager.isfinite().all():
        mag = ref64.abs().max().item()
        bound = error_factor(dtype) * max(base, noise * mag) + atol(dtype) * max(1.0, mag)
        ok = err <= bound
    assert ok, f"{what}: err {err:.3g} vs eager {base:.3g}, bound {bound:.3g} (noise {noise:.3g}); {cfg}"


def _reference(model, ids):
    with torch.no_grad():
        return copy.deepcopy(model).double()(ids)


# --------------------------------------------------------------------------- ATen graphs (make_fx)

def _fuzz_make_fx(cfg):
    model, ids = _build(cfg)
    ref64 = _reference(model, ids)
    model.to(cfg["dtype"])
    with torch.no_grad():
        gm = make_fx(model)(ids)
        eager = gm(ids)
        rep = _fuse_quietly(gm)
        out = gm(ids)
    _check_report(rep, _expected_sites(model, cfg), cfg)
    _check_outputs(out, eager, ref64, cfg["dtype"], cfg)
    return rep


# Examples the long runs found, kept in the default run.
# Two written-out LayerNorms (var form) of one value: the second took the first's mean and
# x - mean (equal values after CSE), which the first had claimed, and was not found.
_TWO_VAR_NORMS = dict(placement="parallel", kind="layer_norm", spelling="manual_var", dtype=torch.float32,
                      eps=1e-06, hidden=2, add_order="x+f", depth=1, embed_norm=False, final_norm=None, seq=1,
                      seed=0, dropout=0.0)
# bf16 T5-style RMSNorms of one value with eps = 0: as two kernels, a bias gradient's error was
# 12x eager's (0.047 against 0.004, over the rule's bound 0.038); as one kernel for the pair
# (the default, pair_norms=True), within the rule. With pair_norms=False it still exceeds it.
_TWO_T5_NORMS = dict(placement="parallel", kind="rms_norm", spelling="t5", dtype=torch.bfloat16, eps=0.0,
                     hidden=6, add_order="x+f", depth=2, embed_norm=False, final_norm=None, seq=2, seed=2,
                     dropout=0.0)


# bf16, 2 rows of 4: see _few_rows_16bit.
_LUCKY_EAGER_BF16 = dict(placement="deepnorm", kind="layer_norm", spelling="manual", dtype=torch.bfloat16,
                         eps=0.0964232241154464, hidden=4, add_order="x+f", depth=1, embed_norm=True,
                         final_norm=None, seq=1, seed=1, dropout=0.0)


@_profile(70)
@given(stacks())
@example(_TWO_VAR_NORMS)
def test_fuzz_fuse_graph_on_aten_graphs(cfg):
    _fuzz_make_fx(cfg)


@pytest.mark.slow
@_profile(0, slow=True)
@given(stacks())
def test_fuzz_fuse_graph_on_aten_graphs_long(cfg):
    _fuzz_make_fx(cfg)


# --------------------------------------------------------------------------- torch-level graphs (symbolic_trace)

class _LeafTracer(fx.Tracer):
    """Attention and MLP as leaves (their ``x.shape`` unpacking does not trace symbolically)."""

    def is_leaf_module(self, m, qualname):
        return isinstance(m, (_Attention, _MLP)) or super().is_leaf_module(m, qualname)


def _symbolic(model, ids):
    gm = fx.GraphModule(model, _LeafTracer().trace(model))
    ShapeProp(gm).propagate(ids)
    return gm


def _plan(rep):
    return [(s.placement, s.kind, s.fused, s.op, s.fused_add) for s in rep.sites]


def _fuzz_symbolic(cfg):
    model, ids = _build(cfg)
    ref64 = _reference(model, ids)
    model.to(cfg["dtype"])
    with torch.no_grad():
        eager = model(ids)
        gm = _symbolic(model, ids)
        rep = _fuse_quietly(gm)
        out = gm(ids)
        # the same model with its adds written x + f: the pass must do exactly the same
        plain, _ = _build({**cfg, "add_order": "x+f"})
        baseline = _fuse_quietly(_symbolic(plain.to(cfg["dtype"]), ids))
    _check_report(rep, _expected_sites(model, cfg), cfg)
    _check_outputs(out, eager, ref64, cfg["dtype"], cfg)
    assert _plan(rep) == _plan(baseline), (cfg, str(rep), str(baseline))


SYMBOLIC = {s for spellings in NORM_SPELLINGS.values() for s in spellings} - NOT_SYMBOLIC


@_profile(160)
@given(stacks(spellings=SYMBOLIC))
def test_fuzz_fuse_graph_on_symbolic_traces(cfg):
    _fuzz_symbolic(cfg)


@pytest.mark.slow
@_profile(0, slow=True)
@given(stacks(spellings=SYMBOLIC))
def test_fuzz_fuse_graph_on_symbolic_traces_long(cfg):
    _fuzz_symbolic(cfg)


# --------------------------------------------------------------------------- dynamo (optimize), with backward

def _seeded(model, ids, seed):
    torch.manual_seed(seed)  # the same dropout masks in every run
    return model(ids)


def _fuzz_optimize(cfg):
    torch._dynamo.reset()
    model, ids = _build(cfg)
    model.train(cfg["dropout"] > 0)
    ref_model = copy.deepcopy(model).double()
    model.to(cfg["dtype"])
    eager_model = copy.deepcopy(model)
    # eager's dropout masks (the fuzz compares with eager run for run); the kernel's own
    # dropout is checked given its mask in tests/test_branch_fold.py
    normfuse.optimize(model, fuse_dropout=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = _seeded(model, ids, cfg["seed"])
    assert not [str(w.message) for w in record if "normfuse" in str(w.message)]
    eager = _seeded(eager_model, ids, cfg["seed"])
    twin = _torch_layer_norm_twin(eager_model, cfg)
    twin_out = _seeded(twin, ids, cfg["seed"]) if twin is not None else None
    conditioning = _LayerNormConditioning(ref_model) if cfg["kind"] == "layer_norm" and cfg["hidden"] == 2 else None
    with Fp64Mode():  # the norms' own .to(float32) upcasts too: an fp32 norm is no reference
        ref64 = _seeded(ref_model, ids, cfg["seed"])
    _check_outputs(out.detach(), eager.detach(), ref64.detach(), cfg["dtype"], cfg)
    _check_report(normfuse.report(model), _expected_sites(model, cfg), cfg)
    # backward through the fused ops: parameter gradients of a fixed projection of the output
    g = torch.Generator().manual_seed(cfg["seed"])
    proj = torch.randn(out.shape, generator=g)
    for m, y in ((model, out), (eager_model, eager), (ref_model, ref64), (twin, twin_out)):
        if m is not None:
            (y * proj.to(y.dtype)).sum().backward()
    twins = twin.parameters() if twin is not None else itertools.repeat(None)
    grads = [(name, p.grad, _less_accurate(q.grad, t, r.grad), r.grad)
             for (name, p), q, t, r in zip(model.named_parameters(), eager_model.parameters(), twins,
                                           ref_model.parameters()) if r.grad is not None]
    floor = _two_column_noise(grads, conditioning) if cfg["hidden"] == 2 or _few_rows_16bit(cfg) else 0.0
    for name, got, base, ref in grads:
        _check_outputs(got, base, ref, cfg["dtype"], cfg, what=f"grad of {name}", noise=floor)


def _less_accurate(eager, twin_param, ref):
    """Of two eager gradients (the model as written, and the twin's parameter with torch's
    LayerNorm, or None), the one further from the fp64 reference (see _torch_layer_norm_twin)."""
    twin = twin_param.grad if twin_param is not None else None
    if twin is None or not (eager.isfinite().all() and twin.isfinite().all()):
        return eager
    return twin if (twin.double() - ref).abs().max() > (eager.double() - ref).abs().max() else eager


def _few_rows_16bit(cfg) -> bool:
    """fp16/bf16 with at most 4 rows: a weight gradient is a sum of at most 4 products, each
    behind a chain of 16-bit roundings, so one tensor's eager error is a few roundings and may
    happen to be small. Found: eager at 0.0022 on one bf16 norm weight (2 rows of 4) whose
    model's other gradients it got to 0.0026-0.025, and the fused ops at 0.0226 there (3 bf16
    ulps; deepnorm, manual LayerNorm, eps 0.096) while within 1-2x of eager elsewhere."""
    return cfg["dtype"] in (torch.float16, torch.bfloat16) and 2 * cfg["seq"] <= 4


class _LayerNormConditioning:
    """Records, for every LayerNorm call of a model (its fp64 reference run), the largest
    ``(var + eps) / eps`` over its rows: at N = 2 the relative rounding noise the norm's
    backward leaves in its input gradient, in fp32 ulps (see _two_column_noise)."""

    def __init__(self, model: torch.nn.Module):
        self.ratios: list[float] = []
        for module in model.modules():
            if getattr(module, "eps", None) is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
                module.register_forward_hook(self._record)

    def _record(self, module, args, output):
        x = args[0].detach().double()
        self.ratios.append(((x.var(-1, unbiased=False) + module.eps) / module.eps).max().item())

    def noise(self) -> float:
        """The relative noise these norms leave in any backward order: each norm adds its own
        to what flows through it (its backward is linear in the incoming gradient, so it scales
        signal and noise alike), a few ulps of ``rstd * |g|`` per rounding of its formula."""
        return _ROUNDINGS_PER_NORM * torch.finfo(torch.float32).eps * sum(self.ratios)


# the roundings of LayerNorm's backward that each leave ~1 ulp of rstd * |g| (x_hat, mean(g * x_hat),
# the product, the difference); measured over 216 two-column models (eps 1e-6 - 0.1, pre/post/parallel,
# depth 2): the fused gradients' largest error at up to 4.4x ulp * the sum of the ratios where those
# dominate (eps <= 1e-5); at eps 0.03 up to 6.6x, where the rest of the model's ~1e3 ulp does
_ROUNDINGS_PER_NORM = 4


def _two_column_noise(grads, conditioning: _LayerNormConditioning | None = None) -> float:
    """Eager's largest gradient error relative to the gradient's size, over the whole model.

    Over N = 2 columns a norm's input gradient is rounding noise in ill-conditioned rows, in
    any backward ordering, eager's included. LayerNorm's is exactly
    ``du = eps * rstd^3 * (g1 - g2) / 2 * (1, -1)`` (g = dy * w), while the general formula
    forms it as ``rstd * (g_c - x_hat * mean(g * x_hat))``, cancelling ``1 - (d * rstd)^2`` to
    ``eps * rstd^2``; rstd is saved rounded to fp32 (eager's rsqrt output too) and the backward
    has no eps, so the cancellation leaves ``~ulp_fp32 * rstd * |g|`` whatever the order: with
    var/eps = 1e4 that is ~10^4 ulp relative. (RMSNorm: g's part along x, likewise.) That noise
    flows into every gradient upstream of the norm, and which tensor's largest error happens
    to be small is chance: the fuzz found eager at 0.00138 on one fp16 bias whose neighbours
    were at 0.005 - 0.1 and the fused op at 0.0162 (hidden 2, sandwich, t5), and 4.3e-4
    against 1.6e-3 (fp32, res_post, manual_var). So at N = 2 each gradient's baseline is at
    least this model-wide relative noise of eager, times the gradient's size. Eager's own noise
    depends on the CPU's kernels: on one machine it came out at 3.4e-5 where the fused op's was
    1.3e-3 (fp32, parallel, manual, seed 64481), below the ~10^4 ulp the cancellation leaves in
    any order. So the floor is also never under that: 10^4 fp32 ulp (the backward computes in
    fp32 whatever the dtype), nor, for LayerNorms, under what the rows' own var / eps leaves
    (``conditioning``): the long fuzz found the fused op at 1.9e4 ulp on a norm weight where
    eager was at 3e2 (fp32, pre, manual_var, seq 1, dropout 0.3)."""
    rel = [(base.double() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
           for _, _, base, ref in grads if ref.numel() and ref.isfinite().all() and base.isfinite().all()]
    derived = [conditioning.noise()] if conditioning is not None else []
    return max(rel + derived + [1e4 * torch.finfo(torch.float32).eps])


@_profile(10)
@given(stacks())
@example(_TWO_T5_NORMS)
@example(_LUCKY_EAGER_BF16)
def test_fuzz_optimize_forward_backward(cfg):
    _fuzz_optimize(cfg)


def _two_columns(placement, kind, spelling, dtype, eps, add_order, depth, final_norm, seq, seed, dropout):
    return dict(placement=placement, kind=kind, spelling=spelling, dtype=dtype, eps=eps, hidden=2,
                add_order=add_order, depth=depth, embed_norm=False, final_norm=final_norm, seq=seq, seed=seed,
                dropout=dropout)


# Hidden = 2 models on which the long fuzz failed (see _two_column_noise): the fused gradients at
# 2.6x - 12x eager's error (fp32 LayerNorm: eager's fused backward formula; the others: eager's
# error small by chance on one tensor).
TWO_COLUMN_EXAMPLES = [
    _two_columns("res_post", "layer_norm", "manual_var", torch.float32, 1e-5, "f+x", 1, False, 9, 9698, 0.0),
    _two_columns("sandwich", "rms_norm", "t5", torch.float16, 1e-5, "x+f", 2, False, 7, 6131, 0.0),
    _two_columns("parallel", "rms_norm", "t5", torch.bfloat16, 0.00035752404879959383, "torch.add", 1, True, 5,
                 15932, 0.3),
    _two_columns("parallel", "layer_norm", "manual", torch.float32, 1e-5, "iadd", 2, True, 7, 64481, 0.0),
]


@pytest.mark.parametrize("cfg", TWO_COLUMN_EXAMPLES, ids=lambda c: f"{c['placement']}-{c['spelling']}-{c['dtype']}")
def test_two_column_gradients(cfg):
    _fuzz_optimize(cfg)


@pytest.mark.slow
@_profile(0, slow=True)
@given(stacks())
def test_fuzz_optimize_forward_backward_long(cfg):
    _fuzz_optimize(cfg)
