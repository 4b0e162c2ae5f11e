"""A q/k norm whose rows are sliced, one slice rotated (passes/norm_over_slices.py).

HunyuanVideo's single-stream blocks normalize q and k over the image and the text tokens at once,
rotate the image tokens only and concatenate the text tokens back; CogVideoX and CogView4 store the
rotated image tokens back into the normalized q. A norm over the last dim is per row, so the pass
gives each slice a norm of the input's slice: the rotated one is then one qk_norm_rope call, the
other a norm call, joined by a cat (HunyuanVideo's own; the store's copy for CogVideoX): the same bits.
"""

import copy
import operator
import warnings

import pytest
import torch
import torch.nn as nn
from helpers import eager_and_optimized

import normfuse
from normfuse.verify.sites import fused_calls

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

TEXT = 3  # the last TEXT tokens are not rotated


class _SlicedRope(nn.Module):
    """q/k norms per head, then diffusers' interleaved RoPE of the first S - TEXT positions, the last
    TEXT kept unrotated: ``form`` "cat" (HunyuanVideo: on (B, S, H, D), the unrotated rows joined
    back by a cat) or "store" (CogVideoX: on (B, H, S, D), the rotated rows stored back into the
    normalized q, ``q[:, :, :-TEXT] = rope(q[:, :, :-TEXT])``); ``leak`` also returns the normalized q
    whole; ``norm``: "rms" (nn.RMSNorm) or "layer" (nn.LayerNorm)."""

    def __init__(self, heads=2, dim=8, leak=False, norm="rms", rope=True, form="cat"):
        super().__init__()
        self.heads, self.dim, self.leak, self.rope, self.form = heads, dim, leak, rope, form
        make = (lambda: nn.RMSNorm(dim, eps=1e-6)) if norm == "rms" else (lambda: nn.LayerNorm(dim, eps=1e-6))
        self.norm_q, self.norm_k = make(), make()
        with torch.no_grad():
            for m in (self.norm_q, self.norm_k):
                m.weight.uniform_(0.5, 1.5)

    @staticmethod
    def _rotate(x, cos, sin, seq_dim=1):
        # (S, D) per position, as diffusers' sequence_dim reads them
        cos, sin = (cos[None, :, None, :], sin[None, :, None, :]) if seq_dim == 1 else (cos[None, None], sin[None, None])
        real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        rotated = torch.stack([-imag, real], dim=-1).flatten(3)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def forward(self, x, cos, sin):
        q, k = (t.unflatten(-1, (self.heads, self.dim)) for t in (x, 2 * x))
        if self.form == "store":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = self.norm_q(q), self.norm_k(k)
        normalized = q
        if self.rope and self.form == "cat":
            q = torch.cat([self._rotate(q[:, :-TEXT], cos, sin), q[:, -TEXT:]], dim=1)
            k = torch.cat([self._rotate(k[:, :-TEXT], cos, sin), k[:, -TEXT:]], dim=1)
        if self.rope and self.form == "store":
            q[:, :, :-TEXT] = self._rotate(q[:, :, :-TEXT], cos, sin, seq_dim=2)
            k[:, :, :-TEXT] = self._rotate(k[:, :, :-TEXT], cos, sin, seq_dim=2)
        if self.form == "cat":
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, k)
        return (out, normalized) if self.leak else out


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g)
    angles = torch.randn(8 - TEXT, 4, generator=g).repeat_interleave(2, -1)  # (S - TEXT, D): one per pair
    return [x.to(dtype), angles.cos(), angles.sin()]


def _optimized(model, dtype=torch.float32):
    args = _inputs(dtype)
    model = model.to(dtype)
    return eager_and_optimized(model, *args)


