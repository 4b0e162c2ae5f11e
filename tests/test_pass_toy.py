"""The graph pass on hand-written models: one per placement and per spelling.

Asserts what the pass found (site counts, placements, input_is_add / output_feeds_add,
which op replaced each site), not only that outputs still match.
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import normfuse
from normfuse.tolerances import within_tolerance
from normfuse.zoo import NORM_SPELLINGS, ToyTransformer
from helpers import assert_close

# depth 2. Expected per placement, with the reasoning:
#   pre:      2 blocks x 2 norms + final norm = 5, all "pre". Block 0's first norm reads
#             tok + pos, which broadcasts (pos has no batch dim): the kernel reads pos's rows
#             again every S rows -> 5 sites fused with their add.
#   post:     embedding norm of tok + pos (the broadcast add in its kernel) + 2 x 2 post norms.
#   res_post: x + norm(F(x)), 2 x 2, each folded with the add after it (norm_add).
#   sandwich: 2 x 2 pre norms + final (pre) and 2 x 2 inner norms (sandwich); the add after
#             each inner norm is folded into the next pre norm, so inner norms run alone.
#   parallel: two norms read the same x in each block (4 parallel) + the final norm; all read
#             an add (tok + pos, then x + attn + mlp). The two norms of a block are one kernel
#             (3 calls for 5 sites): block 0's takes the broadcast tok + pos; block 1's and the
#             final norm's take the three-operand sum (x1).
#   deepnorm: norm(alpha * x + F(x)), 2 x 2.
EXPECTED = {
    "pre": dict(placements={"pre": 5}, fused_add=5, input_is_add=5, ops={"add_norm": 5}),
    "post": dict(placements={"embedding": 1, "post": 4}, fused_add=5, input_is_add=5, ops={"add_norm": 5}),
    "res_post": dict(placements={"res_post": 4}, fused_add=4, input_is_add=0, ops={"norm_add": 4}),
    "sandwich": dict(placements={"pre": 5, "sandwich": 4}, fused_add=5, input_is_add=5,
                     ops={"add_norm": 5, "norm": 4}),
    "parallel": dict(placements={"parallel": 4, "pre": 1}, fused_add=5, input_is_add=5,
                     ops={"add_norm": 5}, calls=3, x1=2),
    "deepnorm": dict(placements={"deepnorm": 4}, fused_add=4, input_is_add=4, ops={"add_norm": 4}),
}


def _run(model, ids, **options):
    torch._dynamo.reset()
    with torch.no_grad():
        ref = model(ids)
        normfuse.optimize(model, **options)
        out = model(ids)
    return ref, out, normfuse.report(model)


def _ops(rep):
    ops = {}
    for s in rep.sites:
        if s.fused:
            ops[s.op] = ops.get(s.op, 0) + 1
    return ops


@pytest.mark.parametrize("placement", list(EXPECTED))
@pytest.mark.parametrize("kind,spelling", [("layer_norm", "module"), ("rms_norm", "llama")])
def test_placements(placement, kind, spelling):
    torch.manual_seed(0)
    model = ToyTransformer(placement=placement, kind=kind, spelling=spelling, embed_norm=placement == "post").eval()
    ids = torch.randint(0, 64, (2, 8))
    ref, out, rep = _run(model, ids)
    want = EXPECTED[placement]
    c = rep.counts()
    assert c["by_placement"] == want["placements"]
    assert c["fused"] == c["sites"], [s.reason for s in rep.unfused]
    assert c["fused_with_add"] == want["fused_add"]
    assert c["input_is_add"] == want["input_is_add"]
    assert _ops(rep) == want["ops"]
    assert c["fused_calls"] == want.get("calls", c["fused"])
    assert c["fused_x1"] == want.get("x1", 0)
    assert all(s.kind == kind for s in rep.sites)
    assert_close(out, ref)


@pytest.mark.parametrize("kind,spelling", [(k, s) for k, ss in NORM_SPELLINGS.items() for s in ss])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spellings(kind, spelling, dtype):
    """Every spelling of both norms is recognized, with its eps, in fp32 and bf16."""
    torch.manual_seed(0)
    model = ToyTransformer(placement="pre", kind=kind, spelling=spelling, eps=1e-3).eval().to(dtype)
    ids = torch.randint(0, 64, (2, 8))
    ref, out, rep = _run(model, ids)
    assert len(rep.sites) == 5 and len(rep.fused) == 5, [s.reason for s in rep.sites]
    assert all(s.kind == kind and s.eps == pytest.approx(1e-3) for s in rep.sites)
    expected_form = {"module": "module", "functional": "functional"}.get(spelling, "decomposed")
    assert all(s.form.startswith(expected_form) for s in rep.sites), [s.form for s in rep.sites]
    if spelling == "gemma":
        assert all(s.weight_offset == 1.0 for s in rep.sites)
    if spelling == "llama" and dtype == torch.bfloat16:
        assert all(s.norm_round_dtype == "torch.bfloat16" for s in rep.sites)
    # the fused op reproduces the graph's rounding points. fp32: a statistic written out by hand
    # (1 / sqrt, a two-pass variance) is computed as the op computes it (rsqrt, one pass), a few
    # ulp apart: the table's fp32 row. bf16: those differences stay below its rounding, and the
    # CPU path reduces rows as eager does: bit for bit
    if dtype == torch.float32:
        assert_close(out, ref)
    else:
        assert torch.equal(out, ref)


def test_backward_matches_eager():
    torch.manual_seed(0)
    model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").train()
    twin = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama").train()
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    torch._dynamo.reset()
    normfuse.optimize(model)
    model(ids).square().mean().backward()
    twin(ids).square().mean().backward()
    assert len(normfuse.report(model).fused) == 5
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        assert_close(p.grad, q.grad, name)


def test_state_dict_keys_unchanged_and_idempotent():
    model = ToyTransformer(placement="post", embed_norm=True).eval()
    keys = list(model.state_dict())
    ids = torch.randint(0, 64, (2, 8))
    _run(model, ids)
    assert list(model.state_dict()) == keys
    assert normfuse.optimize(model) is model  # a second optimize is a no-op
    with torch.no_grad():
        model(ids)
    assert len(normfuse.report(model).sites) == 5


def test_fuse_graph_twice_finds_nothing_new():
    model = ToyTransformer(placement="pre").eval()
    gm = torch.fx.symbolic_trace(model)
    ids = torch.randint(0, 64, (2, 8))
    from torch.fx.passes.shape_prop import ShapeProp
    ShapeProp(gm).propagate(ids)
    gm, rep = normfuse.fuse_graph(gm)
    assert len(rep.fused) == 5
    gm, rep2 = normfuse.fuse_graph(gm)
    assert rep2.sites == [] and "already optimized" in rep2.notes[0]
    with torch.no_grad():
        assert_close(gm(ids), model(ids))


def test_source_and_fqn_point_at_user_code():
    model = ToyTransformer(placement="pre", kind="layer_norm").eval()
    _, _, rep = _run(model, torch.randint(0, 64, (2, 8)))
    fqns = [s.fqn for s in rep.sites]
    assert fqns == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "final_norm"]
    assert all(s.source and "zoo.py:" in s.source for s in rep.sites), [s.source for s in rep.sites]
    assert all(s.module_type == "LayerNorm" and s.form == "module" for s in rep.sites)


def test_filter_fn_and_standalone_option():
    model = ToyTransformer(placement="sandwich").eval()
    _, _, rep = _run(model, torch.randint(0, 64, (2, 8)), filter_fn=lambda site: site.fqn != "final_norm",
                     standalone=False)
    by_fqn = {s.fqn: s for s in rep.sites}
    assert by_fqn["final_norm"].reason == "excluded by filter_fn"
    inner = [s for s in rep.sites if s.placement == "sandwich"]  # each runs alone: no add before it
    assert inner and all(not s.fused and "standalone" in s.reason for s in inner)
    assert by_fqn["blocks.0.norm1"].fused and by_fqn["blocks.0.norm1"].op == "add_norm"
    assert all(s.reason for s in rep.sites if not s.fused)


class _Unfusable(nn.Module):
    """Sites the pass must leave alone, each with a reason."""

    def __init__(self, n=16):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.ln2d = nn.LayerNorm((8, n))              # normalizes over the last two dims
        self.ln = nn.LayerNorm(n)
        self.bias_col = nn.Parameter(torch.randn(8, 1))

    def forward(self, x):
        a = self.ln2d(x + self.lin(x))                # not only the last dim
        b = self.ln(a + self.bias_col)                # the add broadcasts over the last dim: norm fused alone
        c = F.layer_norm((b + self.lin(b)).double(), (16,))  # fp64: not a kernel dtype
        return c.float()


def test_unfusable_sites_are_left_with_reasons():
    torch.manual_seed(0)
    model = _Unfusable().eval()
    x = torch.randn(2, 8, 16)
    ref, out, rep = _run(model, x)
    assert len(rep.sites) == 3
    first, second, third = rep.sites
    assert not first.fused and "last dim" in first.reason
    assert second.fused and second.op == "norm" and second.input_is_add  # add broadcast -> kept outside
    assert "broadcasts" in second.add_reason
    assert not third.fused and "float64" in third.reason
    assert_close(out, ref)


def test_torch_compile_backends_by_name():
    model = ToyTransformer(placement="pre").eval()
    ids = torch.randint(0, 64, (2, 8))
    for backend in ("normfuse", "normfuse_inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = compiled(ids)
            ref = model(ids)
        assert_close(out, ref, backend)
        assert len(normfuse.report(compiled).fused) == 5, backend
        assert list(compiled.state_dict())[0].startswith("_orig_mod.")


def test_triton_interpreter_path(triton_cpu):
    """A subset of the pass running the fused ops' Triton kernels (interpreter)."""
    torch.manual_seed(0)
    model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", hidden=32).eval()
    model_copy = copy.deepcopy(model)
    ids = torch.randint(0, 64, (1, 4))
    ref, out, rep = _run(model, ids)
    assert len(rep.fused) == 5
    with torch.no_grad():
        ref64 = copy.deepcopy(model_copy).double()(ids)
    ok, err, base, bound = within_tolerance(out, ref, ref64)
    assert ok, f"error {err:.3g} > bound {bound:.3g} (eager's {base:.3g})"


