"""The one output spec (normfuse.kernels.specs) and add_norm's grouped options.

* Every op of library.SCHEMAS has its outputs named, as many as its schema returns; the
  argument names come from the schema and match the registered ops.
* The autograd formulas return one gradient per schema argument (a real backward through the
  eager path and through the custom op, fp32 CPU), each at its argument's place.
* Gate / Fp8Quant / Dropout give bit for bit what the flat keywords gave; the flat keywords still
  work, with a FutureWarning naming the grouped spelling; mixing the two spellings of a group
  raises; a bad value raises the error the flat keyword raised, word for word.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.fx

import normfuse
from normfuse.errors import InvalidOptionError, ShapeMismatchError, UnsupportedDtypeError
from normfuse.kernels import ops
from normfuse.kernels.add_norm import add_norm, fused_add_norm
from normfuse.kernels.library import SCHEMAS
from normfuse.kernels.specs import (GRADIENT_OF, NORM_ADD_OUTPUTS, OP_OUTPUTS, Dropout, Fp8Quant, Gate, api_index,
                                    api_outputs, bind, op_arguments, op_defaults, op_gradients, op_output_index)

E4M3 = torch.float8_e4m3fn
FP32 = torch.float32


def _tensors(rows=3, n=64, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    x, r, z, x1 = (torch.randn(rows, n, generator=gen).requires_grad_(grad) for _ in range(4))
    w, b, w1, b1 = (torch.randn(n, generator=gen).requires_grad_(grad) for _ in range(4))
    return dict(x=x, residual=r, gate=z, x1=x1, weight=w, bias=b, weight1=w1, bias1=b1)


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == E4M3 else a,
                                              b.view(torch.uint8) if b.dtype == E4M3 else b)


# ---- the output spec against the schemas -----------------------------------------------------

def _schema_returns(op: str) -> int:
    """The number of outputs the schema text declares ("-> (Tensor, Tensor)", "-> Tensor[]")."""
    returns = SCHEMAS[op][0].rsplit("->", 1)[1].strip()
    return len(returns.strip("()").split(",")) if returns.startswith("(") else 1


@pytest.mark.parametrize("op", list(SCHEMAS))
def test_every_op_names_as_many_outputs_as_its_schema_returns(op):
    assert op in OP_OUTPUTS, f"{op} is declared in library.SCHEMAS but its outputs are not named in specs.OP_OUTPUTS"
    assert len(OP_OUTPUTS[op]) == _schema_returns(op)
    assert len(set(OP_OUTPUTS[op])) == len(OP_OUTPUTS[op])


@pytest.mark.parametrize("op", list(SCHEMAS))
def test_argument_names_are_the_registered_ops(op):
    normfuse.kernels.library.declare()
    registered = getattr(torch.ops.normfuse, op).default._schema
    assert op_arguments(op) == tuple(a.name for a in registered.arguments)
    assert len(registered.returns) == len(OP_OUTPUTS[op])
    # the names in the schema's text, in order (the parser is not the only reader)
    text = SCHEMAS[op][0].rsplit("->", 1)[0]
    assert op_arguments(op) == tuple(re.findall(r"(\w+)(?:=[^,)]*)?\s*(?:,|\)\s*$)", text))


def test_known_layouts():
    assert OP_OUTPUTS["add_norm_fwd"] == ("y", "s", "mean", "rstd", "y1")
    assert OP_OUTPUTS["add_norm_quant_fwd"][:5] == OP_OUTPUTS["add_norm_fwd"]
    assert OP_OUTPUTS["norm_add_fwd"] == ("out", "y", "mean", "rstd")
    assert api_outputs() == ("y", "s")
    assert api_outputs(second_norm=True) == ("y", "y1", "s")
    assert api_outputs(quantized=True) == ("q", "scale", "y", "s")
    assert NORM_ADD_OUTPUTS == ("out", "y")
    assert api_index("s", second_norm=True) == 2 and api_index("scale", quantized=True) == 1
    assert op_output_index("add_norm_quant_fwd", "q") == 5
    # every backward output is the gradient of an argument of add_norm_fwd
    assert set(GRADIENT_OF) == set(OP_OUTPUTS["add_norm_bwd"])
    assert set(GRADIENT_OF.values()) <= set(op_arguments("add_norm_fwd"))
    # the arguments add_norm_quant_fwd begins with are add_norm_fwd's up to seed
    assert op_arguments("add_norm_quant_fwd")[:19] == op_arguments("add_norm_fwd")[:19]
    assert op_defaults("add_norm_fwd")["gate_position"] == "before" and op_defaults("add_norm_fwd")["x1"] is None
    with pytest.raises(InvalidOptionError, match="no output 'y1'"):
        api_index("y1", quantized=True)
    with pytest.raises(InvalidOptionError, match="no argument 'gate'"):
        op_gradients("add_norm_quant_fwd", {"gate": None})


def test_bind_fills_the_trailing_defaults():
    a = bind("add_norm_fwd", (1, None, None, None, "rms_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True))
    assert a["round_sum_first"] is True and a["gate"] is None and a["gate_activation"] == "silu"
    assert len(a) == len(op_arguments("add_norm_fwd"))
    with pytest.raises(InvalidOptionError, match="takes 12 to 33 arguments"):
        bind("add_norm_fwd", (1, None))


def test_api_outputs_are_what_add_norm_returns():
    t = _tensors()
    base = (t["x"], t["residual"], t["weight"], None)
    cases = [(False, False, {}), (True, False, dict(weight1=t["weight1"])), (False, True, dict(quant=Fp8Quant()))]
    for second_norm, quantized, options in cases:
        out = add_norm(*base, kind="rms_norm", eps=1e-6, return_norm=True, **options)
        names = api_outputs(second_norm, quantized)
        assert len(out) == len(names)
        assert out[api_index("s", second_norm, quantized)].shape == t["x"].shape
        if quantized:
            assert out[api_index("q", second_norm, quantized)].dtype == E4M3
            assert out[api_index("scale", second_norm, quantized)].shape == (3, 1)


# ---- the gradient tuples: one per schema argument ----------------------------------------------

def _call_add_norm_op(op, t, quant: bool):
    args = [t["x"], t["residual"], t["weight"], t["bias"], "layer_norm", 1e-5, 0.0, 1.0, FP32, None, FP32, True,
            True, t["x1"], None, t["weight1"], t["bias1"], 0.0, None]
    if quant:
        args += [True, E4M3, None, None, "amax/max", None, None, "div", 448.0, "scale"]
    return op(*args)


PATHS = {
    "eager": lambda name: ops._EAGER_FUNCTIONS[name].apply,
    "custom_op": lambda name: getattr(torch.ops.normfuse, name).default,
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("name", ["add_norm_fwd", "add_norm_quant_fwd"])
def test_add_norm_gradients_have_the_schema_argument_count(path, name):
    """A real backward runs (autograd refuses a tuple of the wrong length); the formula's tuple,
    asked again from the same node, has one entry per schema argument, each gradient at its
    argument's name."""
    t = _tensors(grad=True)
    out = _call_add_norm_op(PATHS[path](name), t, quant=name == "add_norm_quant_fwd")
    y, s, y1 = (out[op_output_index(name, k)] for k in ("y", "s", "y1"))
    dy, ds, dy1 = (torch.randn_like(v) for v in (y, s, y1))
    grads = torch.autograd.grad((y, s, y1), [t[k] for k in ("x", "residual", "weight", "bias", "x1", "weight1",
                                                            "bias1")], (dy, ds, dy1), retain_graph=True)
    backward = ops._add_norm_quant_backward if name == "add_norm_quant_fwd" else ops._add_norm_backward
    extra = (None, None) if name == "add_norm_quant_fwd" else ()
    returned = backward(y.grad_fn, dy, ds, None, None, dy1, *extra)
    assert len(returned) == len(op_arguments(name))
    by_name = dict(zip(op_arguments(name), returned))
    for arg, grad in zip(("x", "residual", "weight", "bias", "x1", "weight1", "bias1"), grads):
        assert torch.equal(by_name[arg], grad), arg
    assert all(v is None for k, v in by_name.items() if k not in ("x", "residual", "weight", "bias", "x1",
                                                                   "weight1", "bias1"))


