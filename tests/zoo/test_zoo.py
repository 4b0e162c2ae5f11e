"""normfuse on the zoo (tests/zoo/models.py), held to the table in tests/zoo/expected.py.

For every model: the sites normfuse reports (norms, fused, fused with their add, placements)
and an independent eager count of norm calls and add-fed norm calls (tests/zoo/count.py) equal
the table; ``normfuse.check`` passes (every output within the tolerance rule of
normfuse/tolerances.py, every fused site numerically and symbolically checked) and the
optimized outputs are bit-identical to eager where the table says so.

The FAST subset runs in the default suite; ``pytest -m zoo tests/zoo`` runs every model.
"""

from __future__ import annotations

import importlib.util

import pytest

from .expected import EXPECTED, FAST
from .models import zoo_models
from .run import measure

MODELS = zoo_models()
ASSERTED = ("norms", "fused", "fused_with_add", "input_is_add", "placements", "eager_norms", "eager_input_is_add",
            "check", "checked_sites", "bitwise", "gated", "fused_gate", "rope", "fused_rope")
# asserted where the entry has them
OPTIONAL = {"checked_sites", "bitwise", "gated", "fused_gate", "rope", "fused_rope"}


def _run(name: str) -> None:
    entry = MODELS[name]
    if entry.needs and importlib.util.find_spec(entry.needs) is None:
        pytest.skip(f"{entry.needs} is not installed (pip install -e '.[dev,hf]')")
    want = EXPECTED[name]
    got = measure(entry)
    mismatched = {k: (got.get(k), want[k]) for k in ASSERTED if k in want and got.get(k) != want[k]}
    assert not mismatched, f"{name}: (measured, expected) {mismatched}; unfused: {got['unfused']}"
    # the report's promise: no norm module that ran goes unlisted, no add stays out without a reason
    assert not got["silent"], f"{name}: norm modules neither a site nor listed as not captured: {got['silent']}"
    assert not got["unexplained_adds"], f"{name}: add-fed sites fused without their add, no reason: " \
                                        f"{got['unexplained_adds']}"


def test_table_covers_the_zoo():
    assert set(EXPECTED) == set(MODELS)
    assert set(FAST) <= set(MODELS) and 10 <= len(FAST) <= 15
    for name, want in EXPECTED.items():
        assert set(ASSERTED) - OPTIONAL <= set(want), name
        assert want.get("fused_gate", 0) == want.get("gated", 0) or want.get("note"), name
        assert want.get("fused_rope", 0) == want.get("rope", 0) or want.get("note"), name
        # every departure from "all found, all fused, all checked, counts agree" is explained
        clean = (want["fused"] == want["norms"] and want["check"] == "ok" and want.get("bitwise", True)
                 and (want["norms"], want["input_is_add"]) == (want["eager_norms"], want["eager_input_is_add"])
                 and want.get("checked_sites", want["fused"]) == want["fused"])
        assert clean or want.get("note"), f"{name}: departs from the clean case without a note"


@pytest.mark.parametrize("name", FAST)
def test_zoo_fast(name):
    _run(name)


@pytest.mark.zoo
@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo(name):
    _run(name)
