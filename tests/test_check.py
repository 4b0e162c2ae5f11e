"""The equivalence checker: numeric (vs fp64), per-site localization, symbolic proofs, CLI.

The fault tests plant one bug in one fused call of a rewritten graph and require the
checker to fail and to name that site. Models are shrunk HF models (2 layers) with
their 1-D parameters perturbed: freshly built norm weights are exactly 1, which hides
rounding-order faults (rounding before or after ``* 1`` gives the same bits).
"""

import copy
import json
import warnings

import pytest
import torch

import normfuse
from normfuse.api import LOG_ATTR
from normfuse.capture import Recorder
from normfuse.verify.graph_check import check_graph_on_first_call
from normfuse.verify.numeric import Fp64Mode, perturb_vectors, ulp_diff
from normfuse.verify.sites import fused_calls
from normfuse.zoo import ToyTransformer, hf_model
from helpers import assert_close, optimized_with_fault

pytest.importorskip("transformers")
pytest.importorskip("sympy")


def _model(family, dtype):
    torch._dynamo.reset()
    return perturb_vectors(hf_model(family, dtype=dtype))


# --------------------------------------------------------------------------- planted faults

def plant(gm, index, fault):
    """Edit fused call number ``index`` of a rewritten graph the way a buggy rewrite would."""
    call = fused_calls(gm.graph)[index]
    kw = dict(call.kwargs)
    if fault == "eps":
        kw["eps"] = kw["eps"] * 10
    elif fault == "offset":
        assert kw["weight_offset"] == 1.0, "the offset fault needs a Gemma-style site"
        kw["weight_offset"] = 0.0
    elif fault == "cast_order":
        assert kw["norm_round_dtype"] == torch.bfloat16, "the cast-order fault needs a Llama-style bf16 site"
        kw["norm_round_dtype"] = None
    elif fault == "sum_not_rounded":
        assert kw["sum_dtype"] == torch.bfloat16
        kw["sum_dtype"] = torch.float32
    elif fault == "operand":
        x, r = call.args[:2]
        ev = r.meta["example_value"]
        before = list(gm.graph.nodes)
        before = before[:before.index(call)]
        same = [n for n in before if n not in (x, r) and isinstance(n.meta.get("example_value"), torch.Tensor)
                and n.meta["example_value"].shape == ev.shape and n.meta["example_value"].dtype == ev.dtype]
        call.args = (x, same[-1], *call.args[2:])
    else:
        raise ValueError(fault)
    call.kwargs = kw
    gm.recompile()


def faulty_copy(model, index, fault):
    """normfuse.optimize of a deep copy, with ``fault`` planted in fused call ``index``."""
    return optimized_with_fault(model, lambda gm: plant(gm, index, fault))


# (family, dtype, fused call index, fault, whether the exact math changes)
FAULTS = [
    ("llama", torch.float32, 2, "eps", True),
    ("gemma2", torch.bfloat16, 2, "offset", True),
    ("llama", torch.bfloat16, 1, "cast_order", False),
    ("llama", torch.bfloat16, 3, "sum_not_rounded", False),
    ("llama", torch.float32, 1, "operand", True),
]


@pytest.mark.parametrize("family,dtype,index,fault,math", FAULTS, ids=[f[3] for f in FAULTS])
def test_planted_fault_fails_and_names_the_site(family, dtype, index, fault, math):
    model = _model(family, dtype)
    res = normfuse.check(model, optimized=faulty_copy(model, index, fault), backward=False)
    assert not res.ok
    planted = f"g0.s{index}"
    assert res.first_divergence is not None and res.first_divergence.id == planted
    assert res.first_divergence.source and ".py:" in res.first_divergence.source
    failing = [s.id for s in res.sites if not s.passed]
    assert failing == [planted], failing            # no other site is blamed
    site = res.first_divergence
    # faults that change the exact math are refuted; rounding faults are proved (casts are
    # identities) and caught by the numeric check of that site alone
    assert site.symbolic.status == ("refuted" if math else "proved"), site.symbolic
    assert site.numeric.passed is False
    if fault in ("cast_order", "sum_not_rounded"):
        assert "rounds differently" in site.numeric.reason
        # more accurate, not less: only the per-site rounding budget sees it
        assert all(o.passed for o in res.outputs)


