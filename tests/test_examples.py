"""Every example runs as a user would run it (a fresh interpreter, from the repo root)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
# minutes-long runs: the stability experiment trains two 24-block models; the demo is `make demo`;
# the FSDP2 + TP example compiles two 2-process trainings
SLOW = {"prenorm_stability.py", "demo.py", "train_fsdp2_tp.py"}
# examples that write files into the checkout by default: (the arguments that send them into the
# test's folder, the files they write)
WRITES = {"prenorm_stability.py": (["--out", "."], ("prenorm_loss.png", "prenorm_grad_norms.png"))}


def test_every_example_is_listed():
    assert {"optimize_llama.py", "compile_backend.py", "audit_report.py", "check_equivalence.py",
            "prenorm_bert.py", "prenorm_stability.py", "demo.py"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in EXAMPLES])
def test_example_runs(name, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("NORMFUSE_TRITON_CPU", None)
    args, files = WRITES.get(name, ([], ()))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip(), "the example printed nothing"
    assert all((tmp_path / f).exists() for f in files), files
