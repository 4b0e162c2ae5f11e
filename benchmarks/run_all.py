"""``make bench``: benchmarks 1-4 on this machine, then one summary.

Each runs in its own process (the static report needs Triton without its interpreter;
dynamo state does not leak between them) and writes under ``benchmarks/results/``. The GPU
suite (5) runs with ``python benchmarks/bench_gpu.py`` on a machine with CUDA.

    python benchmarks/run_all.py [--toy] [--only pass_cost memory cpu_e2e static_kernels residual_dtype checkpoint]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from common import HERE, parse_args

SCRIPTS = {  # name -> (script, its JSON)
    "static_kernels": ("bench_static_kernels.py", "static_kernels.json"),
    "pass_cost": ("bench_pass_cost.py", "pass_cost.json"),
    "memory": ("bench_memory.py", "memory.json"),
    "cpu_e2e": ("bench_cpu_e2e.py", "cpu_e2e.json"),
    "residual_dtype": ("bench_residual_dtype.py", "residual_dtype.json"),
    "checkpoint": ("bench_checkpoint.py", "checkpoint.json"),
}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv, lambda p: p.add_argument(
        "--only", nargs="+", choices=list(SCRIPTS), default=list(SCRIPTS)))
    failed = []
    for name in args.only:
        script, _ = SCRIPTS[name]
        cmd = [sys.executable, str(HERE / script), "--out", str(args.out)] + (["--toy"] if args.toy else [])
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print("\n== summary (verdicts; details in the JSON files)")
    for name in args.only:
        path = args.out / SCRIPTS[name][1]
        if path.exists():
            verdict = json.loads(path.read_text()).get("verdict", {})
            print(f"{name:15s}", {k: v for k, v in verdict.items() if k != "problems"})
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