# --------------------------------------------------------------------------- equivalent rewrites

@pytest.mark.parametrize("family,dtype,sites", [("llama", torch.bfloat16, 5), ("gemma2", torch.float32, 9)])
def test_rewrite_is_equivalent(family, dtype, sites):
    model = _model(family, dtype)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = normfuse.check(model)
    assert res.ok, str(res)
    assert len(res.sites) == sites
    assert all(s.symbolic.status == "proved" and s.symbolic.method.startswith("algebra") for s in res.sites)
    names = [o.name for o in res.outputs]
    assert "last_hidden_state" in names and "grad:embed_tokens.weight" in names
    assert sum(n.startswith("grad:") for n in names) == sum(1 for _ in model.parameters())
    assert max(o.ratio for o in res.outputs) <= 3.0
    assert max(o.ulp_max for s in res.sites for o in s.numeric.outputs) <= 1
    assert res.first_divergence is None
    # the model passed in is untouched
    assert not hasattr(model, LOG_ATTR)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    d = res.to_dict()
    assert d["summary"]["proved"] == sites and json.loads(res.to_json())["summary"]["ok"] is True
    assert "EQUIVALENT" in str(res)


# every site kind the pass produces: ops add_norm / norm / norm_add, both norm kinds,
# residual_scale (deepnorm), the decomposed spellings. bf16: a cast after every norm.
TOYS = [("res_post", "rms_norm", "llama", {"norm_add"}),
        ("deepnorm", "layer_norm", "manual_var", {"add_norm"}),
        ("parallel", "layer_norm", "manual_div", {"add_norm"}),
        ("sandwich", "rms_norm", "gemma", {"add_norm", "norm"}),
        ("pre", "rms_norm", "t5", {"add_norm"}),
        ("post", "layer_norm", "module", {"add_norm"}),
        ("pre", "rms_norm", "square_div_sqrt", {"add_norm"})]


@pytest.mark.parametrize("placement,kind,spelling,ops", TOYS, ids=[f"{t[0]}-{t[2]}" for t in TOYS])
def test_symbolic_proofs_for_every_site_kind(placement, kind, spelling, ops):
    torch._dynamo.reset()
    model = perturb_vectors(ToyTransformer(placement=placement, kind=kind, spelling=spelling).eval().to(torch.bfloat16))
    res = normfuse.check(model, backward=False)
    assert res.ok, str(res)
    assert res.sites and ops <= {s.op for s in res.sites}
    assert [s.symbolic.status for s in res.sites] == ["proved"] * len(res.sites)


# --------------------------------------------------------------------------- casts outside the subgraph

class CastOutsideRMSNorm(torch.nn.Module):
    """Llama's RMSNorm: upcast, normalize, cast back, scale."""

    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, h):
        dtype = h.dtype
        h = h.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class CastOutsideStack(torch.nn.Module):
    """Mamba's block: the norm reads ``h.to(norm.weight.dtype)``, a cast outside its subgraph,
    and the residual is upcast before the add; the fused call reads the uncast values."""

    def __init__(self, n=32, depth=2):
        super().__init__()
        self.norms = torch.nn.ModuleList([CastOutsideRMSNorm(n) for _ in range(depth)])
        self.mixers = torch.nn.ModuleList([torch.nn.Linear(n, n) for _ in range(depth)])
        self.norm_f = CastOutsideRMSNorm(n)

    def forward(self, h):
        for norm, mixer in zip(self.norms, self.mixers):
            residual = h
            h = mixer(norm(h.to(dtype=norm.weight.dtype)))
            h = residual.to(torch.float32) + h
        return self.norm_f(h.to(dtype=self.norm_f.weight.dtype))


