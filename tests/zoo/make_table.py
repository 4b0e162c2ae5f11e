"""Write tests/zoo/TABLE.md (the support table for the README) from tests/zoo/expected.py.

    python -m tests.zoo.make_table                 # rewrite TABLE.md from the expected table
    python -m tests.zoo.make_table --measure hf:bert timm:convnext_atto
                                                   # run models, print their entries for expected.py

Run from the repository root with the checkout on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ("encoder", "decoder", "moe", "hybrid", "encoder-decoder", "vision", "torch.nn", "x-transformers")


def _entry_text(name: str, got: dict) -> str:
    keys = ("norms", "fused", "fused_with_add", "input_is_add", "placements", "eager_norms", "eager_input_is_add",
            "check", "checked_sites", "bitwise", "gated", "fused_gate", "rope", "fused_rope")
    body = ", ".join(f"{k}={got[k]!r}" for k in keys if k in got)
    return f'    "{name}": dict({body}),'


def measure(names: list[str]) -> None:
    from .models import zoo_models
    from .run import measure as run_one

    models = zoo_models()
    for name in names or list(models):
        got = run_one(models[name])
        print(_entry_text(name, got))
        if got["unfused"] or got.get("check_detail"):
            print("    #", json.dumps({"unfused": got["unfused"], "check": got.get("check_detail")}))
        sys.stdout.flush()


def _cell(want: dict) -> str:
    add = f", {want['fused_with_add']} with add" if want["fused_with_add"] else ""
    add += f", {want['fused_rope']} with RoPE" if want.get("fused_rope") else ""
    eager = f" (eager count: {want['eager_norms']} norms)" if want["eager_norms"] != want["norms"] else ""
    return f"{want['fused']}/{want['norms']}{add}{eager}"


def table() -> str:
    from .expected import EXPECTED
    from .models import zoo_models

    groups = defaultdict(list)
    for name, model in zoo_models().items():
        groups[model.group].append(name)
    lines = ["<!-- written by `python -m tests.zoo.make_table` from tests/zoo/expected.py; do not edit -->", "",
             "| group | models | norm calls (eager count) | norm sites found | fused | fused with their add "
             "| fused with their RoPE | check ok |",
             "|---|---|---|---|---|---|---|---|"]
    for group in GROUPS:
        names = groups[group]
        rows = [EXPECTED[n] for n in names]
        lines.append(f"| {group} | {len(names)} | {sum(r['eager_norms'] for r in rows)} | {sum(r['norms'] for r in rows)} | {sum(r['fused'] for r in rows)} "
                     f"| {sum(r['fused_with_add'] for r in rows)} | {sum(r.get('fused_rope', 0) for r in rows)} "
                     f"| {sum(r['check'] == 'ok' for r in rows)} |")
    lines += ["", "Per model: fused/found norm sites, how many with their residual add, how many q/k norms with "
              "their rotary embedding, and the independent eager count where it differs; a ⚠ marks a finding "
              "explained in tests/zoo/expected.py.", ""]
    for group in GROUPS:
        cells = []
        for name in sorted(groups[group]):
            want = EXPECTED[name]
            cells.append(f"{name.split(':', 1)[1] if name.startswith('hf:') else name} {_cell(want)}"
                         + (" ⚠" if want.get("note") else ""))
        lines.append(f"- **{group}**: " + "; ".join(cells))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measure", nargs="*", metavar="NAME", help="run these models (all when none given)")
    args = parser.parse_args(argv)
    if args.measure is not None:
        measure(args.measure)
        return
    (HERE / "TABLE.md").write_text(table())
    print(f"wrote {HERE / 'TABLE.md'}")


if __name__ == "__main__":
    main()
