"""Norms under CUDA autocast: a 16-bit input normalized into fp32.

CUDA autocast runs ``layer_norm`` and ``rms_norm`` in fp32 (its fp32 policy): with bf16
parameters and activations (HF ``torch_dtype=bfloat16`` plus Trainer ``bf16=True``) the
residual add rounds to bf16 and the norm reads that sum, upcast exactly, with its weight and
bias upcast, and writes fp32. The fused call is ``add_norm(..., sum_dtype=bf16,
out_dtype=float32)``.

CPU autocast keeps these norms in bf16, so the tests here build what CUDA autocast records:
the explicit-cast spelling (``F.layer_norm(s.float(), (N,), w.float(), b.float())``, also what
an ATen graph shows after autocast), and captured graphs whose fake-tensor metadata is
propagated again on fake CUDA tensors with CUDA autocast switched on (the dispatcher's
autocast kernels run for fake CUDA tensors on a CPU-only build; ``torch.autocast("cuda")``
itself refuses to turn on there). The GPU tests at the end run the real thing.
"""

import contextlib
import copy
import warnings

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import normfuse
from normfuse.passes.graph import copy_graph_module
from normfuse.verify.graph_check import check_graph_sites
from normfuse.verify.numeric import fp64_copy, run_graph
from normfuse.verify.sites import fused_calls
from helpers import assert_within

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

N = 48
BF16, F32 = torch.bfloat16, torch.float32


# --------------------------------------------------------------------------- CUDA autocast on a CPU build

@contextlib.contextmanager
def cuda_autocast(dtype=BF16, enabled=True):
    """CUDA autocast's state switched on directly (the dispatcher honours it for fake CUDA tensors)."""
    saved = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", enabled)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", saved[0])
        torch.set_autocast_dtype("cuda", saved[1])


class CudaAutocastProp(FakeTensorProp):
    """Fake-tensor propagation that enters the graph's own autocast regions as CUDA does."""

    def call_function(self, target, args, kwargs):
        if target is torch.amp.autocast_mode._enter_autocast:
            device, dtype, enabled = args[:3]
            token = contextlib.ExitStack()
            token.enter_context(cuda_autocast(dtype, enabled) if device == "cuda" else contextlib.nullcontext())
            return token
        if target is torch.amp.autocast_mode._exit_autocast:
            return args[0].close()
        return super().call_function(target, args, kwargs)


def as_captured_on_cuda(gm: fx.GraphModule, inputs, ambient: bool = True) -> fx.GraphModule:
    """Set every node's metadata to what a capture on CUDA records: fake CUDA tensors propagated
    under CUDA autocast (``ambient``: autocast around the call, as Trainer's bf16=True), entering
    the graph's own autocast regions too."""
    mode = FakeTensorMode()
    on_cuda = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    shadow = copy.deepcopy(gm)  # a symbolically traced graph calls modules: their parameters on fake CUDA too
    with mode:
        fakes = [on_cuda(t) for t in inputs]
        for name, t in [*shadow.named_parameters(), *shadow.named_buffers()]:
            owner, _, attr = name.rpartition(".")
            fake = on_cuda(t)
            # (no grad: autocast's cast cache for leaves that require grad aborts on fake CUDA tensors)
            setattr(shadow.get_submodule(owner), attr,
                    nn.Parameter(fake, requires_grad=False) if isinstance(t, nn.Parameter) else fake)
    with cuda_autocast() if ambient else contextlib.nullcontext():
        CudaAutocastProp(shadow, mode).propagate(*fakes)
    for node, twin in zip(gm.graph.nodes, shadow.graph.nodes):
        if "val" in twin.meta:
            node.meta["val"] = node.meta["example_value"] = twin.meta["val"]
    return gm


