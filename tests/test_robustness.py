"""The user's model never breaks: failures fall back, wrong requests raise clear errors,
and an optimized model keeps working in real use (modes, grad modes, autocast, dynamic
shapes, graph breaks, copies, checkpoints, dtype changes, shared and frozen parameters).

Every test compares against the same model run eagerly and asserts what the pass did
(site counts, which sites were fused, the reasons), not only that nothing raised.
"""

import copy
import io
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import normfuse
from normfuse.errors import (InvalidModelError, InvalidOptionError, NormfuseError, ShapeMismatchError,
                             UnsupportedDtypeError)
from normfuse.passes import pipeline
from normfuse.tolerances import within_tolerance
from normfuse.zoo import ToyTransformer, example_inputs, hf_model
from helpers import assert_close

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _inject_fault(monkeypatch, stage, error):
    """Make every NormFusionPass raise ``error`` as ``stage`` starts."""
    enter = pipeline.NormFusionPass._stage

    def failing(self, name):
        enter(self, name)
        if name == stage:
            raise error

    monkeypatch.setattr(pipeline.NormFusionPass, "_stage", failing)


def _optimized(model, **options):
    """(optimized model, untouched deep copy of it)."""
    ref = copy.deepcopy(model)
    return normfuse.optimize(model, **options), ref


def _normfuse_warnings(record):
    return [str(w.message) for w in record if "normfuse" in str(w.message)]


class DropBetween(nn.Module):
    """``norm(dropout(x + f(x)))``: dropout between the add and the norm."""

    def __init__(self, n=32, p=0.5):
        super().__init__()
        self.lin, self.lin2 = nn.Linear(n, n), nn.Linear(n, n)
        self.drop = nn.Dropout(p)
        self.norm, self.norm2 = nn.LayerNorm(n), nn.LayerNorm(n)

    def forward(self, x):
        h = self.norm(self.drop(x + self.lin(x)))
        return self.norm2(h + self.lin2(h))


class LowPrecisionStream(nn.Module):
    """A residual stream in the autocast dtype: under autocast every Linear returns bf16."""

    def __init__(self, n=32, rms_eps=1e-6):
        super().__init__()
        self.lin0, self.lin, self.lin2 = nn.Linear(n, n), nn.Linear(n, n), nn.Linear(n, n)
        self.norm, self.rms = nn.LayerNorm(n), nn.RMSNorm(n, eps=rms_eps)

    def forward(self, x):
        h = self.lin0(x)
        h = self.norm(h + self.lin(h))
        h = self.lin2(h)
        return self.rms(h + self.lin(h))


class SharedNorm(nn.Module):
    """One LayerNorm module applied after every block (ALBERT-style sharing)."""

    def __init__(self, n=32, depth=3):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(n, n) for _ in range(depth))
        self.norm = nn.LayerNorm(n)

    def forward(self, x):
        for lin in self.lins:
            x = self.norm(x + lin(x))
        return x


# --------------------------------------------------------------------------- failures fall back

@pytest.mark.parametrize("stage", pipeline.STAGES)
def test_fault_in_each_stage_falls_back_with_one_warning(stage, monkeypatch):
    _inject_fault(monkeypatch, stage, RuntimeError(f"injected fault in {stage}"))
    model, ref = _optimized(ToyTransformer().eval())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model(IDS)
    assert torch.equal(out, ref(IDS))
    messages = _normfuse_warnings(record)
    assert len(messages) == 1 and f"injected fault in {stage}" in messages[0]
    assert f"failed in stage {stage}: RuntimeError" in messages[0]  # the reason names the stage
    rep = normfuse.report(model)
    assert rep.counts()["fused"] == 0 and rep.graphs == 1
    assert len(rep.warnings) == 1 and f"injected fault in {stage}" in rep.warnings[0]
    if stage in ("plan", "rewrite", "lint"):
        # the sites were found before the failure: each is listed with it as the reason
        assert len(rep.sites) == 5
        assert all(f"injected fault in {stage}" in s.reason for s in rep.sites)
    # the fallback graph is reused: no second warning on the next call
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert torch.equal(model(IDS), ref(IDS))
    assert not _normfuse_warnings(record)