def test_casts_outside_the_subgraph_are_proved_and_a_wrong_eps_refuted():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = perturb_vectors(CastOutsideStack().eval())
    x = torch.randn(2, 8, 32)
    res = normfuse.check(model, x, backward=False)
    assert res.ok, str(res)
    assert [s.symbolic.status for s in res.sites] == ["proved"] * 3, [s.symbolic for s in res.sites]
    # the same sites with a wrong eps: refuted, and only that site
    res = normfuse.check(model, x, optimized=faulty_copy(model, 1, "eps"), backward=False)
    assert [s.symbolic.status for s in res.sites] == ["proved", "refuted", "proved"]
    assert not res.ok and res.first_divergence.id == "g0.s1"


# --------------------------------------------------------------------------- pieces

def test_fp64_mode_redirects_casts():
    x = torch.randn(3, dtype=torch.float64)
    with Fp64Mode():
        got = [x.to(torch.bfloat16), x.float(), x.half(), x.type(torch.float16), x.type_as(torch.ones(1)),
               x.to(torch.ones(1, dtype=torch.bfloat16)), torch.zeros(2, dtype=torch.float32),
               torch.full((), torch.finfo(x.dtype).min), torch.tensor(0.5)]  # no dtype: the default, fp64
        ints = x.to(torch.int64)
    assert [t.dtype for t in got] == [torch.float64] * len(got)
    assert ints.dtype == torch.int64
    assert torch.get_default_dtype() == torch.float32


def test_ulp_diff():
    b = torch.tensor([1.0, 2.0, -4.0, 0.5], dtype=torch.bfloat16)
    c = b.clone()
    c[1] = torch.nextafter(b[1:2], torch.tensor([9.0], dtype=torch.bfloat16))[0]
    assert ulp_diff(c, b) == (1.0, 0.25)
    assert ulp_diff(b, b) == (0.0, 0.0)