def capture(model: nn.Module, *args) -> tuple[fx.GraphModule, list]:
    """The one dynamo graph of ``model(*args)`` and its inputs (parameters included)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def autocast_reference(kind, s, weight, bias=None, eps=1e-5):
    """What CUDA autocast computes from the 16-bit sum s: the norm of the fp32 upcasts."""
    up = lambda t: None if t is None else t.float()
    if kind == "layer_norm":
        return F.layer_norm(up(s), (s.shape[-1],), up(weight), up(bias), eps)
    return F.rms_norm(up(s), (s.shape[-1],), up(weight), eps)


def plant(gm: fx.GraphModule, index: int, **changes) -> None:
    """Change options of fused call number ``index``, as a wrong rewrite would."""
    call = fused_calls(gm.graph)[index]
    call.kwargs = {**call.kwargs, **changes}
    gm.recompile()


# --------------------------------------------------------------------------- models

class ExplicitCasts(nn.Module):
    """``x + f(x)`` in the model dtype, then the norm of its fp32 upcast with upcast parameters:
    what CUDA autocast does to ``norm(x + f(x))``, written out."""

    def __init__(self, kind, n=N):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(n, n)
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))
        self.bias = nn.Parameter(0.1 * torch.randn(n))

    def forward(self, x):
        h = x + self.lin(x)
        if self.kind == "layer_norm":
            y = F.layer_norm(h.float(), (h.shape[-1],), self.weight.float(), self.bias.float(), 1e-5)
        else:
            y = F.rms_norm(h.float(), (h.shape[-1],), self.weight.float(), 1e-6)
        return y, h * 2


class Block(nn.Module):
    """A Pre-Norm pair of sublayers with module norms, as a bf16 model under autocast runs them:
    ``norm(h)`` returns fp32 there and the next linear takes it back to bf16."""

    def __init__(self, n=N, region=False):
        super().__init__()
        self.region = region
        self.lin1, self.lin2 = nn.Linear(n, n), nn.Linear(n, n)
        self.norm, self.rms = nn.LayerNorm(n), nn.RMSNorm(n, eps=1e-6)
        with torch.no_grad():
            for p in (self.norm.weight, self.norm.bias, self.rms.weight):
                p.add_(0.1 * torch.randn(n))

    def body(self, x):
        h = x + self.lin1(x)
        y = self.norm(h)
        h2 = h + self.lin2(y.to(h.dtype))
        return self.rms(h2), h2

    def forward(self, x):
        if self.region:
            with torch.autocast("cuda", dtype=BF16):
                return self.body(x)
        return self.body(x)


def _inputs(dtype=BF16, rows=6, seed=0):
    return torch.randn(rows, N, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --------------------------------------------------------------------------- the explicit-cast spelling

@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_explicit_casts_reference_path_equals_eager(kind, dtype):
    torch.manual_seed(0)
    model = ExplicitCasts(kind).to(dtype)
    ref = copy.deepcopy(model)
    normfuse.optimize(model)
    x = _inputs(dtype)
    (y, h), (y_ref, h_ref) = model(x), ref(x)
    assert y.dtype == F32 and h.dtype == dtype
    assert torch.equal(y, y_ref) and torch.equal(h, h_ref)
    [site] = normfuse.report(model).sites
    assert (site.op, site.fused_add, site.sum_dtype, site.out_dtype) == ("add_norm", True, str(dtype), "torch.float32")
    res = normfuse.check(ref, x)  # forward and backward against fp64, and the site against its subgraph
    assert res.ok and [(s.numeric.passed, s.symbolic.status) for s in res.sites] == [(True, "proved")], res


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_explicit_casts_triton_within_tolerance(kind, triton_cpu):
    torch.manual_seed(1)
    model = ExplicitCasts(kind).to(BF16)
    ref = copy.deepcopy(model)
    normfuse.optimize(model)
    x = _inputs(rows=37)
    (y, h), (y_ref, h_ref) = model(x), ref(x)
    assert y.dtype == F32 and torch.equal(h, h_ref)
    wide = fp64_copy(ref)
    y64 = autocast_reference(kind, (x.double() + wide.lin(x.double())).to(BF16).double(), wide.weight, wide.bias,
                             1e-5 if kind == "layer_norm" else 1e-6)
    assert_within(y, y_ref, y64, kind)
    [site] = normfuse.report(model).sites
    assert site.fused and site.out_dtype == "torch.float32" and site.sum_dtype == "torch.bfloat16"
    res = normfuse.check(ref, x)
    assert res.ok and all(s.symbolic.status == "proved" and s.numeric.passed for s in res.sites), res


def test_explicit_casts_checked_and_a_dropped_sum_rounding_caught():
    torch.manual_seed(2)
    model = ExplicitCasts("layer_norm").to(BF16)
    x = _inputs(rows=64)
    gm, inputs = capture(model, x)
    original = copy_graph_module(gm)
    gm, rep = normfuse.fuse_graph(gm)
    checks, _ = check_graph_sites(original, inputs, gm, rep.sites)
    assert [(c.numeric.passed, c.symbolic.status) for c in checks] == [(True, "proved")]
    # the norm of the unrounded fp32 sum: closer to fp64 than the graph, and not what it computes
    plant(gm, 0, round_sum_first=False)
    [check] = check_graph_sites(original, inputs, gm, rep.sites)[0]
    assert not check.numeric.passed and "rounds differently" in check.numeric.reason


# --------------------------------------------------------------------------- graphs captured under CUDA autocast

@pytest.mark.parametrize("region", [False, True], ids=["ambient", "region"])
def test_captured_under_cuda_autocast_fuses_with_fp32_output(region):
    torch.manual_seed(3)
    model = Block(region=region).to(BF16)
    x = _inputs(rows=40)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.autocast("cuda") on a CPU-only build
        gm, inputs = capture(model, x)
        assert region == any(n.target is torch.amp.autocast_mode._enter_autocast for n in gm.graph.nodes)
        as_captured_on_cuda(gm, inputs, ambient=not region)
        norms = [n for n in gm.graph.nodes if n.target in (F.layer_norm, torch.rms_norm)]
        assert [n.meta["val"].dtype for n in norms] == [F32, F32]   # as CUDA autocast records them
        original = copy_graph_module(gm)
        gm, rep = normfuse.fuse_graph(gm)
        assert [(s.kind, s.fused, s.fused_add, s.sum_dtype, s.out_dtype) for s in rep.sites] == [
            ("layer_norm", True, True, "torch.bfloat16", "torch.float32"),
            ("rms_norm", True, True, "torch.bfloat16", "torch.float32")]
        calls = fused_calls(gm.graph)
        assert [(c.kwargs["sum_dtype"], c.kwargs["out_dtype"], c.kwargs.get("round_sum_first", True))
                for c in calls] == [(BF16, F32, True)] * 2
        ys = [next(u for u in c.users if u.args[1] == 0) for c in calls]
        assert [y.meta["val"].dtype for y in ys] == [F32, F32]   # the graph's metadata stays true

        # run on CPU tensors, the fused calls compute what CUDA autocast computes
        out, h2 = gm(*inputs)
    p = dict(model.named_parameters())
    h = x + F.linear(x, p["lin1.weight"], p["lin1.bias"])
    y = autocast_reference("layer_norm", h, p["norm.weight"], p["norm.bias"])
    h2_ref = h + F.linear(y.to(BF16), p["lin2.weight"], p["lin2.bias"])
    assert torch.equal(h2, h2_ref)
    assert out.dtype == F32 and torch.equal(out, autocast_reference("rms_norm", h2_ref, p["rms.weight"], None, 1e-6))

    # the checker holds each call to its original subgraph, evaluated as CUDA autocast does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        checks, _ = check_graph_sites(original, inputs, gm, rep.sites)
    assert [(c.numeric.passed, c.symbolic.status) for c in checks] == [(True, "proved")] * 2, checks


@pytest.mark.parametrize("fault, says", [
    (dict(round_sum_first=False), "rounds differently"),    # fp32 math over the unrounded sum
    (dict(sum_dtype=F32), "dtype torch.float32 where the original has torch.bfloat16"),
    (dict(out_dtype=BF16), "dtype torch.bfloat16 where the original has torch.float32"),
    # n rounded before the weight: within the plain rule, whose fp64 reference does not round the sum
    (dict(norm_round_dtype=BF16), "rounds differently"),
])
def test_planted_wrong_rounding_is_caught(fault, says):
    torch.manual_seed(4)
    model = Block().to(BF16)
    x = _inputs(rows=64)
    gm, inputs = capture(model, x)
    as_captured_on_cuda(gm, inputs)
    original = copy_graph_module(gm)
    gm, rep = normfuse.fuse_graph(gm)
    plant(gm, 0, **fault)
    checks, _ = check_graph_sites(original, inputs, gm, rep.sites)
    assert [c.numeric.passed for c in checks] == [False, True]
    assert says in checks[0].numeric.reason, checks[0].numeric.reason


class ResPost(nn.Module):
    """``x + norm(f(x))`` (res-post): the fp32 norm output added to the bf16 stream promotes the
    sum to fp32; then a Pre-Norm site whose output a linear reads (``cast``: through a cast to
    bf16, else directly, as autocast runs the linear in bf16)."""

    def __init__(self, cast=True):
        super().__init__()
        self.cast = cast
        self.lin, self.head = nn.Linear(N, N), nn.Linear(N, N)
        self.norm, self.norm2 = nn.LayerNorm(N), nn.LayerNorm(N)
        with torch.no_grad():
            for norm in (self.norm, self.norm2):
                norm.weight.add_(0.1 * torch.randn(N))

    def forward(self, x):
        h = x + self.norm(self.lin(x))
        y = self.norm2(h.to(x.dtype) + x)
        return self.head(y.to(x.dtype) if self.cast else y), h


def test_res_post_under_cuda_autocast():
    torch.manual_seed(7)
    model = ResPost().to(BF16)
    x = _inputs(rows=12)
    gm, inputs = capture(model, x)
    as_captured_on_cuda(gm, inputs)
    original = copy_graph_module(gm)
    gm, rep = normfuse.fuse_graph(gm)
    assert [(s.op, s.fused, s.out_dtype) for s in rep.sites] == [("norm_add", True, "torch.float32"),
                                                                 ("add_norm", True, "torch.float32")]
    norm_add = fused_calls(gm.graph)[0]
    assert (norm_add.kwargs["out_dtype"], norm_add.kwargs["add_dtype"]) == (F32, F32)
    p = dict(model.named_parameters())
    h = x + autocast_reference("layer_norm", F.linear(x, p["lin.weight"], p["lin.bias"]), p["norm.weight"],
                               p["norm.bias"])
    y = autocast_reference("layer_norm", h.to(BF16) + x, p["norm2.weight"], p["norm2.bias"])
    out, h_out = gm(*inputs)
    assert h_out.dtype == F32 and torch.equal(h_out, h)
    assert torch.equal(out, F.linear(y.to(BF16), p["head.weight"], p["head.bias"]))
    checks, _ = check_graph_sites(original, inputs, gm, rep.sites)
    assert [(c.numeric.passed, c.symbolic.status) for c in checks] == [(True, "proved")] * 2, checks


def test_linear_reading_an_autocast_norm_output_is_not_recomputed():
    # recompute_norm_output runs the linears itself, in y's dtype: autocast runs this one in bf16
    model = ResPost(cast=False).to(BF16)
    x = _inputs(rows=12)
    gm, inputs = capture(model, x)
    as_captured_on_cuda(gm, inputs)
    head = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear][-1]
    assert head.meta["val"].dtype == BF16 and head.args[0].meta["val"].dtype == F32
    gm, rep = normfuse.fuse_graph(gm, recompute_norm_output=True)
    assert [(s.fused, s.recomputed_linears) for s in rep.sites] == [(True, 0), (True, 0)]
    linears = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear]
    assert [n.name for n in linears][-1] == head.name and linears[-1].meta["val"].dtype == BF16


def test_symbolically_traced_module_norm_under_cuda_autocast():
    # fx.symbolic_trace keeps nn.LayerNorm as a call_module node
    class AddNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)

        def forward(self, x, r):
            return self.norm(x + r)

    model = AddNorm().to(BF16)
    with torch.no_grad():
        model.norm.weight.add_(0.1 * torch.randn(16))
    gm = fx.symbolic_trace(model)
    x, r = torch.randn(2, 3, 16).to(BF16), torch.randn(2, 3, 16).to(BF16)
    as_captured_on_cuda(gm, [x, r])
    original = copy_graph_module(gm)
    gm, rep = normfuse.fuse_graph(gm)
    [site] = rep.sites
    assert site.fused and site.fused_add and site.out_dtype == "torch.float32", site
    assert torch.equal(gm(x, r), autocast_reference("layer_norm", x + r, model.norm.weight, model.norm.bias))
    # the checker evaluates the module as CUDA autocast does (input and parameters upcast)
    expected, _ = run_graph(original, [x, r])
    assert expected.dtype == F32 and torch.equal(gm(x, r), expected)


def test_aten_graph_after_autocast_fuses():
    # make_fx under CUDA autocast: the casts autocast inserted are explicit _to_copy nodes
    def f(x, r, w, b, w2):
        s = x + r
        return F.layer_norm(s, (N,), w, b, 1e-5), F.rms_norm(s * 2, (N,), w2, 1e-6), s

    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty(5, N, dtype=BF16, device="cuda") for _ in range(2)] + [
            torch.empty(N, dtype=BF16, device="cuda") for _ in range(3)]

    def traced(*args):
        with cuda_autocast():
            return f(*args)

    gm = make_fx(traced, tracing_mode="fake")(*fakes)
    assert any(n.target is torch.ops.aten._to_copy.default for n in gm.graph.nodes)
    gm, rep = normfuse.fuse_graph(gm)
    assert [(s.kind, s.fused, s.sum_dtype, s.out_dtype) for s in rep.sites] == [
        ("layer_norm", True, "torch.bfloat16", "torch.float32"), ("rms_norm", True, "torch.bfloat16", "torch.float32")]
    assert rep.sites[0].fused_add
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(5, N, generator=g).to(BF16) for _ in range(2))
    w, b, w2 = (torch.randn(N, generator=g).to(BF16) for _ in range(3))
    y, z, s = gm(x, r, w, b, w2)
    assert torch.equal(s, x + r)
    assert torch.equal(y, autocast_reference("layer_norm", x + r, w, b))
    # the decomposed rms_norm over the upcast: statistics summed in another order than ATen's
    assert_within(z, autocast_reference("rms_norm", (x + r) * 2, w2, None, 1e-6),
                  autocast_reference("rms_norm", ((x + r) * 2).double(), w2.double(), None, 1e-6))


def test_norm_returning_a_narrower_dtype_is_left_with_a_reason():
    # No autocast policy runs a norm of an fp32 input in bf16 here: such metadata is left alone.
    class AddNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)

        def forward(self, x, r):
            return self.norm(x + r)

    gm = fx.symbolic_trace(AddNorm())
    for node in gm.graph.nodes:
        if node.op == "call_module":
            node.meta["val"] = torch.empty(2, 16, dtype=BF16)
        elif node.op != "output":
            node.meta["val"] = torch.empty(2, 16) if node.op != "get_attr" else torch.ones(16)
    _, rep = normfuse.fuse_graph(gm)
    [site] = rep.sites
    assert not site.fused and "returns torch.bfloat16 for a torch.float32 input" in site.reason


# --------------------------------------------------------------------------- on a GPU

def _hf_bf16(family):
    pytest.importorskip("transformers")
    from normfuse.zoo import hf_model
    return hf_model(family, dtype=BF16).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("params", [BF16, F32], ids=["bf16-params", "fp32-params"])
def test_cuda_autocast_fuses_module_norms(params):
    torch.manual_seed(6)
    model = Block().to(params).cuda()
    ref = copy.deepcopy(model)
    normfuse.optimize(model)
    x = torch.randn(8, 33, N, device="cuda", dtype=BF16)  # the stream in bf16, as from a bf16 embedding
    with torch.autocast("cuda", dtype=BF16):
        (out, h), (out_ref, h_ref) = model(x), ref(x)
    assert out.dtype == out_ref.dtype == F32 and h.dtype == h_ref.dtype == BF16
    sites = normfuse.report(model).sites
    assert [(s.kind, s.fused, s.fused_add, s.sum_dtype, s.out_dtype) for s in sites] == [
        ("layer_norm", True, True, "torch.bfloat16", "torch.float32"),
        ("rms_norm", True, True, "torch.bfloat16", "torch.float32")]
    with torch.autocast("cuda", dtype=BF16):  # outputs and gradients vs fp64, each site vs its subgraph
        res = normfuse.check(copy.deepcopy(ref), x)
    assert res.ok and [(s.numeric.passed, s.symbolic.status) for s in res.sites] == [(True, "proved")] * 2, res


@pytest.mark.gpu
def test_cuda_autocast_bf16_hf_model_matches_eager():
    # HF torch_dtype=bfloat16 plus Trainer bf16=True: bf16 weights, the forward under CUDA autocast
    model = _hf_bf16("gpt2")
    ref = copy.deepcopy(model)
    normfuse.optimize(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), device="cuda")
    with torch.autocast("cuda", dtype=BF16):
        out, out_ref = model(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state
    assert out.dtype == out_ref.dtype == F32  # ln_f, run in fp32 by autocast
    ln = [s for s in normfuse.report(model).sites if s.kind == "layer_norm"]
    assert ln and all(s.fused and s.out_dtype == "torch.float32" and s.sum_dtype == "torch.bfloat16"
                      for s in ln), ln
    assert sum(s.fused_add for s in ln) >= len(ln) - 1
    with torch.autocast("cuda", dtype=BF16):  # forward and backward vs fp64, each site vs its subgraph
        res = normfuse.check(copy.deepcopy(ref), input_ids=ids)
    assert res.ok and all(s.numeric.passed and s.symbolic.status == "proved" for s in res.sites), res