FORMS = [dict(form="cat"), dict(form="cat", norm="layer"), dict(form="store", norm="layer"), dict(form="store")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", FORMS, ids=lambda v: "-".join(v.values()))
def test_the_rotated_slice_takes_its_rope(variant, dtype):
    ref, out, rep = _optimized(_SlicedRope(**variant), dtype)
    ops = sorted(s.op for s in rep.sites)
    assert ops == ["norm", "norm", "qk_norm_rope", "qk_norm_rope"], rep  # per norm: its image and text rows
    assert len({s.call for s in rep.sites if s.op == "qk_norm_rope"}) == 1, rep  # q with k, one call
    assert all(s.rope_reason is None for s in rep.sites), rep
    assert torch.equal(out, ref)


@pytest.mark.parametrize("variant", FORMS, ids=lambda v: "-".join(v.values()))
def test_each_slice_is_proved_and_the_gradients_hold(variant):
    """Every site proved; the gradients of x and the norms' parameters within the tolerance table
    against an fp64 copy (the store form's check runs forward only: its check would make cos require
    grad, and the model's own backward then reads the q its store overwrote)."""
    from normfuse.tolerances import within_tolerance

    model = _SlicedRope(**variant)
    res = normfuse.check(model, *_inputs(), backward=variant["form"] == "cat")
    assert res.ok, res
    assert [s.symbolic.status for s in res.sites] == ["proved"] * 4, res
    x, cos, sin = _inputs()
    cot = torch.randn(2, 2, 8, 8, generator=torch.Generator().manual_seed(3))

    def grads(m, dtype=torch.float32):
        leaf = x.detach().to(dtype).requires_grad_()
        (m(leaf, cos.to(dtype), sin.to(dtype)) * cot.to(dtype)).sum().backward()
        return [leaf.grad] + [p.grad for p in m.parameters()]
    optimized = normfuse.optimize(copy.deepcopy(model))
    got, eager, exact = grads(optimized), grads(copy.deepcopy(model)), grads(copy.deepcopy(model).double(), torch.float64)
    for g, e, r in zip(got, eager, exact):
        ok, err, err_base, bound = within_tolerance(g, e, r)
        assert ok, (err, err_base, bound)


@pytest.mark.parametrize("variant", [dict(leak=True), dict(rope=False)], ids=lambda v: "-".join(map(str, v)))
def test_what_is_not_split(variant):
    """A norm read whole besides its slices (q with ``leak``; k is split all the same), no rotation
    after the slices: the norm stays one norm (fused alone, with the reason where a RoPE follows),
    the output the same bits."""
    ref, out, rep = _optimized(_SlicedRope(**variant))
    q = [s for s in rep.sites if s.fqn == "norm_q"]
    assert len(q) == 1 and q[0].op == "norm", rep
    if variant.get("leak"):
        assert q[0].rope_reason.startswith("a RoPE follows this q/k norm on a slice of the tokens"), rep
        assert sorted(s.op for s in rep.sites if s.fqn == "norm_k") == ["norm", "qk_norm_rope"], rep
    else:
        assert q[0].rope_reason is None, rep
    outs, refs = (out, ref) if variant.get("leak") else ([out], [ref])
    assert all(torch.equal(a, b) for a, b in zip(outs, refs))


def _shifted_rows(gm):
    """The qk_norm_rope call normalizes q's rows one position later than its slice."""
    call = next(n for n in fused_calls(gm.graph) if n.kwargs.get("rotary_dim") is not None)
    piece = call.args[0]
    while not (piece.op == "call_function" and piece.target is operator.getitem):
        piece = piece.args[0]
    source, index = piece.args
    rows = index[1]
    with gm.graph.inserting_after(piece):
        shifted = gm.graph.call_function(operator.getitem, (source, (index[0], slice(1, rows.stop + 1))))
    shifted.meta = dict(piece.meta)
    piece.replace_all_uses_with(shifted)
    gm.graph.erase_node(piece)
    gm.recompile()


@pytest.mark.parametrize("variant", FORMS[::3], ids=lambda v: "-".join(v.values()))
def test_a_call_reading_other_rows_is_caught_at_its_site(variant):
    from helpers import optimized_with_fault

    model = _SlicedRope(**variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(model, *_inputs(), backward=False, optimized=optimized_with_fault(model, _shifted_rows))
    assert not res.ok
    failing = [s for s in res.sites if not s.passed]
    # the call's two sites (q's and k's rotated rows), refuted by the numbers; the text rows' calls pass
    assert {s.fqn for s in failing} == {"norm_q", "norm_k"} and len(failing) == 2, failing
    assert all(s.numeric.passed is False for s in failing), failing


class _JointStore(nn.Module):
    """EasyAnimate's joint attention: the text and the image q/k LayerNorms (their own weights) on
    (B, H, S, D), concatenated along the positions, the image rows' RoPE stored back into the cat
    (``q[:, :, TEXT:] = rope(q[:, :, TEXT:])``); ``leak``: the cat also read before the store."""

    def __init__(self, heads=2, dim=8, leak=False):
        super().__init__()
        self.heads, self.dim, self.leak = heads, dim, leak
        self.norms = nn.ModuleDict({n: nn.LayerNorm(dim, eps=1e-6) for n in ("q", "k", "added_q", "added_k")})
        with torch.no_grad():  # parameters of their own: a norm reading another's shows
            for m in self.norms.values():
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)

    def forward(self, text, image, cos, sin):
        def heads(t):
            return t.unflatten(-1, (self.heads, self.dim)).transpose(1, 2)
        q = torch.cat([self.norms["added_q"](heads(text)), self.norms["q"](heads(image))], dim=2)
        k = torch.cat([self.norms["added_k"](heads(2 * text)), self.norms["k"](heads(2 * image))], dim=2)
        seen = q.sum() if self.leak else 0
        q[:, :, TEXT:] = _SlicedRope._rotate(q[:, :, TEXT:], cos, sin, seq_dim=2)
        k[:, :, TEXT:] = _SlicedRope._rotate(k[:, :, TEXT:], cos, sin, seq_dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, k) + seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rotated_piece_stored_into_a_cat_of_norms_takes_its_rope(dtype):
    """The cat of the text and the image norms, the image rows stored rotated: read as the cat of the
    text norm and the image norm's RoPE, which is one qk_norm_rope call; every site proved."""
    g = torch.Generator().manual_seed(0)
    text, image = torch.randn(2, TEXT, 16, generator=g).to(dtype), torch.randn(2, 5, 16, generator=g).to(dtype)
    angles = torch.randn(5, 4, generator=g).repeat_interleave(2, -1)
    args = (text, image, angles.cos(), angles.sin())
    model = _JointStore().to(dtype)
    ref, out, rep = eager_and_optimized(model, *args)
    ops = {s.fqn.rsplit(".", 1)[-1]: s.op for s in rep.sites}
    assert ops == {"q": "qk_norm_rope", "k": "qk_norm_rope", "added_q": "norm", "added_k": "norm"}, rep
    assert torch.equal(out, ref)
    if dtype == torch.float32:
        res = normfuse.check(model, *args, backward=False)
        assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"] * 4, res


def test_a_cat_read_before_its_store_keeps_its_rope():
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(2, TEXT, 16, generator=g), torch.randn(2, 5, 16, generator=g),
            *(f(torch.randn(5, 8, generator=g)) for f in (torch.cos, torch.sin)))
    model = _JointStore(leak=True)
    ref, out, rep = eager_and_optimized(model, *args)
    by_name = {s.fqn.rsplit(".", 1)[-1]: s for s in rep.sites}
    assert by_name["q"].op == "norm" and by_name["q"].rope_reason, rep  # read before the store: kept
    assert by_name["k"].op == "qk_norm_rope", rep
    assert torch.equal(out, ref)