@pytest.mark.parametrize("stage", pipeline.STAGES)
def test_fault_in_fuse_graph_leaves_graph_unchanged(stage, monkeypatch):
    gm = fx.symbolic_trace(SharedNorm().eval())
    code = gm.code
    _inject_fault(monkeypatch, stage, ValueError(f"injected {stage}"))
    with pytest.warns(RuntimeWarning, match=f"injected {stage}"):
        out, rep = normfuse.fuse_graph(gm)
    assert out is gm and gm.code == code and rep.counts()["fused"] == 0


def test_capture_failure_runs_eagerly(monkeypatch):
    import torch._dynamo.output_graph as output_graph

    def broken(*args, **kwargs):
        raise RuntimeError("injected capture failure")

    monkeypatch.setattr(output_graph.OutputGraph, "compile_and_call_fx_graph", broken)
    model, ref = _optimized(ToyTransformer().eval())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = model(IDS)
        again = model(IDS)
    assert torch.equal(out, ref(IDS)) and torch.equal(again, out)
    messages = _normfuse_warnings(record)
    assert len(messages) == 1 and "runs ToyTransformer eagerly" in messages[0]
    assert "injected capture failure" in messages[0]
    rep = normfuse.report(model)
    assert rep.warnings == messages and rep.graphs == 0


def test_backend_failure_outside_the_pass_falls_back(monkeypatch):
    def broken(self, gm):
        raise KeyError("injected backend failure")

    monkeypatch.setattr(pipeline.NormFusionPass, "run", broken)
    model, ref = _optimized(ToyTransformer().eval())
    with pytest.warns(RuntimeWarning, match="injected backend failure"):
        out = model(IDS)
    assert torch.equal(out, ref(IDS))
    assert "runs it eagerly" in normfuse.report(model).warnings[0]


def test_users_own_error_still_raises_as_in_eager():
    model = normfuse.optimize(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        model(torch.randn(2, 5))
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    # the model was not switched to eager by the user's error: the next call is optimized
    x = torch.randn(2, 8)
    model(x)
    assert model.forward.eager_reason is None
    assert normfuse.report(model).counts()["fused"] == 1


# --------------------------------------------------------------------------- clear errors

def test_errors_name_the_problem_and_the_fix():
    with pytest.raises(InvalidModelError, match="torch.nn.Module.*torch.compile"):
        normfuse.optimize(lambda x: x)
    with pytest.raises(InvalidModelError, match="GraphModule"):
        normfuse.fuse_graph(nn.Linear(2, 2))
    with pytest.raises(InvalidOptionError, match="Did you mean 'standalone'"):
        normfuse.optimize(nn.Linear(2, 2), standalon=False)
    with pytest.raises(InvalidOptionError, match="True or False"):
        normfuse.FuseConfig(check="yes")
    with pytest.raises(InvalidOptionError, match="callable"):
        normfuse.FuseConfig(filter_fn="pre")
    x = torch.randn(4, 16)
    with pytest.raises(UnsupportedDtypeError, match="int64"):
        normfuse.add_rms_norm(x.long(), x.long(), torch.ones(16))
    with pytest.raises(ShapeMismatchError, match=r"\(4, 8\).*\(4, 16\)"):
        normfuse.add_layer_norm(x, torch.randn(4, 8))
    with pytest.raises(ShapeMismatchError, match="weight"):
        normfuse.add_rms_norm(x, x, torch.ones(15))
    for error in (InvalidModelError, InvalidOptionError, UnsupportedDtypeError, ShapeMismatchError):
        assert issubclass(error, NormfuseError)


def test_non_finite_values_propagate_as_in_eager():
    model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").eval()
    with torch.no_grad():
        model.tok.weight[3, 0] = float("inf")
        model.tok.weight[5, 1] = float("nan")
    # causal attention: the non-finite tokens last, so earlier positions stay finite
    ids = torch.tensor([[1, 2, 0, 7, 4, 6, 3, 5], [1, 2, 0, 7, 4, 6, 1, 2]])
    model, ref = _optimized(model)
    with torch.no_grad():
        out, expected = model(ids), ref(ids)
    assert expected.isnan().any() and expected.isfinite().any()  # the check below is not vacuous
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())
    assert torch.equal(out[out.isfinite()], expected[expected.isfinite()])
    assert normfuse.report(model).counts()["fused"] == 5


# --------------------------------------------------------------------------- modes