@pytest.mark.parametrize("path", list(PATHS))
def test_norm_add_gradients_have_the_schema_argument_count(path):
    t = _tensors(grad=True)
    out, y, _, _ = PATHS[path]("norm_add_fwd")(t["x"], t["residual"], t["weight"], t["bias"], "rms_norm", 1e-6, 0.0,
                                                1.0, None, FP32, FP32, True)
    dout, dy = torch.randn_like(out), torch.randn_like(y)
    grads = torch.autograd.grad((out, y), [t[k] for k in ("x", "residual", "weight", "bias")], (dout, dy),
                                retain_graph=True, allow_unused=True)
    returned = ops._norm_add_backward(out.grad_fn, dout, dy, None, None)
    assert len(returned) == len(op_arguments("norm_add_fwd"))
    by_name = dict(zip(op_arguments("norm_add_fwd"), returned))
    for arg, grad in zip(("x", "residual", "weight", "bias"), grads):
        assert (by_name[arg] is None and grad is None) or torch.equal(by_name[arg], grad), arg


def test_gated_gradient_lands_on_the_gate_argument():
    t = _tensors(grad=True)
    y, s, _, _, _ = torch.ops.normfuse.add_norm_fwd(
        t["x"], t["residual"], t["weight"], None, "rms_norm", 1e-6, 0.0, 1.0, FP32, None, FP32, True, True, None,
        None, None, None, 0.0, None, t["gate"], "after", "sigmoid", None, None)
    dy = torch.randn_like(y)
    (dz,) = torch.autograd.grad(y, [t["gate"]], dy, retain_graph=True)
    returned = ops._add_norm_backward(y.grad_fn, dy, None, None, None, None)
    assert len(returned) == len(op_arguments("add_norm_fwd"))
    assert torch.equal(returned[op_arguments("add_norm_fwd").index("gate")], dz)


