"""Diffusion blocks under ``torch.compile(backend="normfuse_inductor")``: the call takes the chain whole.

Inductor fuses pointwise chains around its own norms; an opaque op that took half of one (the norm
without its modulation, say) would leave the other half split across the op's boundary, each half a
pass of its own. The pass rewrites the torch-level graph before Inductor sees it, so the gated
branch, the add, the norm and the modulation are one call. Checked on the post-grad graph Inductor
lowers (recorded by ``post_grad_custom_post_pass``): each call's normalized output goes straight to a
matmul (the next linear) and its sum to the next call or the stream's next add; nothing pointwise
reads them.
"""

import copy
import operator
import shutil
import warnings

import pytest
import torch

pytestmark = [pytest.mark.usefixtures("fresh_dynamo"),
              pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                 reason="Inductor on CPU compiles C++: no compiler here")]

_VIEWS = {"view", "reshape", "_unsafe_view", "permute", "expand", "clone", "unsqueeze", "squeeze", "t", "transpose",
          "alias"}


def _readers(node):
    """What reads a value, through views."""
    found, frontier = set(), [node]
    while frontier:
        for user in frontier.pop().users:
            name = getattr(user.target, "__name__", str(user.target)).split(".")[0]
            if user.op == "call_function" and name in _VIEWS:
                frontier.append(user)
            else:
                found.add(str(user.target).replace("aten.", "").replace(".default", "").replace(".Tensor", ""))
    return found


def _post_grad_readers(name):
    from torch._inductor import config

    import normfuse
    from tests.zoo.diffusion import build

    graphs = []
    model, kwargs = build(name)
    with warnings.catch_warnings(), config.patch(post_grad_custom_post_pass=graphs.append):
        warnings.simplefilter("ignore")
        compiled = torch.compile(copy.deepcopy(model), backend="normfuse_inductor")
        with torch.no_grad():
            got, want = compiled(**kwargs)[0], model(**kwargs)[0]
    readers = {}
    for graph in graphs:
        for call in (n for n in graph.nodes if n.op == "call_function" and "normfuse" in str(n.target)):
            for out in (u for u in call.users if u.target is operator.getitem):
                readers.setdefault(out.args[1], set()).update(_readers(out))
    return readers, normfuse.report(compiled), got, want


def test_dit_chain_is_whole_on_the_post_grad_graph():
    readers, report, got, want = _post_grad_readers("dit")
    assert report.counts()["fused_modulation"] == 5 and report.counts()["fused_gated_residual"] == 4, report
    assert readers[0] == {"addmm"}, readers        # y: the modulated output, into the next linear only
    assert readers[1] == {"normfuse.add_norm_fwd"}, readers  # s: the sum, into the next call only
    torch.testing.assert_close(got, want)