def test_train_eval_switch_never_fuses_through_live_dropout():
    model, ref = _optimized(DropBetween())
    x = torch.randn(2, 4, 32)
    model.train(), ref.train()
    torch.manual_seed(3)
    out = model(x)
    torch.manual_seed(3)
    expected = ref(x)
    assert torch.equal(out, expected)
    out.sum().backward(), expected.sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p.grad, q.grad)
    train_sites = normfuse.report(model).sites
    # training graph: the dropout is live, so the first norm's add stays outside its kernel
    assert [(s.fqn, s.input_is_add) for s in train_sites] == [("norm", True), ("norm2", True)]
    assert train_sites[0].op == "norm" and train_sites[1].op == "add_norm"
    assert "live dropout" in train_sites[0].add_reason and train_sites[1].add_reason is None
    model.eval(), ref.eval()
    assert torch.equal(model(x), ref(x))
    rep = normfuse.report(model)
    assert rep.graphs == 2  # dynamo recompiled for eval; the eval graph was rewritten for eval
    eval_sites = [s for s in rep.sites if s.graph == 1]
    assert [(s.fqn, s.op) for s in eval_sites] == [("norm", "add_norm"), ("norm2", "add_norm")]


def test_training_mode_dropout_in_branch_matches_eager():
    # fuse_dropout=False: eager's dropout before the fused add, the same masks as eager
    model, ref = _optimized(ToyTransformer(dropout=0.2).train(), fuse_dropout=False)
    ref.train()
    torch.manual_seed(7)
    out = model(IDS)
    torch.manual_seed(7)
    expected = ref(IDS)
    assert torch.equal(out, expected)
    assert normfuse.report(model).counts()["fused_with_add"] == 5
    assert normfuse.report(model).counts()["fused_dropout"] == 0


def test_training_mode_dropout_folded_into_the_kernel():
    # by default the kernel draws the branch's dropout: another stream, so not eager's numbers,
    # but the same seed gives the same output, and each site is equal given the kernel's mask
    model, ref = _optimized(ToyTransformer(dropout=0.2).train())
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(model(IDS))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert normfuse.report(model).counts()["fused_dropout"] == 4
    result = normfuse.check(ref, IDS)
    # every add_norm call but block 0's first norm (tok + pos: no dropout on that add) draws a mask
    assert all(s.passed and s.numeric.given_mask == (s.fqn != "blocks.0.norm1")
               for s in result.sites if s.op == "add_norm"), str(result)


@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode(grad_mode):
    model, ref = _optimized(ToyTransformer().eval())
    with grad_mode():
        out = model(IDS)
    assert not out.requires_grad and torch.equal(out, ref(IDS).detach())
    # back to grad mode: recompiled, and gradients flow through the fused ops
    y, z = model(IDS), ref(IDS)
    y.square().sum().backward(), z.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, name)
    assert all(s.fused for s in normfuse.report(model).sites)