def test_backend_check_warns_with_the_site():
    torch._dynamo.reset()
    model = perturb_vectors(ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").to(torch.bfloat16))
    ids = torch.randint(0, 64, (2, 8))
    recorder = Recorder()
    torch.compile(model, backend=recorder)(ids)
    original, inputs = recorder.graphs[0]
    rewritten, report = normfuse.fuse_graph(copy.deepcopy(original))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_graph_on_first_call(rewritten, report, inputs, original=original) is rewritten
    plant(rewritten, 1, "cast_order")
    with pytest.warns(RuntimeWarning, match=r"first diverging site: g0\.s1 blocks\.0\.norm2"):
        check_graph_on_first_call(rewritten, report, inputs, original=original)


def test_cli_exit_codes(capsys):
    from normfuse.cli import main

    torch._dynamo.reset()
    assert main(["check", "hf:gpt2", "--json", "--no-backward"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["summary"]["ok"] is True and out["summary"]["sites"] == 5 and out["summary"]["proved"] == 5
    assert main(["check", "hf:no_such_model_type"]) == 2
    assert "no_such_model_type" in capsys.readouterr().err


# --------------------------------------------------------------------------- the full sweep

FAMILIES = {"bert": 5, "gpt2": 5, "llama": 5, "gemma2": 9, "gpt_neox": 5, "t5": 12}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_families_equivalent(family, dtype):
    res = normfuse.check(_model(family, dtype))
    assert res.ok, str(res)
    assert len(res.sites) == FAMILIES[family]
    assert all(s.symbolic.status == "proved" for s in res.sites)
    assert max(o.ratio for o in res.outputs) <= (2.0 if dtype == torch.float32 else 3.0)


def test_optimize_with_check_runs_the_checker_quietly(monkeypatch):
    import normfuse.verify.graph_check as graph_check

    calls = []
    real = graph_check._check_graph
    monkeypatch.setattr(graph_check, "_check_graph", lambda *a: calls.append(a[1]) or real(*a))
    torch._dynamo.reset()
    model = perturb_vectors(ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").eval())
    ids = torch.randint(0, 64, (2, 8))
    want = model(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = normfuse.optimize(copy.deepcopy(model), check=True)(ids)
    assert_close(got, want)
    assert len(calls) == 1 and len(calls[0].fused) == 5  # the graph and its 5 rewritten sites were checked


@pytest.mark.parametrize("way", ["residual_dtype", "prenorm"])
def test_sites_not_compared_say_so(way):
    """A widened or converted site has no original subgraph to be compared with: the check says
    it was not compared (in the result and in the table), and never that it passed."""
    torch._dynamo.reset()
    ids = torch.randint(0, 64, (2, 8))
    if way == "residual_dtype":
        model = ToyTransformer(depth=2, kind="rms_norm").to(torch.bfloat16).eval()
        optimized = normfuse.optimize(copy.deepcopy(model), residual_dtype=torch.float32)
    else:
        model = ToyTransformer(placement="post", depth=2).eval()
        optimized = normfuse.optimize(copy.deepcopy(model), prenorm=True)
    res = normfuse.check(model, ids, optimized=optimized)
    skipped = [s for s in res.sites if not s.compared]
    assert skipped, str(res)
    assert all(not s.passed and not s.failed and s.reason.startswith("not compared: by design") for s in skipped)
    assert res.summary()["sites_not_compared"] == len(skipped)
    assert res.summary()["sites_passed"] == len(res.sites) - len(skipped)
    rows = {line.split()[0]: line for line in str(res).splitlines() if line.startswith("  g")}
    for site in skipped:
        assert "not compared: by design" in rows[site.id] and not rows[site.id].rstrip().endswith(" ok")
    assert f"({len(skipped)} not compared: by design)" in str(res).splitlines()[0]
    assert res.ok  # by design: not a failure
    assert all(d["compared"] is False for d in res.to_dict()["sites"] if d["id"] in {s.id for s in skipped})


def test_fuse_graph_checks_at_the_first_call():
    """FuseConfig(check=True) is honoured by fuse_graph too (the backends check in the same way):
    the graph is held to the original on its first call, and a planted fault is named."""
    torch._dynamo.reset()
    model = perturb_vectors(ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").to(torch.bfloat16))
    ids = torch.randint(0, 64, (2, 8))
    recorder = Recorder()
    torch.compile(model, backend=recorder)(ids)
    original, inputs = recorder.graphs[0]
    gm, report = normfuse.fuse_graph(copy.deepcopy(original), check=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm(*inputs)
    bad, report = normfuse.fuse_graph(copy.deepcopy(original), check=True)
    plant(bad, 1, "cast_order")
    with pytest.warns(RuntimeWarning, match=r"first diverging site: g0\.s1"):
        bad(*inputs)


def test_a_rewritten_graph_without_its_record_is_not_passed(monkeypatch):
    """The checker pairs calls with what they replaced only through the rewrite's record
    (normfuse/passes/record.py); a graph that lost it is not checked by guesswork."""
    from normfuse.passes import pipeline
    monkeypatch.setattr(pipeline, "attach_records", lambda gm, records, splits=None: None)
    model = _model("llama", torch.float32)
    res = normfuse.check(model, backward=False)
    assert not res.ok and res.sites
    assert all(not s.passed and "no record of them" in s.numeric.reason for s in res.sites), str(res)


class _MaskedBlock(torch.nn.Module):
    """A residual block that reads a float mask as data (HunyuanVideo sums it to an int)."""

    def __init__(self):
        super().__init__()
        self.proj, self.norm = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)

    def forward(self, x, mask):
        lengths = mask.sum(dim=1, dtype=torch.int)  # autograd takes no int result of an input requiring grad
        return self.norm(x + self.proj(x)) * lengths[:, None, None]


def test_inputs_the_model_reads_as_data_are_not_differentiated():
    """check(backward=True) on a model that fails with its floating inputs requiring grad: the
    parameters' gradients are compared, and a note says the inputs' are not."""
    x, mask = torch.randn(2, 4, 8), torch.ones(2, 3)
    with pytest.raises(RuntimeError):
        _MaskedBlock()(x.requires_grad_(), mask.clone().requires_grad_())
    res = normfuse.check(_MaskedBlock(), x.detach(), mask)
    assert res.ok, res
    assert any(n.startswith("the inputs are not differentiated") for n in res.notes), res.notes
    names = {o.name for o in res.outputs}
    assert {"grad:proj.weight", "grad:norm.weight"} <= names and not any(n.startswith("grad:input") for n in names), \
        names