# ---- grouped and flat spellings: same bits ---------------------------------------------------------

def _flat_and_grouped():
    z, scale = _tensors()["gate"], torch.tensor([0.05])
    yield "gate", dict(gate=z, gate_position="after", gate_activation="sigmoid", gate_out_dtype=torch.bfloat16), \
        dict(gate=Gate(z, position="after", activation="sigmoid", out_dtype=torch.bfloat16))
    yield "gate_before_grouped", dict(gate=z, norm_group=16), dict(gate=Gate(z), norm_group=16)
    yield "quant_dynamic", dict(quant_dtype=E4M3, quant_group=32, quant_scale_form="max*(1/amax)", quant_apply="mul",
                                quant_scale_out="reciprocal", quant_amax_min=1e-12, quant_clamp=448.0), \
        dict(quant=Fp8Quant(E4M3, group=32, scale_form="max*(1/amax)", apply="mul", scale_out="reciprocal",
                            amax_min=1e-12, clamp=448.0))
    yield "quant_static", dict(quant_dtype=torch.float8_e5m2, quant_scale=scale), \
        dict(quant=Fp8Quant(torch.float8_e5m2, scale=scale))
    yield "dropout_seed", dict(dropout_p=0.3, seed=17), dict(dropout=Dropout(0.3, seed=17))
    yield "dropout_generator", dict(dropout_p=0.3, generator=torch.Generator().manual_seed(5)), \
        dict(dropout=Dropout(0.3, generator=torch.Generator().manual_seed(5)))


