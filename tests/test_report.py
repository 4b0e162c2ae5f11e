"""``normfuse.report(model)`` on every model the pass ran on, one entry per norm of the model.

Dynamo runs one compiled graph for every module whose forward is the same code (a block of a
stack compiled on its own, or broken off by a graph break): the report lists each module's
norms under its own path, and the norm modules no graph held as not captured. The registered
backends' process-wide records hold no graph module.
"""

import gc
import weakref

import pytest
import torch
import torch.fx as fx

import normfuse
from normfuse.backends import last_report, registered_records
from normfuse.errors import InvalidModelError
from normfuse.zoo import ToyTransformer, example_inputs, hf_model

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
DEPTH = 3
NORMS = [f"blocks.{i}.norm{j}" for i in range(DEPTH) for j in (1, 2)] + ["final_norm"]

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _toy():
    torch.manual_seed(0)
    return ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", depth=DEPTH).eval()


def _fqns(model):
    return [s.fqn for s in normfuse.report(model).sites]


def test_optimize():
    model = normfuse.optimize(_toy())
    model(IDS)
    assert _fqns(model) == NORMS and normfuse.report(model).counts()["fused_with_add"] == 2 * DEPTH + 1


def test_torch_compile_of_the_model():
    model = _toy()
    compiled = torch.compile(model, backend="normfuse")
    compiled(IDS)
    assert _fqns(compiled) == _fqns(model) == NORMS


def test_module_compile_in_place():
    model = _toy()
    model.compile(backend="normfuse")
    model(IDS)
    assert _fqns(model) == NORMS


def test_a_model_holding_compiled_blocks():
    model = _toy()
    for block in model.blocks:
        block.compile(backend="normfuse")
    model(IDS)
    rep = normfuse.report(model)
    # one compiled graph serves every block: each block's norms under their own path
    assert [s.fqn for s in rep.sites] == NORMS[:-1]
    assert [s.reuses for s in rep.sites] == [None, None] + [f"g0.s{j}" for _ in range(DEPTH - 1) for j in (0, 1)]
    assert rep.compiled_graphs == 1 and rep.graphs == DEPTH
    assert rep.uncaptured == ["final_norm"] and "not captured: final_norm" in str(rep)
    # a block's own report holds its norms only
    assert [s.fqn for s in normfuse.report(model.blocks[1]).sites] == ["norm1", "norm2"]


def test_a_model_the_pass_never_ran_on():
    with pytest.raises(InvalidModelError, match="has not run on this model"):
        normfuse.report(_toy())
    ran = _toy()
    ran.compile(backend="normfuse")
    ran(IDS)
    with pytest.raises(InvalidModelError):  # another model of the same class: its parameters never ran
        normfuse.report(_toy())


def test_hf_layers_named_by_their_own_paths():
    # the cross-block stream reaches the next layer through its own table; the report names each
    # module by its path in the model, not by the way dynamo reached it
    model = normfuse.optimize(hf_model("llama", num_hidden_layers=3))
    model(**example_inputs(model))
    expected = [f"layers.{i}.{n}" for i in range(3) for n in ("input_layernorm", "post_attention_layernorm")]
    assert _fqns(model) == expected + ["norm"]
    assert not normfuse.report(model).uncaptured


def test_registered_backends_keep_no_graph_alive():
    """50 recompiles through the registered backend: the process-wide records hold only what
    dynamo still runs, and no graph module once dynamo dropped its code."""
    def live_graph_modules():
        gc.collect()
        return sum(isinstance(o, fx.GraphModule) for o in gc.get_objects())

    torch._dynamo.reset()
    baseline = live_graph_modules()
    rewritten = []
    for i in range(50):
        torch._dynamo.reset()  # each compile is a fresh capture, as after a recompile
        model = ToyTransformer(depth=1).eval()
        torch.compile(model, backend="normfuse")(IDS[:, : 2 + i % 6])
        record = registered_records()[-1]
        rewritten.append(record.graph_modules[0])
    torch._dynamo.reset()
    del model, record
    gc.collect()
    assert not registered_records() and not last_report().sites
    assert all(ref() is None for ref in rewritten)
    assert live_graph_modules() <= baseline


def test_records_live_as_long_as_the_compiled_code():
    torch._dynamo.reset()
    model = ToyTransformer(depth=1).eval()
    compiled = torch.compile(model, backend="normfuse")
    compiled(IDS)
    (record,) = registered_records()
    graph = record.graph_modules[0]()
    assert isinstance(graph, fx.GraphModule)
    assert len(last_report().sites) == 3
    ref = weakref.ref(graph)
    del graph, record
    torch._dynamo.reset()
    gc.collect()
    assert ref() is None and not registered_records()
