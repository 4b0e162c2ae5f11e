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