@pytest.mark.parametrize("name,flat,grouped", list(_flat_and_grouped()), ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("path", ("reference", "triton"))
def test_grouped_equals_flat_bit_for_bit(request, path, name, flat, grouped):
    if path == "triton":
        request.getfixturevalue("triton_cpu")
    t = _tensors(grad=True)
    runs = []
    for options in (flat, grouped):
        leaves = {k: v.detach().clone().requires_grad_() for k, v in t.items()}
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            out = normfuse.add_rms_norm(leaves["x"], leaves["residual"], leaves["weight"], return_norm=True,
                                        **options)
        assert [w.category for w in record] == ([FutureWarning] if options is flat else []), \
            [str(w.message) for w in record]
        y = out[api_index("y", quantized="quant" in name)]
        (y.float().square().sum() + out[-1].float().sin().sum()).backward()
        runs.append(list(out) + [leaves[k].grad for k in ("x", "residual", "weight")])
    for got, want in zip(*runs):
        assert _same(got, want)


def test_fused_add_norm_takes_the_flat_keywords_without_warning():
    t = _tensors()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, s = fused_add_norm(t["x"], t["residual"], t["weight"], None, kind="rms_norm", eps=1e-6, gate=t["gate"],
                              gate_position="after", dropout_p=0.2, seed=3)
    y2, s2 = add_norm(t["x"], t["residual"], t["weight"], None, kind="rms_norm", eps=1e-6,
                      gate=Gate(t["gate"], "after"), dropout=Dropout(0.2, seed=3))
    assert torch.equal(y, y2) and torch.equal(s, s2)


# ---- the deprecated flat keywords ------------------------------------------------------------------

@pytest.mark.parametrize("flat,message", [
    (dict(quant_dtype=E4M3), "add_norm(quant_dtype=...) is deprecated; pass quant=Fp8Quant(dtype=...)"),
    (dict(quant_dtype=E4M3, quant_group=32),
     "add_norm(quant_dtype=..., quant_group=...) is deprecated; pass quant=Fp8Quant(dtype=..., group=...)"),
    (dict(gate_position="after", gate="z"),
     "add_norm(gate=..., gate_position=...) is deprecated; pass gate=Gate(z=..., position=...)"),
    (dict(dropout_p=0.1, seed=4), "add_norm(dropout_p=..., seed=...) is deprecated; pass dropout=Dropout(p=..., "
                                  "seed=...)"),
])
def test_flat_keywords_warn_with_the_grouped_spelling(flat, message):
    t = _tensors()
    flat = {k: t["gate"] if v == "z" else v for k, v in flat.items()}
    with pytest.warns(FutureWarning) as record:
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], **flat)
    assert [str(w.message) for w in record] == [message]
    assert record[0].filename == __file__  # the caller's line, through the add_rms_norm shorthand


def test_flat_keywords_warn_once_per_call_site():
    t = _tensors()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("default")
        for _ in range(3):
            normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], dropout_p=0.1, seed=1)
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], dropout_p=0.1, seed=1)  # another line
    assert len(record) == 2 and all(w.category is FutureWarning for w in record)


def test_flat_keywords_off_values_mean_off():
    """quant_dtype=None, dropout_p=0 and gate=None turned the group off: still, with the warning."""
    t = _tensors()
    plain = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"])
    with pytest.warns(FutureWarning):
        off = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], quant_dtype=None, quant_group=32,
                                    dropout_p=0.0, gate=None, gate_position="after")
    assert len(off) == 2 and all(torch.equal(a, b) for a, b in zip(plain, off))


@pytest.mark.parametrize("options,words", [
    (lambda z: dict(gate=Gate(z), gate_position="after"), "gate=Gate(...) and the flat keyword(s) gate_position"),
    (lambda z: dict(quant=Fp8Quant(), quant_group=32), "pass them inside Fp8Quant(...) only"),
    (lambda z: dict(dropout=Dropout(0.1), seed=3), "dropout=Dropout(...) and the flat keyword(s) seed"),
])
def test_mixing_the_spellings_of_one_group_raises(options, words):
    t = _tensors()
    with pytest.raises(InvalidOptionError) as info:
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], **options(t["gate"]))
    assert words in str(info.value)