class _DropThenNorm(nn.Module):
    """GPT-2's embeddings: norm(dropout(tok + pos)) — the dropout sits between add and norm."""

    def __init__(self, n=32):
        super().__init__()
        self.lin, self.drop, self.norm = nn.Linear(n, n), nn.Dropout(0.1), nn.LayerNorm(n)

    def forward(self, x):
        s = x + self.lin(x)
        return s + self.norm(self.drop(s))


def test_add_not_folded_says_why():
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    for mode, folded in (("train", False), ("eval", True)):
        model = getattr(_DropThenNorm(), mode)()
        torch._dynamo.reset()
        normfuse.optimize(model)
        model(x)
        (site,) = normfuse.report(model).sites
        assert site.fused and site.input_is_add and site.fused_add == folded, site
        if not folded:  # live dropout: the add stays outside the kernel, and the report says why
            assert site.op == "norm" and "live dropout" in site.add_reason
    parallel = ToyTransformer(placement="parallel").eval()
    _, _, rep = _run(parallel, torch.randint(0, 64, (2, 8)))
    # the two norms of a block share one call, which takes their add (block 0's: tok + a broadcast pos)
    assert all(s.fused_add for s in rep.sites if s.input_is_add), [(s.fqn, s.add_reason) for s in rep.sites]


def test_rewritten_graph_pickles_and_retraces():
    import pickle
    model = ToyTransformer(placement="res_post").eval()
    ids = torch.randint(0, 64, (2, 8))
    gm = torch.fx.symbolic_trace(model)
    from torch.fx.passes.shape_prop import ShapeProp
    ShapeProp(gm).propagate(ids)
    gm, rep = normfuse.fuse_graph(gm)
    assert len(rep.fused) == 4
    again = pickle.loads(pickle.dumps(gm))          # unpickling re-traces the generated code
    retraced = torch.fx.symbolic_trace(gm)
    with torch.no_grad():
        assert torch.equal(again(ids), gm(ids)) and torch.equal(retraced(ids), gm(ids))
    assert sum(n.target is normfuse.norm_add for n in retraced.graph.nodes) == 4
