"""Smoke test of the built wheel, as a user gets it.

    python scripts/wheel_smoke.py dist/normfuse-X-py3-none-any.whl torch==2.13.0 triton==3.8.0 ...

Makes a fresh venv in a temporary folder, installs the given requirements first (the pinned
torch CPU wheel, so pip never resolves `torch` against the index), then the wheel with its
runtime extra `[hf]` only (not editable, no dev tools), and runs the checks below with that
venv's Python from the temporary folder, so nothing is imported from the checkout. Exits
non-zero when a step fails. `make smoke` builds the wheel and runs this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

RUNTIME_EXTRAS = "hf"
DEV_ONLY = ("pytest", "hypothesis", "matplotlib")  # must not be needed by anything below

# A user's model file for the `file.py:factory` target: two Pre-Norm blocks and a final norm.
FACTORY_FILE = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.ff = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    def __init__(self, hidden=32, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build(depth=2):
    return Net(depth=depth), (torch.randn(2, 8, 32),)
'''


STARTED = time.perf_counter()
LABEL = "checks" if "--checks" in sys.argv else "smoke"   # the checks run in a process of their own


def _step(name):
    print(f"[{LABEL} {time.perf_counter() - STARTED:6.1f}s] {name}", flush=True)


def _run(cmd, **kwargs):
    """Run a command, echo it, and return its stdout; fail with its output when it fails."""
    print("  $", " ".join(str(c) for c in cmd), flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        sys.exit(f"FAILED ({out.returncode}): {' '.join(map(str, cmd))}\n{out.stdout}\n{out.stderr}")
    return out.stdout


def drive(wheel: str, first: list[str]) -> None:
    """Fresh venv, install, then run this file's checks in it from a temporary folder."""
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheel = os.path.abspath(wheel)
    with tempfile.TemporaryDirectory(prefix="normfuse-smoke-") as tmp:
        venv = os.path.join(tmp, "venv")
        py = os.path.join(venv, "bin", "python")
        start = time.perf_counter()
        _step(f"fresh venv in {venv}")
        _run([sys.executable, "-m", "venv", venv])
        if first:
            _run([py, "-m", "pip", "install", "-q", *first])
        _run([py, "-m", "pip", "install", "-q", f"{wheel}[{RUNTIME_EXTRAS}]"])
        installed = time.perf_counter()
        work = os.path.join(tmp, "work")
        os.makedirs(work)
        script = shutil.copy(os.path.abspath(__file__), work)
        _step("checks, from a folder outside the checkout")
        # the user's environment, minus anything pointing back at the checkout
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["PATH"] = os.path.join(venv, "bin") + os.pathsep + env.get("PATH", "")
        result = subprocess.run([py, script, "--checks", source], cwd=work, env=env)
        done = time.perf_counter()
        print(f"smoke: venv + install {installed - start:.1f}s, checks {done - installed:.1f}s, "
              f"total {done - start:.1f}s", flush=True)
        _step("removing the venv")
    if result.returncode != 0:
        sys.exit(f"smoke checks FAILED (exit {result.returncode})")
    print(f"smoke: wheel OK ({time.perf_counter() - start:.1f}s with the clean-up)")


def checks(source: str) -> None:
    """Run inside the fresh venv, with the current folder outside the checkout."""
    import importlib.metadata as metadata
    import importlib.util

    _step("the package is the installed wheel, complete, without dev tools")
    dist = metadata.distribution("normfuse")
    assert '"editable": true' not in (dist.read_text("direct_url.json") or ""), "an editable install"
    shipped = {str(f) for f in dist.files if str(f).startswith("normfuse/") and str(f).endswith(".py")}
    in_tree = {os.path.relpath(os.path.join(root, name), source)
               for root, _, names in os.walk(os.path.join(source, "normfuse")) for name in names if name.endswith(".py")}
    missing = sorted(in_tree - shipped)
    assert not missing, f"modules of the checkout missing from the wheel: {missing}"
    present = [name for name in DEV_ONLY if importlib.util.find_spec(name) is not None]
    assert not present, f"dev-only packages in the runtime venv: {present}"

    _step("backends registered by entry point, before any normfuse import")
    from torch._dynamo import list_backends
    assert "normfuse" not in sys.modules
    backends = set(list_backends(exclude_tags=()))
    assert {"normfuse", "normfuse_inductor"} <= backends, sorted(backends)

    import normfuse
    site_packages = os.path.dirname(os.path.dirname(normfuse.__file__))
    assert site_packages.startswith(sys.prefix) and not normfuse.__file__.startswith(source), normfuse.__file__
    assert normfuse.__version__ == dist.version, (normfuse.__version__, dist.version)

    _step("normfuse --version")
    out = _run(["normfuse", "--version"])
    assert out.strip() == f"normfuse {dist.version}", out

    _step("normfuse audit hf:llama --layers 2, with the picture of its residual stream")
    _run(["normfuse", "audit", "hf:llama", "--layers", "2", "--format", "json", "--out", "llama.json",
          "--graph", "llama.svg"])
    with open("llama.json", encoding="utf-8") as f:
        summary = json.load(f)["summary"]
    assert (summary["sites"], summary["fused"], summary["fused_with_add"]) == (5, 5, 4), summary
    with open("llama.svg", encoding="utf-8") as f:
        assert f.read().lstrip().startswith("<svg")

    _step("normfuse audit my_model.py:build --set depth=3")
    with open("my_model.py", "w", encoding="utf-8") as f:
        f.write(FACTORY_FILE)
    summary = json.loads(_run(["normfuse", "audit", "my_model.py:build", "--set", "depth=3",
                               "--format", "json"]))["summary"]
    # the first block's norm stands alone; each block's residual add feeds the next norm
    assert (summary["sites"], summary["fused_with_add"]) == (4, 3), summary

    import torch
    from normfuse.zoo import ToyTransformer

    torch.manual_seed(0)
    model = ToyTransformer(placement="pre", depth=2).eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        expected = model(ids)
    for backend in ("normfuse", "normfuse_inductor"):
        _step(f'torch.compile(model, backend="{backend}")')
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            got = compiled(ids)
        ops = [site.op for site in normfuse.report(compiled).fused]
        # each add with the norm after it: the token + position add (the table broadcast over the
        # batch), the residual adds (2 per block, the final norm's)
        assert ops == ["add_norm"] * 5, f"{backend}: fused {ops}"
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    _step("HTML audit report of a toy model")
    html = normfuse.audit(ToyTransformer(placement="post", depth=2), ids).to_html()
    assert html.lstrip().lower().startswith("<!doctype html") and "<svg" in html, html[:200]

    _step("normfuse.check on a toy model")
    result = normfuse.check(ToyTransformer(placement="post", depth=2), ids)
    assert result.ok, str(result)
    assert len(result.sites) > 0 and all(s.symbolic.status == "proved" for s in result.sites), str(result)
    _step("all checks passed")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--checks":
        checks(sys.argv[2])
    elif len(sys.argv) >= 2 and sys.argv[1].endswith(".whl"):
        drive(sys.argv[1], sys.argv[2:])
    else:
        sys.exit(__doc__)
