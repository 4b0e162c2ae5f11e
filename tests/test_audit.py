"""normfuse audit: the CLI on HF configs (meta device), factory targets, bad targets, the byte arithmetic."""

import json
import re
import textwrap

import pytest
import torch
import torch.nn as nn

import normfuse
from normfuse.auditing import AuditReport, parse_bandwidth, verdict
from normfuse.cli import main
from normfuse.errors import InvalidOptionError, TargetError
from normfuse.reporting import SITE_FIELDS
from normfuse.targets import load_target, parse_overrides
from normfuse.zoo import ToyTransformer

pytest.importorskip("transformers")

# (sites, by_placement, fused with their add) the graph pass gives on 2-layer models
EXPECTED = {
    "bert": (5, {"embedding": 1, "post": 4}, 5, "Post-Norm"),
    "gpt2": (5, {"pre": 5}, 5, "Pre-Norm"),
    "llama": (5, {"standalone": 1, "pre": 4}, 4, "Pre-Norm"),
}


def _cli(*argv) -> int:
    torch._dynamo.reset()
    return main(["audit", *argv])


@pytest.fixture(scope="module")
def cli_json(tmp_path_factory):
    out = {}
    for model_type in EXPECTED:
        path = tmp_path_factory.mktemp("audit") / f"{model_type}.json"
        rc = _cli(f"hf:{model_type}", "--layers", "2", "--seq", "16", "--batch", "2", "--format", "json",
                  "--out", str(path))
        out[model_type] = (rc, json.loads(path.read_text()))
    return out


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_cli_json_counts(cli_json, model_type):
    rc, data = cli_json[model_type]
    n, placements, with_add, model_verdict = EXPECTED[model_type]
    assert rc == 0
    assert len(data["sites"]) == n
    for site in data["sites"]:
        assert set(SITE_FIELDS) <= set(site), set(SITE_FIELDS) - set(site)
        assert {"would_fuse", "status", "bytes_eager", "bytes_fused", "rows"} <= set(site)
        assert site["rows"] == 32  # batch 2 x seq 16
        assert site["source"] and re.search(r"\.py:\d+$", site["source"])
        assert site["fqn"]
    s = data["summary"]
    assert s["sites"] == n and s["by_placement"] == placements
    assert s["fused"] == n and s["fused_with_add"] == with_add
    assert s["verdict"] == model_verdict
    assert s["bandwidth"] == "H100 SXM 3.35 TB/s"
    b = s["bytes"]
    assert b["eager"]["fwd"] == sum(x["bytes_eager"]["fwd"] for x in data["sites"])
    assert b["fused"]["fwd"] <= b["eager"]["fwd"]
    assert b["eager"]["fwd_us"] == pytest.approx(b["eager"]["fwd"] / 3.35e12 * 1e6)


def test_llama_decomposed_rmsnorm_kernels_counted_from_graph(cli_json):
    sites = cli_json["llama"][1]["sites"]
    first = sites[0]  # layers.0.input_layernorm: upcast, pow, mean, +eps, rsqrt, mul, downcast, * weight
    assert first["fqn"] == "layers.0.input_layernorm" and first["form"] == "decomposed:llama"
    assert first["bytes_eager"]["fwd_kernels"] == 8 and first["bytes_fused"]["fwd_kernels"] == 1
    assert first["hidden_size"] == 4096  # the config's real default size, built on the meta device
    # the pre-norm sites add the residual add to those 8 kernels
    assert sites[1]["bytes_eager"]["fwd_kernels"] == 9 and sites[1]["status"] == "would fuse as add_norm"


def test_cli_html_and_svg(tmp_path, capsys):
    html_path, svg_path = tmp_path / "r.html", tmp_path / "s.svg"
    rc = _cli("hf:gpt2", "--layers", "2", "--seq", "8", "--format", "html", "--out", str(html_path),
              "--graph", str(svg_path))
    assert rc == 0
    page = html_path.read_text()
    assert page.startswith("<!DOCTYPE html>") and "<table id='sites'>" in page and "<svg" in page
    assert page.count("<tr class='fuse'>") == 5  # one row per site, all would fuse
    assert "h.1.ln_2" in page and "Pre-Norm" in page
    svg = svg_path.read_text()
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    markers = re.findall(r"<circle class='site'[^>]*data-placement='(\w+)' data-fused='(\d)'", svg)
    assert markers == [("pre", "1")] * 5
    assert svg.count("class='block'") == 3  # block 0, block 1, the final norm


def test_cli_table_default(capsys):
    assert _cli("hf:llama", "--layers", "1", "--seq", "8") == 0
    out = capsys.readouterr().out
    assert "layers.0.post_attention_layernorm" in out and "would fuse as add_norm" in out
    assert "verdict: Pre-Norm" in out and "H100 SXM 3.35 TB/s" in out