def test_other_groups_may_stay_flat_and_unknown_keywords_are_named():
    t = _tensors()
    with pytest.warns(FutureWarning, match="dropout_p"):
        y, s = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], gate=Gate(t["gate"]), dropout_p=0.1, seed=2)
    y2, s2 = normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], gate=Gate(t["gate"]),
                                   dropout=Dropout(0.1, seed=2))
    assert torch.equal(y, y2) and torch.equal(s, s2)
    with pytest.raises(InvalidOptionError, match="Did you mean 'quant_group'"):
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], quant_grup=32)
    with pytest.raises(InvalidOptionError, match="takes a normfuse.kernels.Fp8Quant"):
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], quant=E4M3)


# ---- bad values: the same error either way ---------------------------------------------------------

@pytest.mark.parametrize("flat,grouped,error", [
    (dict(gate_position="inside"), lambda z: dict(gate=Gate(z, position="inside")), InvalidOptionError),
    (dict(gate_activation="sigmiod"), lambda z: dict(gate=Gate(z, activation="sigmiod")), InvalidOptionError),
    (dict(gate_out_dtype=torch.int8), lambda z: dict(gate=Gate(z, out_dtype=torch.int8)), UnsupportedDtypeError),
    (dict(quant_dtype=torch.int8), lambda z: dict(quant=Fp8Quant(torch.int8)), UnsupportedDtypeError),
    (dict(quant_dtype=E4M3, quant_group=48), lambda z: dict(quant=Fp8Quant(group=48)), InvalidOptionError),
    (dict(quant_dtype=E4M3, quant_group=128), lambda z: dict(quant=Fp8Quant(group=128)), ShapeMismatchError),
    (dict(quant_dtype=E4M3, quant_scale=torch.tensor([1.0]), quant_amax_min=1e-12),
     lambda z: dict(quant=Fp8Quant(scale=torch.tensor([1.0]), amax_min=1e-12)), InvalidOptionError),
    (dict(quant_dtype=E4M3, quant_apply="multiply"), lambda z: dict(quant=Fp8Quant(apply="multiply")),
     InvalidOptionError),
    (dict(quant_dtype=E4M3, quant_clamp=-1.0), lambda z: dict(quant=Fp8Quant(clamp=-1.0)), InvalidOptionError),
    (dict(dropout_p=1.0), lambda z: dict(dropout=Dropout(1.0)), InvalidOptionError),
    (dict(dropout_p=0.1, seed=1, generator=torch.Generator()),
     lambda z: dict(dropout=Dropout(0.1, seed=1, generator=torch.Generator())), InvalidOptionError),
    (dict(dropout_p=0.1, seed=torch.tensor(1.5)), lambda z: dict(dropout=Dropout(0.1, seed=torch.tensor(1.5))),
     InvalidOptionError),
])
def test_bad_values_raise_the_same_error_either_way(flat, grouped, error):
    t = _tensors(n=96)
    args = (t["x"], t["residual"], t["weight"])
    if any(k.startswith("gate_") for k in flat):
        flat = dict(flat, gate=t["gate"])
    with pytest.raises(error) as flat_error, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        normfuse.add_rms_norm(*args, **flat)
    with pytest.raises(error) as grouped_error:
        normfuse.add_rms_norm(*args, **grouped(t["gate"]))
    assert str(flat_error.value) == str(grouped_error.value)


def test_gate_checks_against_x():
    t = _tensors()
    with pytest.raises(ShapeMismatchError, match="must have x's shape"):
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], gate=Gate(t["gate"][:, :8]))
    with pytest.raises(InvalidOptionError, match="gate must be a tensor"):
        normfuse.add_rms_norm(t["x"], t["residual"], t["weight"], gate=Gate(1.0))


# ---- torch.fx: the graphs carry the tensors, and graphs calling add_norm flat do not warn ------------

