"""Coverage: norm sites fused under the ways large models wrap their blocks (one process).

For each setting, with the residual pair carried across block boundaries (``cross_block``,
the default: into a checkpointed block only the sum goes, and the last block's pair to the
final norm), with pairs into checkpointed blocks too (``cross_checkpoints``) and without: the norm calls of one eager forward and how many of them read an
add (tests/zoo/count.py, which knows nothing of normfuse), the sites the pass found and
fused, and how many it fused with their add. Each optimized model's output is compared
with the unoptimized copy's (the largest absolute difference is in the table). FSDP2 and
tensor/sequence parallel need 2 processes: tests/test_fsdp2.py, tests/test_dtensor.py.

    python benchmarks/bench_wrapped.py [--toy]
"""

from __future__ import annotations

import copy
import warnings

from common import machine, markdown_table, parse_args, reset_dynamo, write_csv, write_json

import torch

import normfuse
from normfuse import zoo
from tests.loops import checkpointed_stack
from tests.zoo.count import count_eager


def _hf(family: str, layers: int):
    no_dropout = {"bert": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
                  "opt": {"dropout": 0.0, "attention_dropout": 0.0}}.get(family, {})
    model = zoo.hf_model(family, num_hidden_layers=layers, **no_dropout)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_enable's new name
        model.gradient_checkpointing_enable()
    return model, zoo.example_inputs(model)


def _stack(wrap: str, depth: int):
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return checkpointed_stack(wrap, depth=depth), {"ids": ids}


def _output(out) -> torch.Tensor:
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out


MODES = {"off": {"cross_block": False}, "default": {}, "cross_checkpoints": {"cross_checkpoints": True}}


def _row(setting: str, make, mode: str) -> dict:
    reset_dynamo()
    model, inputs = make()
    model.train()
    reference = copy.deepcopy(model)
    normfuse.optimize(model, **MODES[mode])
    out = _output(model(**inputs))
    out.float().square().mean().backward()
    diff = (out - _output(reference(**inputs))).abs().max().item()
    counts = normfuse.report(model).counts()
    eager = count_eager(reference, (), inputs)
    return {"setting": setting, "mode": mode, "norm_calls": eager.norms,
            "add_fed_calls": eager.input_is_add, "sites": counts["sites"], "fused": counts["fused"],
            "fused_with_add": counts["fused_with_add"], "max_abs_diff": diff}


def main(argv=None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    depth = 2 if args.toy else 4
    settings = [
        ("torch.utils.checkpoint(use_reentrant=False) in the loop", lambda: _stack("non_reentrant", depth)),
        ("torch.utils.checkpoint(use_reentrant=True) in the loop", lambda: _stack("reentrant", depth)),
        ("checkpoint_wrapper per block", lambda: _stack("checkpoint_wrapper", depth)),
    ]
    families = ["llama"] if args.toy else ["llama", "gemma", "opt", "bert"]
    settings += [(f"HF {f}, gradient_checkpointing_enable()", lambda f=f: _hf(f, depth)) for f in families]
    rows = [_row(name, make, mode) for name, make in settings for mode in MODES]
    write_csv(args.out / "wrapped.csv", rows)
    write_json(args.out / "wrapped.json", {"machine": machine(), "rows": rows})
    print(markdown_table(rows))
    return {"rows": rows}


if __name__ == "__main__":
    main()
