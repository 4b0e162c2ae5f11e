"""Plant small semantic faults in normfuse/kernels/reference.py and count the kernel tests that fail.

The kernel tests hold the ops to an fp64 statement of the rule written apart from reference.py
(tests/kernel_cases.py: rule64), so a fault in reference.py, the one statement of the semantics
the CPU path runs, must fail a large share of the cases it touches. Each fault is planted in a
temporary copy of the package and tests (the checkout is never edited) and the tests run there:

    .venv/bin/python scripts/plant_faults.py                       # test_kernels.py, reference path
    .venv/bin/python scripts/plant_faults.py --tests tests/test_kernels.py --select ""  # both paths
    .venv/bin/python scripts/plant_faults.py --kernel-cases-at 695ed0b   # the checks before rule64

Prints, per fault, the failed cases out of the cases of the norm kind it touches, and out of the
cases whose mode runs the faulty step (e.g. only round-first cases round n before the weight).
The eager fast paths of ``_normalize`` (torch.native_layer_norm, aten._fused_rms_norm: eager's own
kernels, same semantics) are switched off with every statistic fault, so that the fault is in the
statistic wherever reference.py computes one; the control "fast paths off" shows that switching
them off alone fails nothing. ``--faults triton-llama-rounding-dropped`` plants a fault in the
Triton kernels instead (their tests run under the interpreter). Exit status 1 when a fault fails
less than --min-share of the cases it touches, or a control fails any.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "normfuse/kernels/reference.py"

FAST_OFF = ("               fast: bool = True):", "               fast: bool = False):")


# Cases a fault cannot change: no rows; a LayerNorm of one column (variance 0 either way); a sum
# rounded to fp32 (16-bit + 16-bit is exact there; "-res": a residual of another 16-bit dtype
# promotes the sum to fp32); fp32 activations rounded to fp32 (Llama's n).
NOT_EMPTY = r"^(?!.*-N\d+x0-)"
NOT_ONE_COLUMN = r"(?!.*-N1x)"


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    what: str
    edits: tuple          # (old, new) text replacements in reference.py, each old found exactly once
    kind: str | None      # the norm kind whose cases it touches (None: both)
    touches: str          # regex over the case id: the cases whose mode runs the faulty step
    file: str = REFERENCE  # the file it is planted in
    select: str | None = None  # pytest -k for its tests (None: --select)


FAULTS = [
    Fault("control", "nothing changed", (), None, r"."),
    Fault("fast-paths-off", "eager's fused kernels not used (same semantics: must fail nothing)",
          (FAST_OFF,), None, r"."),
    Fault("rms-statistic-0.1%", "RMSNorm's mean of squares 0.1% too large",
          (FAST_OFF, ("rstd = torch.rsqrt(uf.square().mean(-1, keepdim=True) + eps)",
                      "rstd = torch.rsqrt(uf.square().mean(-1, keepdim=True) * 1.001 + eps)")),
          "rms_norm", NOT_EMPTY),
    Fault("ln-variance-0.1%", "LayerNorm's variance 0.1% too large",
          (FAST_OFF, ("        rstd = torch.rsqrt(var + eps)\n        n = (uf - mean) * rstd",
                      "        rstd = torch.rsqrt(var * 1.001 + eps)\n        n = (uf - mean) * rstd")),
          "layer_norm", NOT_EMPTY + NOT_ONE_COLUMN),
    Fault("ln-variance-unbiased", "LayerNorm's variance with Bessel's correction (divides by N - 1)",
          (FAST_OFF, ("var, mean = torch.var_mean(uf, dim=-1, correction=0, keepdim=True)",
                      "var, mean = torch.var_mean(uf, dim=-1, correction=1, keepdim=True)")),
          "layer_norm", NOT_EMPTY),   # one column: 0 / 0
    # the norm reads the sum before it is rounded to sum_dtype (only a 16-bit sum rounds)
    Fault("sum-rounding-dropped", "the norm normalizes the unrounded sum instead of s = round(sum_dtype, x + r)",
          (("        s = pre_sum(branch(x, x1, rowscale, keep, dropout_p), residual, residual_scale, sum_dtype)\n"
            "        return s, s",
            "        s = pre_sum(branch(x, x1, rowscale, keep, dropout_p), residual, residual_scale, sum_dtype)\n"
            "        return s, unrounded_sum(branch(x, x1, rowscale, keep, dropout_p, acc_dtype(sum_dtype)), residual,\n"
            "                                residual_scale, sum_dtype)"),),
          None, NOT_EMPTY + r"^add_norm-.*-(bfloat16|float16)-w(?!.*-(nores|sumfloat32|res))"),
    Fault("llama-rounding-dropped", "round-then-multiply: n not rounded to the activation dtype before the weight",
          (("        n = n.to(norm_round_dtype).to(acc)\n", "        pass\n"),),
          None, NOT_EMPTY + r"^(?!.*-float32-w).*roundfirst"),
    # the same fault in the Triton kernels, run by test_kernels.py's Triton path (interpreter)
    Fault("triton-llama-rounding-dropped", "the Triton forward kernel does not round n before the weight",
          (("            n = _round(n, NORM_ROUND_DTYPE).to(tl.float32)\n", "            n = n\n"),),
          None, NOT_EMPTY + r"^(?!.*-float32-w).*roundfirst", file="normfuse/kernels/triton.py",
          select="triton_path and roundfirst"),
]


def plant(tmp: Path, fault: Fault) -> None:
    path = tmp / fault.file
    text = (ROOT / fault.file).read_text()
    for old, new in fault.edits:
        count = text.count(old)
        if count != 1:
            sys.exit(f"{fault.name}: the text to replace occurs {count} times in {fault.file} "
                     f"(it changed; update this script):\n{old}")
        text = text.replace(old, new)
    path.write_text(text)


def run_tests(tmp: Path, tests: list[str], select: str, junit: Path) -> dict[str, str]:
    """{case id: "passed" | "failed" | "skipped"} of one pytest run in the copy."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
           f"--junitxml={junit}", *tests]
    if select:
        cmd += ["-k", select]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    subprocess.run(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        state = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        results[case.get("name")] = state
    return results


def case_id(name: str) -> str:
    """The Case's str from a test name: test_reference_path[add_norm-rms_norm-...] -> add_norm-rms_norm-..."""
    match = re.search(r"\[(.*)\]$", name)
    return match.group(1) if match else name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", nargs="+", default=["tests/test_kernels.py"])
    parser.add_argument("--select", default="reference_path", help="pytest -k expression ('' for all)")
    parser.add_argument("--faults", nargs="*", default=[f.name for f in FAULTS if f.file == REFERENCE],
                        help="by name; default: those of reference.py (also: " +
                             ", ".join(f.name for f in FAULTS if f.file != REFERENCE) + ")")
    parser.add_argument("--kernel-cases-at", metavar="REV",
                        help="run with tests/kernel_cases.py as it was at git revision REV (the numbers before)")
    parser.add_argument("--all-cases", action="store_true",
                        help="count every test run (tests whose ids do not name a Case of test_kernels.py)")
    parser.add_argument("--verbose", action="store_true", help="name the touched cases that still pass")
    parser.add_argument("--min-share", type=float, default=0.5,
                        help="a fault must fail at least this share of the cases it touches")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="normfuse-faults-") as name:
        tmp = Path(name)
        for part in ("normfuse", "tests"):
            shutil.copytree(ROOT / part, tmp / part, ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tmp / "pyproject.toml")
        if args.kernel_cases_at:
            old = subprocess.run(["git", "show", f"{args.kernel_cases_at}:tests/kernel_cases.py"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout
            (tmp / "tests" / "kernel_cases.py").write_text(old)
        where = subprocess.run([sys.executable, "-c", "import normfuse; print(normfuse.__file__)"], cwd=tmp,
                               capture_output=True, text=True, check=True).stdout.strip()
        if not where.startswith(str(tmp)):
            sys.exit(f"the copy's normfuse is not the one imported there ({where}); cannot plant faults")
        print(f"{'fault':24} {'kind':10} {'failed/cases of kind':>21} {'failed/cases touched':>21}  what")
        for fault in FAULTS:
            if fault.name not in args.faults:
                continue
            plant(tmp, fault)
            select = args.select if fault.select is None else fault.select
            results = run_tests(tmp, args.tests, select, tmp / f"{fault.name}.xml")
            ids = {test: case_id(test) for test in results if results[test] != "skipped"}
            of_kind = [t for t, c in ids.items() if args.all_cases or fault.kind is None or f"-{fault.kind}-" in c]
            touched = [t for t in of_kind if args.all_cases or re.search(fault.touches, ids[t])]
            failed_kind = sum(results[t] == "failed" for t in of_kind)
            failed_touched = sum(results[t] == "failed" for t in touched)
            print(f"{fault.name:24} {fault.kind or 'both':10} {failed_kind:>10}/{len(of_kind):<10} "
                  f"{failed_touched:>10}/{len(touched):<10}  {fault.what}", flush=True)
            if args.verbose:
                for test in touched:
                    if results[test] != "failed":
                        print(f"    passed: {test}")
            if fault.edits and fault.name != "fast-paths-off":
                ok &= failed_touched >= args.min_share * max(1, len(touched))
            elif failed_kind:
                print(f"  {fault.name} must fail nothing: " + ", ".join(t for t in of_kind if results[t] == "failed"))
                ok = False
            (tmp / fault.file).write_text((ROOT / fault.file).read_text())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
