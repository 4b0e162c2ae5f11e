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
import os
import warnings

import pytest
import torch
import torch.fx as fx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.shape_prop import ShapeProp

import normfuse
from normfuse.tolerances import within_tolerance
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


def _build(cfg):
    torch.manual_seed(cfg["seed"])
    model = ToyTransformer(hidden=cfg["hidden"], heads=2, depth=cfg["depth"], placement=cfg["placement"],
                           kind=cfg["kind"], spelling=cfg["spelling"], eps=cfg["eps"], embed_norm=cfg["embed_norm"],
                           final_norm=cfg["final_norm"], add_order=cfg["add_order"], dropout=cfg["dropout"])
    with torch.no_grad():  # weights of exactly 1 (or 0 for Gemma) hide rounding-order faults
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    ids = torch.randint(0, 64, (2, cfg["seq"]), generator=torch.Generator().manual_seed(cfg["seed"]))
    return model.eval(), ids


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


def _check_outputs(out, eager, ref64, dtype, cfg, what="output"):
    ok, err, base, bound = within_tolerance(out.float(), eager.float(), ref64, dtype)
    assert ok, f"{what}: err {err:.3g} vs eager {base:.3g}, bound {bound:.3g}; {cfg}"


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


@_profile(70)
@given(stacks())
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
    normfuse.optimize(model)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = _seeded(model, ids, cfg["seed"])
    assert not [str(w.message) for w in record if "normfuse" in str(w.message)]
    eager, ref64 = _seeded(eager_model, ids, cfg["seed"]), _seeded(ref_model, ids, cfg["seed"])
    _check_outputs(out.detach(), eager.detach(), ref64.detach(), cfg["dtype"], cfg)
    _check_report(normfuse.report(model), _expected_sites(model, cfg), cfg)
    # backward through the fused ops: parameter gradients of a fixed projection of the output
    g = torch.Generator().manual_seed(cfg["seed"])
    proj = torch.randn(out.shape, generator=g)
    for m, y in ((model, out), (eager_model, eager), (ref_model, ref64)):
        (y * proj.to(y.dtype)).sum().backward()
    for (name, p), q, r in zip(model.named_parameters(), eager_model.parameters(), ref_model.parameters()):
        if r.grad is not None:
            _check_outputs(p.grad, q.grad, r.grad, cfg["dtype"], cfg, what=f"grad of {name}")


@_profile(10)
@given(stacks())
def test_fuzz_optimize_forward_backward(cfg):
    _fuzz_optimize(cfg)


@pytest.mark.slow
@_profile(0, slow=True)
@given(stacks())
def test_fuzz_optimize_forward_backward_long(cfg):
    _fuzz_optimize(cfg)