@pytest.mark.zoo
@pytest.mark.parametrize("name", ["hunyuan_video", "hunyuan_video_i2v", "hunyuan_image"])
def test_hunyuan_single_stream_rope_is_fused_and_proved(name):
    """HunyuanVideo's single-stream RoPE of the image tokens (``cat([rope(q[:, :-T]), q[:, -T:]])``):
    every q/k norm with a RoPE after it fused with it, every site proved, the output equal to eager."""
    from tests.zoo.diffusion import build

    model, kwargs = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(model, **kwargs, backward=False)
    assert res.ok and [s.symbolic.status for s in res.sites] == ["proved"] * len(res.sites), res
    singles = [s for s in res.report.sites if s.fqn.startswith("single_transformer_blocks")
               and s.fqn.rsplit(".", 1)[-1] in ("norm_q", "norm_k")]
    assert len(singles) == 4 and sorted(s.op for s in singles) == ["norm", "norm", "qk_norm_rope", "qk_norm_rope"], \
        res.report


class _Variants(nn.Module):
    """Forms the split must leave alone or get right: ``kind`` "two_dims" (a LayerNorm over (heads,
    head_dim), refused as a norm, its head slice rotated), "mutated" (q's input changed in place after
    its norm, before the slice is read), "read_between" (the normalized q read between its slice and
    the store), "middle" (the rotated rows in the middle, rows kept on both sides)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.norm = nn.LayerNorm((2, 8), eps=1e-6) if kind == "two_dims" else nn.RMSNorm(8, eps=1e-6)

    def forward(self, x, cos, sin):
        q0 = x.unflatten(-1, (2, 8))
        q = self.norm(q0.transpose(1, 2) if self.kind in ("read_between", "middle") else q0)
        rot = _SlicedRope._rotate
        if self.kind == "two_dims":
            return torch.cat([rot(q[:, :, :1], cos[:1].expand(8, -1), sin[:1].expand(8, -1)), q[:, :, 1:]], 2)
        if self.kind == "mutated":
            q0.add_(1.0)
            return torch.cat([rot(q[:, :-TEXT], cos, sin), q[:, -TEXT:]], dim=1)
        if self.kind == "read_between":
            seen = q.sum()
            q[:, :, :-TEXT] = rot(q[:, :, :-TEXT], cos, sin, seq_dim=2)
            return q + seen
        q[:, :, 1:1 + 8 - TEXT] = rot(q[:, :, 1:1 + 8 - TEXT], cos, sin, seq_dim=2)  # "middle"
        return q


@pytest.mark.parametrize("kind", ["two_dims", "mutated", "read_between", "middle"])
def test_forms_the_split_leaves_or_keeps_right(kind):
    model = _Variants(kind)
    x, cos, sin = _inputs()
    with torch.no_grad():
        ref = model(x.clone(), cos, sin)
        optimized = normfuse.optimize(copy.deepcopy(model))
        out = optimized(x.clone(), cos, sin)
    rep = normfuse.report(optimized)
    assert torch.equal(out, ref)
    if kind == "mutated":  # the norm of each slice computed where the norm was, before the change
        assert sorted(s.op for s in rep.sites) == ["norm", "qk_norm_rope"], rep
    elif kind == "two_dims":  # a norm the op does not compute is left whole, with its reason
        assert len(rep.sites) == 1 and not rep.sites[0].fused and "2 trailing dims" in rep.sites[0].reason, rep
    else:  # not split: one norm, its RoPE kept with a reason
        assert len(rep.sites) == 1 and rep.sites[0].op == "norm" and rep.sites[0].rope_reason, rep


def test_a_wrong_split_fails_the_check(monkeypatch):
    """The checker replays the pass's split, so a site is held to the split graph; a split that
    takes the wrong rows is caught by the model's outputs (here: every slice one row late)."""
    from normfuse.passes import norm_over_slices

    bounds = norm_over_slices._bounds
    monkeypatch.setattr(norm_over_slices, "_bounds", lambda piece, total: tuple(
        min(v + 1, total) for v in bounds(piece, total)))
    model = _SlicedRope()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(model, *_inputs(), backward=False)
    assert not res.ok and any(not o.passed for o in res.outputs), res


