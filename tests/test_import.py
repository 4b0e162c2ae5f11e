"""Public names resolve to what they document, whatever was imported before."""

import subprocess
import sys


def test_public_functions_are_not_shadowed_by_submodules():
    code = (
        "import normfuse, normfuse.cli, normfuse.auditing, normfuse.reporting, normfuse.verify.check\n"
        "normfuse.cli.build_parser()\n"
        "for name in ('audit', 'check', 'optimize', 'report', 'fuse_graph'):\n"
        "    obj = getattr(normfuse, name)\n"
        "    assert callable(obj) and obj.__class__.__name__ == 'function', (name, obj)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_importing_normfuse_declares_no_operator():
    # torchvision's operator namespace is declared (when its extension cannot load) only right
    # before normfuse itself imports transformers, never when a module of normfuse is imported
    code = (
        "import sys, torch\n"
        "import normfuse, normfuse.cli, normfuse.targets, normfuse.zoo, normfuse.auditing, normfuse.verify.check\n"
        "normfuse.cli.build_parser()\n"
        "assert not torch._C._jit_get_schemas_for_operator('torchvision::nms')\n"
        "assert 'torchvision' not in sys.modules and 'transformers' not in sys.modules\n"
        "print('ok')\n"
    )
    out = _run(code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


_LEAN = """
import sys
{imports}
from normfuse.kernels.library import SCHEMAS
for name in SCHEMAS:  # declared, so that saved programs calling them load
    assert torch._C._jit_get_schemas_for_operator(f"normfuse::{{name}}"), name
loaded = sorted(m for m in sys.modules if m.startswith("normfuse"))
assert loaded == ["normfuse", "normfuse.kernels", "normfuse.kernels.declarations", "normfuse.kernels.library"], loaded
assert "triton" not in sys.modules
import normfuse.kernels.norm_linear  # registers every implementation: each is checked against its declaration
print("ok")
"""


def test_import_is_lean_and_declares_the_ops():
    # normfuse first: no torch until the user imports it; the ops are declared right after it
    normfuse_first = ("import normfuse\nassert 'torch' not in sys.modules\nimport torch\n"
                      "assert 'normfuse' not in type(torch.__spec__.loader).__module__")  # torch keeps its loader
    for imports in (normfuse_first, "import torch\nimport normfuse"):
        out = _run(_LEAN.format(imports=imports))
        assert out.returncode == 0 and out.stdout.strip() == "ok", (imports, out.stderr[-3000:])


def test_cli_works_when_another_package_declared_the_torchvision_namespace():
    # another package declared torchvision's namespace (a DEF library) and one of its ops first:
    # normfuse declares only what is missing, as a fragment, and the CLI runs
    code = (
        "import sys, torch\n"
        "lib = torch.library.Library('torchvision', 'DEF')\n"
        "lib.define('nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor')\n"
        "from normfuse.cli import main\n"
        "sys.exit(main(['audit', 'hf:llama', '--layers', '1', '--seq', '16', '--format', 'json']))\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    assert '"sites"' in out.stdout


def test_pass_cache_key_covers_the_ops_the_graphs_call(tmp_path, monkeypatch):
    """Inductor's FX-graph cache keys rewritten graphs on uuid(): editing the kernels the
    rewritten graphs call must change it, as editing the pass does."""
    import shutil

    from normfuse.passes import pipeline

    files = pipeline.code_files()
    assert any("/kernels/" in f for f in files) and any("/passes/" in f for f in files)
    before = pipeline.NormFusionPass().uuid()
    edited = tmp_path / "ops.py"
    kernel = next(f for f in files if f.endswith("kernels/ops.py"))
    shutil.copy(kernel, edited)
    edited.write_text(edited.read_text() + "\n# edited\n")
    monkeypatch.setattr(pipeline, "code_files", lambda: tuple(str(edited) if f == kernel else f for f in files))
    assert pipeline.NormFusionPass().uuid() != before