def test_autocast_bf16_cpu_matches_eager():
    # CPU autocast keeps layer_norm / rms_norm in the input dtype (bf16 here): the sites are
    # fused, and the fused op sees the same bf16 inputs and fp32 weights as eager.
    model, ref = _optimized(LowPrecisionStream())
    x = torch.randn(2, 4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = model(x), ref(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    assert torch.equal(out, expected)
    sites = normfuse.report(model).sites
    assert [(s.kind, s.op, s.dtype) for s in sites] == [("layer_norm", "add_norm", "torch.bfloat16"),
                                                        ("rms_norm", "add_norm", "torch.bfloat16")]


def test_rms_norm_default_eps_in_bf16():
    # nn.RMSNorm(eps=None): torch.rms_norm uses finfo(float32).eps for a bf16 input (its
    # compute dtype), not finfo(bfloat16).eps; reading the latter changed outputs by 3e-2
    model, ref = _optimized(LowPrecisionStream(rms_eps=None))
    x = torch.randn(2, 4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), ref(x))


# --------------------------------------------------------------------------- shapes and graphs

def test_varying_sequence_lengths_do_not_recompile_per_length():
    from torch._dynamo.utils import counters

    counters.clear()
    model, ref = _optimized(ToyTransformer().eval())
    with torch.no_grad():
        for t in (4, 5, 6, 7, 9, 12, 16):
            ids = torch.randint(0, 64, (2, t))
            assert torch.equal(model(ids), ref(ids)), t
    rep = normfuse.report(model)
    # the first length is compiled static, the second marks the length dynamic: two graphs for 7 lengths
    assert rep.graphs == 2 and counters["stats"]["unique_graphs"] == 2
    assert rep.counts()["fused"] == 10 and rep.counts()["fused_with_add"] == 10


def test_hf_llama_dynamic_sequence_length():
    # the dynamic graph carries SymInt shapes in its metadata: every site is still fused there
    model, ref = _optimized(hf_model("llama"))
    with torch.no_grad():
        for seq in (5, 7, 11, 13):
            inputs = example_inputs(model, seq=seq)
            assert torch.equal(model(**inputs).last_hidden_state, ref(**inputs).last_hidden_state), seq
    rep = normfuse.report(model)
    assert rep.graphs == 2
    assert [sum(s.fused for s in rep.sites if s.graph == g) for g in (0, 1)] == [5, 5]
    assert sum(s.fused_add for s in rep.sites if s.graph == 1) == 4


class _WithGraphBreak(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = ToyTransformer(depth=1, final_norm=False)
        self.lin, self.norm = nn.Linear(64, 64), nn.LayerNorm(64)

    def forward(self, ids):
        h = self.body(ids)
        torch._dynamo.graph_break()
        return self.norm(h + self.lin(h))


def test_graph_breaks_each_graph_rewritten():
    model, ref = _optimized(_WithGraphBreak().eval())
    assert torch.equal(model(IDS), ref(IDS))
    rep = normfuse.report(model)
    assert rep.graphs == 2
    assert [(s.graph, s.fqn, s.op) for s in rep.sites] == [
        (0, "body.blocks.0.norm1", "add_norm"), (0, "body.blocks.0.norm2", "add_norm"), (1, "norm", "add_norm")]


# --------------------------------------------------------------------------- model lifecycle

def test_optimize_twice_is_a_no_op():
    model = ToyTransformer().eval()
    assert normfuse.optimize(model) is model
    compiled = model.forward
    model(IDS)
    rep = normfuse.report(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert normfuse.optimize(model) is model  # same options: silent
    model(IDS)
    assert model.forward is compiled and normfuse.report(model).counts() == rep.counts()
    assert rep.graphs == 1 and rep.counts()["fused"] == 5
    with pytest.warns(RuntimeWarning, match="already optimized"):
        normfuse.optimize(model, standalone=False)
    assert model.forward is compiled


def test_deepcopy_of_an_optimized_model_is_independent():
    model, _ = _optimized(ToyTransformer().eval())
    before = model(IDS)
    clone = copy.deepcopy(model)
    assert torch.equal(clone(IDS), before)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    assert not torch.equal(clone(IDS), before)  # the copy runs its own parameters
    assert torch.equal(model(IDS), before)       # and the original is untouched
    assert normfuse.report(clone).counts()["fused"] == 5


def test_state_dict_round_trip_with_an_unoptimized_model():
    model, _ = _optimized(ToyTransformer().eval())
    expected = model(IDS)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    plain = ToyTransformer().eval()
    assert list(plain.state_dict()) == list(model.state_dict())
    result = plain.load_state_dict(torch.load(buf))
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(plain(IDS), expected)
    # and back: an unoptimized model's checkpoint into an optimized one
    other = ToyTransformer(vocab=64).eval()
    model.load_state_dict(other.state_dict())
    assert torch.equal(model(IDS), other(IDS))


def test_whole_model_pickle_round_trip():
    import inspect

    model, _ = _optimized(ToyTransformer().eval())
    expected = model(IDS)
    assert list(inspect.signature(model.forward).parameters) == ["ids"]  # the model's own signature
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert normfuse.report(loaded).graphs == 0  # nothing compiled yet in the loaded model
    assert torch.equal(loaded(IDS), expected)
    rep = normfuse.report(loaded)
    assert rep.graphs == 1 and rep.counts()["fused"] == 5 and loaded.forward.module is loaded


def test_to_dtype_after_optimize_recompiles_in_the_new_dtype():
    model, ref = _optimized(ToyTransformer(kind="rms_norm", spelling="llama").eval())
    model(IDS)
    model.to(torch.bfloat16), ref.to(torch.bfloat16)
    with torch.no_grad():
        out, expected = model(IDS), ref(IDS)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    rep = normfuse.report(model)
    assert rep.graphs == 2
    assert {s.dtype for s in rep.sites if s.graph == 1} == {"torch.bfloat16"}
    assert all(s.fused for s in rep.sites)


def test_shared_norm_module_forward_and_grads():
    model, ref = _optimized(SharedNorm())
    x = torch.randn(3, 5, 32)
    out, expected = model(x), ref(x)
    assert_close(out, expected)
    out.square().sum().backward(), expected.square().sum().backward()
    # the shared weight collects the gradient of all three uses
    assert_close(model.norm.weight.grad, ref.norm.weight.grad)
    assert_close(model.norm.bias.grad, ref.norm.bias.grad)
    rep = normfuse.report(model)
    assert [(s.fqn, s.op) for s in rep.sites] == [("norm", "add_norm")] * 3


def test_albert_shares_its_layers():
    model, ref = _optimized(hf_model("albert"))
    inputs = example_inputs(model)
    out, expected = model(**inputs).last_hidden_state, ref(**inputs).last_hidden_state
    assert_close(out, expected)
    rep = normfuse.report(model)
    assert rep.counts()["by_placement"] == {"embedding": 1, "post": 4} and rep.counts()["fused"] == 5
    # both layers are the same module: its two norms appear twice, under the same name
    fqns = [s.fqn for s in rep.sites if s.placement == "post"]
    assert len(set(fqns)) == 2 and fqns[:2] == fqns[2:]


def test_frozen_parameters():
    model = ToyTransformer(kind="rms_norm", spelling="llama")
    for name, p in model.named_parameters():
        if "norm" in name or name.startswith("tok"):
            p.requires_grad_(False)
    model, ref = _optimized(model)
    out, expected = model(IDS), ref(IDS)
    assert torch.equal(out, expected)
    out.square().mean().backward(), expected.square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert_close(p.grad, q.grad, name)
        else:
            assert p.grad is None and q.grad is None, name
    assert normfuse.report(model).counts()["fused"] == 5


def test_torch_nn_containers_are_captured():
    # a forward that lives in torch.nn (dynamo skips those frames): nn.Module.compile would
    # capture no graph at all here
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model, ref = _optimized(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    x = torch.randn(2, 5, 32)
    assert torch.equal(model(x), ref(x))
    rep = normfuse.report(model)
    assert rep.graphs == 1
    assert [(s.fqn, s.placement, s.op) for s in rep.sites] == [
        (f"layers.{i}.norm{j}", "post", "add_norm") for i in (0, 1) for j in (1, 2)]


# the toy's norms per placement, every one fused: 2 blocks of 2 and pre-norm's final norm
FUSED_TOY = {"pre": 5, "res_post": 4, "deepnorm": 4}


@pytest.mark.parametrize("placement,kind,spelling", [("pre", "rms_norm", "llama"), ("res_post", "layer_norm", "module"),
                                                     ("deepnorm", "layer_norm", "manual")])
def test_triton_kernels_through_optimize_forward_and_backward(triton_cpu, placement, kind, spelling):
    # the fused ops run their Triton kernels (under Triton's interpreter on CPU) inside the
    # optimized graph; outputs and every parameter gradient meet the rule against fp64
    model, ref = _optimized(ToyTransformer(placement=placement, kind=kind, spelling=spelling))
    ref64 = copy.deepcopy(ref).double()
    outs = [m(IDS) for m in (model, ref, ref64)]
    ok, err, base, bound = within_tolerance(*(o.detach() for o in outs), torch.float32)
    assert ok, (err, base, bound)
    for o in outs:
        o.square().sum().backward()
    for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        ok, err, base, bound = within_tolerance(p.grad, q.grad, r.grad, torch.float32)
        assert ok, (name, err, base, bound)
    assert normfuse.report(model).counts()["fused"] == FUSED_TOY[placement]


def test_many_instances_of_one_class_are_all_optimized():
    # dynamo keeps at most 8 compiled entries per code object: each optimized model has a
    # frame of its own, so the 9th instance of a class is optimized like the first
    models = [normfuse.optimize(ToyTransformer(depth=1).eval()) for _ in range(10)]
    with torch.no_grad():
        for m in models:
            m(IDS)
    assert [normfuse.report(m).graphs for m in models] == [1] * 10
    assert all(normfuse.report(m).counts()["fused"] == 3 for m in models)