def test_a_split_whose_rope_would_stay_is_not_made():
    """fp64 tables (a RoPE the kernels do not compute): the split is tried on a copy, the rotated
    slice's RoPE would stay, so the norm stays one norm (one call, no cat), with the reason."""
    model = _SlicedRope()
    x, cos, sin = _inputs()
    cos, sin = cos.double(), sin.double()
    ref, out, rep = eager_and_optimized(model, x, cos, sin)
    assert [s.fqn for s in rep.sites] == ["norm_q", "norm_k"] and all(s.op == "norm" for s in rep.sites), rep
    assert all(s.rope_reason for s in rep.sites), rep
    assert torch.equal(out, ref)


@pytest.mark.parametrize("variant", FORMS[:3], ids=lambda v: "-".join(v.values()))
def test_exported_graphs_keep_the_norm_whole_with_the_reason(variant):
    """torch.export's ATen graphs spell the slices aten.slice (and the store aten.copy_): the split
    is not made there; the norms are fused alone, each with its reason, the output the same bits."""
    model = _SlicedRope(**variant).eval()
    args = tuple(_inputs())
    gm = torch.export.export(model, args).module()
    with torch.no_grad():
        ref = gm(*args)
        gm, rep = normfuse.fuse_graph(gm)
        out = gm(*args)
    assert [s.op for s in rep.sites] == ["norm", "norm"], rep
    assert all(s.rope_reason.startswith("a RoPE follows this q/k norm on a slice of the tokens") for s in rep.sites)
    assert torch.equal(out, ref)