def test_fx_records_fused_add_norm_for_grouped_calls_and_add_norm_for_flat_ones():
    def grouped(x, r, w, z):
        return add_norm(x, r, w, None, kind="rms_norm", eps=1e-6, gate=Gate(z, "after"))[0]

    def flat(x, r, w, z):
        return add_norm(x, r, w, None, kind="rms_norm", eps=1e-6, gate=z, gate_position="after")[0]

    t = _tensors()
    args = (t["x"], t["residual"], t["weight"], t["gate"])
    expected = grouped(*args)
    for fn, target in ((grouped, fused_add_norm), (flat, add_norm)):
        gm = torch.fx.symbolic_trace(fn)
        calls = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (add_norm, fused_add_norm)]
        assert [n.target for n in calls] == [target]
        assert calls[0].kwargs["gate"].op == "placeholder" and calls[0].kwargs["gate_position"] == "after"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the graph's flat call is the rewrite's spelling: no warning
            assert torch.equal(gm(*args), expected)


def test_rewritten_graphs_call_fused_add_norm_and_neither_running_nor_checking_them_warns():
    """The rewrite spells its calls with the flat keywords of fused_add_norm (a graph cannot carry
    a Gate's tensor inside an object); the model's forward and the checker, which runs each
    call's target, raise no FutureWarning. User code calling add_norm flat does."""
    from tests.fp8_models import Fp8Llama, optimized_copy, token_ids
    model = Fp8Llama().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        optimized = optimized_copy(model)
        optimized(token_ids())
        targets = {n.target for gm in normfuse.report(optimized).graph_modules for n in gm.graph.nodes
                   if n.op == "call_function" and n.target in (add_norm, fused_add_norm)}
        assert targets == {fused_add_norm}
        result = normfuse.check(model, token_ids(), backward=False)
        assert result.ok, str(result)
    t = _tensors()
    with pytest.warns(FutureWarning, match="deprecated"):
        add_norm(t["x"], t["residual"], t["weight"], None, kind="rms_norm", eps=1e-6, dropout_p=0.1, seed=1)


@pytest.mark.parametrize("path", ["eager", "custom_op"])
def test_qk_norm_rope_gradients_have_the_schema_argument_count(path):
    """The QK-norm + RoPE autograd binds its inputs and returns its gradients by argument name."""
    from normfuse.kernels import qk_rope

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, h, 8, generator=g, requires_grad=True) for h in (4, 2))
    wq, wk = (torch.randn(8, generator=g, requires_grad=True) for _ in range(2))
    cos, sin = torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 4, 1, 8, generator=g)  # (1, S, 1, R)
    op = qk_rope._EAGER.apply if path == "eager" else torch.ops.normfuse.qk_norm_rope_fwd.default
    q_out, k_out, _, _ = op(q, k, wq, wk, cos, sin, 1e-6, 0.0, None, FP32, FP32, FP32, "neox", 8, False, True)
    dq_out, dk_out = torch.randn_like(q_out), torch.randn_like(k_out)
    grads = torch.autograd.grad((q_out, k_out), (q, k, wq, wk), (dq_out, dk_out), retain_graph=True)
    returned = qk_rope._backward(q_out.grad_fn, dq_out, dk_out, None, None)
    assert len(returned) == len(op_arguments("qk_norm_rope_fwd"))
    by_name = dict(zip(op_arguments("qk_norm_rope_fwd"), returned))
    # the same function differentiated by plain autograd through the reference's ops
    ref_out = qk_rope.qk_norm_rope_ref(q, k, wq, wk, cos, sin, eps=1e-6, transpose_out=True)
    want = torch.autograd.grad(ref_out, (q, k, wq, wk), (dq_out, dk_out))
    for arg, grad, ref in zip(("q", "k", "q_weight", "k_weight"), grads, want):
        assert torch.equal(by_name[arg], grad), arg
        torch.testing.assert_close(by_name[arg], ref, rtol=1e-5, atol=1e-5), arg
    assert all(v is None for name, v in by_name.items() if name not in ("q", "k", "q_weight", "k_weight"))
