"""Deployment: what normfuse wrote loads and runs in a fresh process, and a compiled bound forward
is reported as its model's.

- ``torch.export.save`` of a fused program, then ``torch.export.load`` in a process that imported
  only normfuse (before or after torch): the ``torch.ops.normfuse`` ops are declared at import
  (normfuse/kernels/library.py), their implementations load on the first call.
- An AOTInductor package of the fused program, loaded with ``torch._inductor.aoti_load_package``
  (its C++ loader looks the ops' schemas up when the package loads).
- ``model.forward = torch.compile(model.forward, backend="normfuse")``, HF's form for static-cache
  generation: the frame is a decorator's ``(*args, **kwargs)``, the model ``args[0]``.
"""

import functools
import subprocess
import sys
import time

import pytest
import torch

import normfuse
from normfuse.tolerances import atol
from normfuse.zoo import ToyTransformer, hf_config

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _toy():
    torch.manual_seed(0)
    return ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", depth=2).eval()


def _fused_program():
    """export -> fuse_graph -> export: the program ``torch.export.save`` writes."""
    model = _toy()
    gm, report = normfuse.fuse_graph(torch.export.export(model, (IDS,)).module())
    assert report.counts()["fused"] == 5 and report.counts()["fused_with_add"] == 5
    program = torch.export.export(gm, (IDS,))
    assert any(str(node.target) == "normfuse.add_norm_fwd.default" for node in program.graph.nodes)
    return model, program


def _in_fresh_process(code: str, timeout: int = 300) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def _outputs_and_grads(module):
    y = module(IDS)
    y.float().square().sum().backward()
    return y.detach(), {name: p.grad for name, p in module.named_parameters()}


# what the loading process checks: importing normfuse and loading the program do not import the
# ops' implementations (torch.export.load imports triton itself); the first call does, and is
# differentiable
_LOAD = """
import sys
{imports}
program = torch.export.load({path!r})
assert "normfuse.kernels.ops" not in sys.modules, "loading imported the kernels"
module = program.module()
y = module(torch.load({ids!r}))
y.float().square().sum().backward()
torch.save({{"y": y.detach(), "grads": {{n: p.grad for n, p in module.named_parameters()}}}}, {out!r})
"""


@pytest.mark.parametrize("imports", ["import normfuse\nimport torch", "import torch\nimport normfuse"],
                         ids=["normfuse_first", "torch_first"])
def test_saved_program_loads_and_runs_after_import_normfuse(tmp_path, imports):
    _, program = _fused_program()
    torch.export.save(program, tmp_path / "fused.pt2")
    torch.save(IDS, tmp_path / "ids.pt")
    expected_y, expected_grads = _outputs_and_grads(program.module())

    _in_fresh_process(_LOAD.format(imports=imports, path=str(tmp_path / "fused.pt2"), ids=str(tmp_path / "ids.pt"),
                                   out=str(tmp_path / "out.pt")))
    loaded = torch.load(tmp_path / "out.pt")
    # the same reference kernels on the same inputs; another thread count may reorder a matmul's sums
    torch.testing.assert_close(loaded["y"], expected_y, rtol=0, atol=atol(torch.float32))
    assert loaded["grads"].keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(loaded["grads"][name], grad, rtol=0, atol=atol(torch.float32), msg=name)


def test_saved_program_exports_again_in_a_fresh_process(tmp_path):
    # tracing first: the ops' fakes load their implementations as their kernels do
    _, program = _fused_program()
    torch.export.save(program, tmp_path / "fused.pt2")
    code = (
        "import normfuse\n"
        "import torch\n"
        "ids = torch.randint(0, 64, (2, 8))\n"
        f"program = torch.export.export(torch.export.load({str(tmp_path / 'fused.pt2')!r}).module(), (ids,))\n"
        "calls = [str(n.target) for n in program.graph.nodes if str(n.target).startswith('normfuse.')]\n"
        "print(len(calls), set(calls))\n"
    )
    assert _in_fresh_process(code).strip() == "5 {'normfuse.add_norm_fwd.default'}"


def test_an_implementation_must_take_its_declared_call():
    from normfuse.kernels.library import implement

    def dropout_keep_mask(x: torch.Tensor, p: float) -> torch.Tensor:  # the flat arguments: refused
        return x

    with pytest.raises(TypeError, match="does not match the declaration of normfuse::dropout_keep_mask"):
        implement("dropout_keep_mask")(dropout_keep_mask)

    def keep_mask_of(call: "NormAddCall"):  # another op's call: refused
        return call.x

    with pytest.raises(TypeError, match=r"one argument, the op's call \(KeepMaskCall\)"):
        implement("dropout_keep_mask")(keep_mask_of)


@pytest.mark.slow  # compiling the package with the system C++ compiler: 72 s to 124 s here (2 shared cores)
def test_aoti_package_loads_and_runs_after_import_normfuse(tmp_path):
    model, program = _fused_program()
    start = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "fused_aoti.pt2"))
    compile_s = time.perf_counter() - start
    with torch.no_grad():
        expected = model(IDS)
        torch.save(IDS, tmp_path / "ids.pt")
    code = (
        "import sys\n"
        "import normfuse\n"
        "import torch\n"
        f"package = torch._inductor.aoti_load_package({path!r})\n"
        "assert 'normfuse.kernels.ops' not in sys.modules\n"
        f"torch.save(package(torch.load({str(tmp_path / 'ids.pt')!r})), {str(tmp_path / 'out.pt')!r})\n"
    )
    _in_fresh_process(code)
    loaded = torch.load(tmp_path / "out.pt")
    torch.testing.assert_close(loaded, expected, rtol=0, atol=atol(torch.float32),
                               msg=lambda m: f"{m} (compiled in {compile_s:.0f} s)")


# --------------------------------------------------------------------------- compiled bound forwards

def _through_args(forward):
    """A forward decorator as HF writes them (``can_return_tuple``): ``(*args, **kwargs)``."""
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class _DecoratedToy(ToyTransformer):
    forward = _through_args(ToyTransformer.forward)


def test_compiled_bound_forward_through_a_decorator_is_reported():
    torch.manual_seed(0)
    model = _DecoratedToy(placement="pre", kind="rms_norm", spelling="llama", depth=2).eval()
    with torch.no_grad():
        expected = model(IDS)
        model.forward = torch.compile(model.forward, backend="normfuse")
        got = model(IDS)
    torch.testing.assert_close(got, expected)
    report = normfuse.report(model)
    assert [s.fqn for s in report.sites] == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2",
                                             "final_norm"]
    assert all(s.fused for s in report.sites) and not report.uncaptured


def test_hf_static_cache_generate_with_a_compiled_forward_is_reported():
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    config = hf_config("llama")
    config.use_cache = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
        model.forward = torch.compile(model.forward, backend="normfuse")
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(tokens, expected)
    report = normfuse.report(model)
    norms = [f"model.layers.{i}.{name}" for i in range(2) for name in ("input_layernorm", "post_attention_layernorm")]
    norms.append("model.norm")
    assert report.graphs == 2  # prefill and decode
    assert [s.fqn for s in report.sites] == norms * 2
    assert all(s.fused for s in report.sites) and not report.uncaptured