# ---- segments: a norm over a cat of the segments' sums, its output sliced at the same rows -----------

class _Segments(nn.Module):
    """HunyuanVideo I2V's token replace: the first ``first`` tokens (a frame) gated and modulated with
    their own set, the others with the block's; the two gated adds joined by a cat the norm reads, its
    output sliced at row ``cut`` (default: the same row) and each slice modulated."""

    def __init__(self, dim=16, first=3, cut=None):
        super().__init__()
        self.first, self.cut = first, cut if cut is not None else first
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, h, attn, emb):
        gate0, gate1, scale0, scale1, shift0, shift1 = (c[:, None] for c in emb.chunk(6, dim=-1))
        t, cut = self.first, self.cut
        zero = h[:, :t] + attn[:, :t] * gate0
        orig = h[:, t:] + attn[:, t:] * gate1
        h = torch.cat([zero, orig], dim=1)
        n = self.norm(h)
        return h, torch.cat([n[:, :cut] * (1 + scale0) + shift0, n[:, cut:] * (1 + scale1) + shift1], dim=1)


def _segment_inputs(dtype=torch.float32, dim=16):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(2, 8, dim, generator=g).to(dtype), torch.randn(2, 8, dim, generator=g).to(dtype),
            (torch.randn(2, 6 * dim, generator=g) * 0.5).to(dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_segment_s_norm_takes_its_add_gate_and_modulation(dtype):
    ref, out, rep = eager_and_optimized(_Segments().to(dtype), *_segment_inputs(dtype))
    assert [s.op for s in rep.sites] == ["add_norm", "add_norm"], rep
    assert all(s.fused_modulation and s.fused_gated_residual for s in rep.sites), rep
    assert len({s.call for s in rep.sites}) == 2
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_slices_off_the_segments_still_take_their_modulation():
    """Sliced at another row than the cat's: the slices' norms read rows of the cat (no add to take),
    each takes its modulation; the same bits."""
    ref, out, rep = eager_and_optimized(_Segments(cut=5), *_segment_inputs())
    assert [s.op for s in rep.sites] == ["norm", "norm"] and all(s.fused_modulation for s in rep.sites), rep
    assert all(torch.equal(a, b) for a, b in zip(out, ref))


def test_the_segments_are_proved_and_their_gradients_hold():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(_Segments(), *_segment_inputs())
    assert res.ok, res
    assert [s.symbolic.status for s in res.sites] == ["proved"] * 2, res.sites


def test_a_wrong_segment_fails_the_check(monkeypatch):
    """Two segments of 4 rows: a split that reads the other segment for each slice is caught."""
    from normfuse.passes import norm_over_slices

    found = norm_over_slices._piece_of_cat

    def swapped(x, dim, rows, until):
        piece = found(x, dim, rows, until)
        if piece is None:
            return None
        pieces = list(norm_over_slices.canonical(x)["tensors"])
        return pieces[1 - pieces.index(piece)] if piece in pieces else piece
    monkeypatch.setattr(norm_over_slices, "_piece_of_cat", swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = normfuse.check(_Segments(first=4), *_segment_inputs(), backward=False)
    assert not res.ok and any(not o.passed for o in res.outputs), res


class _SegmentsWritten(nn.Module):
    """The segments' form with an in-place write the split must not step around: ``form`` "piece" (the
    first segment's sum written through a view after the cat copied it), "slice" (two overlapping slices
    of the norm's output, one written in place: the other sees it), or "add" (no cat: the norm takes
    its add whole; one slice modulated, the other not: split, neither slice could take the add)."""

    def __init__(self, form, dim=16, first=3):
        super().__init__()
        self.form, self.first = form, first
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, h, attn, emb):
        gate0, gate1, scale0, scale1, shift0, shift1 = (c[:, None] for c in emb.chunk(6, dim=-1))
        t = self.first
        if self.form == "add":
            h = h + attn
            n = self.norm(h)
            return h, n[:, :t] * (1 + scale0) + shift0, n[:, t:].sum(-1)
        zero = h[:, :t] + attn[:, :t] * gate0
        h = torch.cat([zero, h[:, t:] + attn[:, t:] * gate1], dim=1)
        if self.form == "piece":
            zero.view(-1).add_(1.0)
        n = self.norm(h)
        first, rest = n[:, :t + 2], n[:, t:]
        if self.form == "slice":
            first.mul_(2.0)
        return h, torch.cat([first[:, :t] * (1 + scale0) + shift0, rest * (1 + scale1) + shift1], dim=1)


@pytest.mark.parametrize("form", ["piece", "slice", "add"])
def test_a_split_that_would_change_a_value_or_lose_the_add_is_not_made(form):
    """The same bits as eager in each form: a piece written after its cat is not read in the cat's
    place (the slice of the cat is read), slices written in place keep the norm whole, and a norm whose
    slices could not take its add keeps its add_norm call."""
    ref, out, rep = eager_and_optimized(_SegmentsWritten(form), *_segment_inputs())
    assert all(torch.equal(a, b) for a, b in zip(out, ref))
    if form == "piece":
        assert [s.op for s in rep.sites] == ["norm", "norm"] and not any(s.fused_add for s in rep.sites), rep
    else:
        assert len(rep.sites) == 1 and not rep.sites[0].fused_modulation, rep
        assert rep.sites[0].op == ("add_norm" if form == "add" else "norm"), rep


class _OneRotatedSlice(_SlicedRope):
    """Only the rotated rows read (the text rows dropped): one row slice of the q/k norms' outputs."""

    def forward(self, x, cos, sin):
        q, k = (t.unflatten(-1, (self.heads, self.dim)) for t in (x, 2 * x))
        q, k = self.norm_q(q), self.norm_k(k)
        return self._rotate(q[:, :-TEXT], cos, sin) * self._rotate(k[:, :-TEXT], cos, sin)


def test_one_rotated_slice_takes_its_rope():
    ref, out, rep = eager_and_optimized(_OneRotatedSlice(), *_inputs())
    assert [s.op for s in rep.sites] == ["qk_norm_rope", "qk_norm_rope"], rep
    assert torch.equal(out, ref)



class _FinalNormOfTheStreams(nn.Module):
    """ConsisID's last norm: the text and image streams' sums joined by a cat, normalized,
    and the image rows kept (``norm_final(cat([text, image]))[:, T:]``)."""

    def __init__(self, dim=16):
        super().__init__()
        self.ff, self.ff_text = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.norm_final = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, h, text):
        h, text = h + self.ff(h), text + self.ff_text(text)
        return self.norm_final(torch.cat([text, h], dim=1))[:, text.shape[1]:]


def test_a_norm_of_streams_read_through_one_slice_stays_whole():
    """Normalizing the image piece alone would take its add, but the text stream's parameters would get no
    gradient where eager gives them zeros (an optimizer's weight decay, DDP's unused-parameter check see
    the difference): the norm stays whole, fused without the adds (its input is a cat, not an add)."""
    g = torch.Generator().manual_seed(5)
    h, text = torch.randn(2, 8, 16, generator=g), torch.randn(2, 3, 16, generator=g)
    model = _FinalNormOfTheStreams()
    ref, out, rep = eager_and_optimized(model, h, text)
    site = rep.sites[0]
    assert site.op == "norm" and not site.fused_add, rep
    assert torch.equal(out, ref)
    optimized = normfuse.optimize(copy.deepcopy(model))
    optimized(h, text).sum().backward()
    model(h, text).sum().backward()
    assert all((p.grad is None) == (q.grad is None) for p, q in zip(model.parameters(), optimized.parameters()))