# --------------------------------------------------------------------------- factory targets

FACTORY = textwrap.dedent("""
    import torch
    from normfuse.zoo import ToyTransformer

    def post(depth=2):
        return ToyTransformer(depth=depth, placement="post", embed_norm=True)

    def with_args():
        model = ToyTransformer(depth=1, placement="pre")
        return model, (torch.randint(0, 64, (3, 5)),)

    def broken():
        raise RuntimeError("factory exploded: weights missing")
""")


@pytest.fixture
def factory_file(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    return path


def test_factory_target(factory_file, tmp_path):
    out = tmp_path / "post.json"
    assert _cli(f"{factory_file}:post", "--set", "depth=3", "--format", "json", "--out", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["summary"]["by_placement"] == {"embedding": 1, "post": 6}
    assert data["summary"]["verdict"] == "Post-Norm"
    assert "prenorm=True" in data["summary"]["conversion"]
    assert {s["dtype"] for s in data["sites"]} == {"torch.float32"}  # a factory's model keeps its dtype


def test_factory_with_example_args(factory_file):
    model, args, kwargs = load_target(f"{factory_file}:with_args")
    assert args[0].shape == (3, 5) and kwargs == {}
    torch._dynamo.reset()
    rep = normfuse.audit(model, *args)
    assert isinstance(rep, AuditReport)
    assert rep.summary()["by_placement"] == {"pre": 3} and rep.tokens == 15


def test_module_factory_target():
    model, args, _ = load_target("normfuse.zoo:ToyTransformer", overrides={"depth": 1}, device="meta")
    assert len(model.blocks) == 1 and next(model.parameters()).device.type == "meta"
    assert args[0].device.type == "meta"


# --------------------------------------------------------------------------- bad targets

@pytest.mark.parametrize("target, message", [
    ("hf:lama", r"unknown transformers model type 'lama'.*Closest known: llama"),
    ("hf:bert_typo", r"Closest known: bert"),
    ("no/such/file.py:build", r"no such file: 'no/such/file.py'"),
    ("/no/such/dir/config.json", r"no such file"),
    ("not_a_module_xyz:build", r"no module named 'not_a_module_xyz'"),
    ("normfuse.zoo:ToyTransformr", r"has no attribute 'ToyTransformr'.*Did you mean 'ToyTransformer'"),
    ("justtext", r"cannot read target 'justtext'"),
])
def test_bad_targets_exit_2(target, message, capsys):
    assert _cli(target) == 2
    assert re.search(message, capsys.readouterr().err)


def test_factory_that_raises_shows_its_error(factory_file, capsys):
    assert _cli(f"{factory_file}:broken") == 2
    err = capsys.readouterr().err
    assert "RuntimeError: factory exploded: weights missing" in err


def test_bad_options_exit_2(factory_file, capsys):
    assert _cli("hf:llama", "--set", "hiden_size=8") == 2
    assert "Did you mean 'hidden_size'" in capsys.readouterr().err
    assert _cli(f"{factory_file}:post", "--layers", "2") == 2
    assert "--set" in capsys.readouterr().err
    assert _cli("hf:llama", "--bandwidth", "fast") == 2
    assert "cannot read bandwidth" in capsys.readouterr().err


def test_load_target_errors_are_target_errors():
    with pytest.raises(TargetError, match="llama"):
        load_target("hf:llamma")
    with pytest.raises(TargetError, match="key=value"):
        parse_overrides(["hidden_size"])
    assert parse_overrides(["a=3", "b=false", "c=1e-5", "d=silu"]) == {"a": 3, "b": False, "c": 1e-5, "d": "silu"}


# --------------------------------------------------------------------------- the byte arithmetic, by hand

class _PreNormSite(nn.Module):
    """s = x + r; y = LayerNorm(s); s continues the stream (returned)."""

    def __init__(self, n):
        super().__init__()
        self.ln = nn.LayerNorm(n)

    def forward(self, x, r):
        s = x + r
        return self.ln(s), s


def test_byte_arithmetic_of_one_site_by_hand():
    R, N, B = 6 * 10, 96, 4  # rows, hidden, bytes per fp32 element
    x, r = torch.randn(6, 10, N), torch.randn(6, 10, N)
    torch._dynamo.reset()
    model = _PreNormSite(N)
    rep = normfuse.audit(model, x, r, bandwidth="1TB/s")
    (site,) = rep.sites
    assert site.site.placement == "pre" and site.status == "would fuse as add_norm" and site.rows == R
    T, P, stats = R * N * B, N * B, 2 * R * B  # one row-tensor, one parameter, layer-norm mean + rstd
    # eager forward: add reads x, r and writes s; F.layer_norm reads s, w, b, writes y and the stats
    assert site.eager.fwd == (2 * T + T) + (T + 2 * P + T + stats)
    assert site.eager.fwd_kernels == 2
    # eager backward: grads of s summed (read 2, write 1; s is read by the norm and returned);
    # layer-norm backward reads dy, s, stats, w and writes ds, dw, db
    assert site.eager.bwd == 3 * T + (2 * T + T + stats + 2 * 2 * P)
    # fused forward: read x, r, w, b; write y, s (still used), stats
    assert site.fused.fwd == 2 * T + 2 * P + T + T + stats
    # fused backward: read dy, ds, s, stats, w; write dx, dw, db (dresidual is dx: scale 1, same dtype)
    assert site.fused.bwd == T + 2 * T + stats + 2 * 2 * P + T
    assert site.fused.fwd_kernels == 1 and site.fused.bwd_kernels == 1
    totals = rep.summary()["bytes"]
    assert totals["eager"]["fwd_us"] == pytest.approx(site.eager.fwd / 1e12 * 1e6)
    assert totals["saved_fwd_bytes"] == site.eager.fwd - site.fused.fwd == T
    assert totals["saved_train_bytes"] == 3 * T


def test_post_norm_site_stores_the_sum_only_for_training():
    """norm(x + f) with nothing else reading the sum: an inference forward does not write s;
    when grads are needed the kernel stores s (one more write), and its backward reads it."""
    R, N, B = 4 * 8, 64, 4
    model = ToyTransformer(depth=1, hidden=N, placement="post")
    torch._dynamo.reset()
    rep = normfuse.audit(model, torch.randint(0, 64, (4, 8)))
    site = next(s for s in rep.sites if s.site.fqn == "blocks.0.norm2")
    assert site.site.placement == "post" and site.status == "would fuse as add_norm"
    T, P, stats = R * N * B, N * B, 2 * R * B
    assert site.eager.bwd == 2 * T + T + stats + 4 * P  # layer-norm backward; the add's is free
    assert site.fused.bwd == T + 2 * T + stats + 4 * P + T and site.fused.bwd_kernels == 1
    assert site.fused.fwd == 2 * T + 2 * P + T + stats  # s is not written


def test_audit_leaves_the_model_unchanged():
    model = ToyTransformer(depth=1, placement="sandwich", kind="rms_norm", spelling="gemma").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.forward
    torch._dynamo.reset()
    rep = normfuse.audit(model, torch.randint(0, 64, (2, 8)))
    assert rep.summary()["by_placement"] == {"sandwich": 2, "pre": 3}  # norm1, norm2, final norm
    assert model.training and model.forward == forward and not hasattr(model, "_normfuse_runs")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_unfused_site_costs_the_same_before_and_after():
    model = ToyTransformer(depth=1, placement="pre")
    torch._dynamo.reset()
    rep = normfuse.audit(model, torch.randint(0, 64, (2, 8)), config=normfuse.FuseConfig(
        filter_fn=lambda site: site.fqn != "blocks.0.norm2"))
    (left,) = [s for s in rep.sites if not s.would_fuse]
    assert left.status == "excluded by filter_fn" and left.site.fqn == "blocks.0.norm2"
    assert left.eager.to_dict() == left.fused.to_dict()


def test_bandwidth_and_verdict():
    assert parse_bandwidth(None) == ("H100 SXM 3.35 TB/s", 3.35e12)
    assert parse_bandwidth("h200")[1] == 4.8e12
    assert parse_bandwidth("900 GB/s")[1] == 9e11 and parse_bandwidth(2)[1] == 2e12
    with pytest.raises(InvalidOptionError, match="H100"):
        parse_bandwidth("H10O SXM")
    assert verdict(["pre", "post", "embedding"])[0] == "mixed"
    assert verdict(["sandwich", "standalone"])[0] == "Pre-Norm"
    assert verdict(["standalone"])[0] == "no residual norms"


def test_config_json_target(tmp_path):
    from normfuse.zoo import hf_config
    path = tmp_path / "config.json"
    path.write_text(hf_config("gpt2").to_json_string())
    out = tmp_path / "r.md"
    assert _cli(str(path), "--layers", "3", "--seq", "8", "--format", "markdown", "--out", str(out)) == 0
    text = out.read_text()
    assert text.startswith("# normfuse audit:") and "7 norm sites" in text and "h.2.ln_2" in text
    # batch 1 (the CLI default): the token + position embedding sum does not broadcast, so
    # h.0.ln_1 fuses with it too (at batch 2 the position embeddings broadcast and it does not)
    assert text.count("| would fuse as add_norm |") == 7
