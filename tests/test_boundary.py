"""Cross-block residual pairs (normfuse.passes.cross_block).

The rewrite moves the add that ends block i to the start of block i+1 (and the last
one in front of the final norm): the same adds and norms, regrouped, so outputs and
gradients are bit-identical to the original model; and under per-block regions the
moved add lands next to the norm it feeds, where the pass fuses it.
"""

import copy
import operator
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import normfuse
from normfuse.passes.cross_block import ResidualPair, rewrite_streams, undo_streams
from normfuse.zoo import ToyTransformer, hf_model

from helpers import assert_close
from loops import FLAGGED_LOOPS, CheckpointedStack, HelperMethodLoop, checkpointed_stack, flagged_loop

IDS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _toy(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    kw = {"placement": "pre", "kind": "rms_norm", "spelling": "llama", "hidden": 32, "depth": 3, **kw}
    return ToyTransformer(**kw).to(dtype)


def _run(model, *args, **kwargs):
    out = model(*args, **kwargs)
    out = out.last_hidden_state if hasattr(out, "last_hidden_state") else out
    out.float().square().mean().backward()
    # names as state_dict shows them (checkpoint_wrapper's and compile's prefixes removed)
    return out, {n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p.grad
                 for n, p in model.named_parameters()}


def _assert_identical(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        a_grad, b_grad = grads_a[name], grads_b[name]
        assert (a_grad is None and b_grad is None) or torch.equal(a_grad, b_grad), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling,kind,order", [("llama", "rms_norm", "x+f"), ("module", "layer_norm", "f+x"),
                                                 ("functional", "rms_norm", "torch.add"),
                                                 ("module", "layer_norm", "iadd")])
def test_rewrite_is_bit_identical_to_eager(dtype, spelling, kind, order):
    original = _toy(dtype, spelling=spelling, kind=kind, add_order=order)
    model = copy.deepcopy(original)
    [result] = rewrite_streams(model)
    assert result.applied and result.blocks == 3 and result.final_norm == "final_norm"
    assert list(model.state_dict()) == list(original.state_dict())
    x = original.tok(IDS)
    # in the stream a block returns the un-added pair; the final norm takes it
    def first():  # a fresh pair each time: an in-place add moved into block 1 consumes it
        return model.blocks[0](ResidualPair(x, None, None))

    pair = first()
    assert isinstance(pair, ResidualPair) and pair.residual is not None
    by_name = model.blocks[1](x=first())  # the stream passed by its name
    assert torch.equal(by_name.hidden, model.blocks[1](first()).hidden)
    # called by other code, a block returns the sum, as before
    assert torch.equal(model.blocks[0](x), original.blocks[0](x))
    assert torch.equal(model.blocks[1](x=model.blocks[0](x)), original.blocks[1](original.blocks[0](x)))
    _assert_identical(_run(original, IDS), _run(model, IDS))
    undo_streams(model)
    assert type(model.blocks[0]) is type(original.blocks[0]) and "_normfuse_stream" not in model.__dict__
    assert not model._forward_pre_hooks and not model._forward_hooks


def test_the_owners_loop_hands_pairs_from_block_to_block():
    model = _toy()
    rewrite_streams(model)
    seen = []  # what each block is called with, as (residual given, sum asked for)
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append((args[1] is not None, args[3])))
    model(IDS)
    assert seen == [(False, False), (True, False), (True, False)]
    seen.clear()
    model.blocks[2](model.tok(IDS))  # not from the loop: the block adds, as before
    assert seen == [(False, True)]
    with pytest.raises(RuntimeError):  # the owner's forward failed: its blocks are outside a loop again
        model(IDS.float())
    seen.clear()
    model.blocks[0](model.tok(IDS))
    assert seen == [(False, True)]


@pytest.mark.parametrize("order", ["x+f", "iadd"])  # in place: the recomputed block must not add twice
def test_pair_crosses_non_reentrant_checkpoint(order):
    original = checkpointed_stack("non_reentrant", depth=3, add_order=order)
    model = copy.deepcopy(original)
    assert rewrite_streams(model)[0].applied
    _assert_identical(_run(original, IDS), _run(model, IDS))


def test_pair_crosses_checkpoint_wrapper_of_each_block():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    original = _toy()
    model = copy.deepcopy(original)
    for i, block in enumerate(model.blocks):  # the reentrant flavour too: the pair enters as two tensors
        model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
    assert rewrite_streams(model)[0].applied
    _assert_identical(_run(original, IDS), _run(model, IDS))


class _HelperReadingTheStream(HelperMethodLoop):
    def run_layer(self, layer, hidden):
        return layer(hidden) * 1.0


@pytest.mark.parametrize("loop", list(FLAGGED_LOOPS))
@pytest.mark.parametrize("checkpointing", [True, False])
def test_loop_spellings_hand_every_pair_on_with_cross_checkpoints(loop, checkpointing):
    torch._dynamo.reset()
    original = flagged_loop(loop, checkpointing, depth=4).train()
    regrouped = copy.deepcopy(original)
    assert rewrite_streams(regrouped, cross_checkpoints=True)[0].applied
    _assert_identical(_run(original, IDS), _run(regrouped, IDS))  # the same adds and norms, regrouped
    model = normfuse.optimize(copy.deepcopy(original), cross_checkpoints=True)
    (out, grads), (want, want_grads) = _run(model, IDS), _run(copy.deepcopy(original), IDS)
    assert_close(out, want)
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], name)
    rep = normfuse.report(model)
    counts = rep.counts()
    assert (counts["sites"], counts["fused"], counts["fused_with_add"]) == (9, 9, 8), str(rep)
    assert any("4 blocks hand the residual pair" in note for note in rep.notes), rep.notes


def _prepared(model, form, blocks="blocks", final_norm="final_norm"):
    """``optimize``, or torchtitan's apply_compile in the two forms users write after
    ``prepare``, the final norm compiled too (so that the last pair's add is in a graph).
    Returns the notes on the streams."""
    if form == "optimize":
        return normfuse.report(normfuse.optimize(model)).notes
    notes = normfuse.prepare(model).notes
    stack = getattr(model, blocks)
    for i, block in enumerate(stack):
        if form == "module.compile":
            block.compile(backend="normfuse")
        else:
            stack.register_module(str(i), torch.compile(block, backend="normfuse"))
    getattr(model, final_norm).compile(backend="normfuse")
    return notes


@pytest.mark.parametrize("form", ["optimize", "module.compile", "register_module"])
@pytest.mark.parametrize("loop", list(FLAGGED_LOOPS))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_checkpoint_flag_is_read_when_the_model_runs(form, loop, checkpointing):
    """Whether the loop checkpoints is decided at each forward from the model's own test: with
    the flag off every add is fused with the norm it feeds, as for a plain loop; with it on
    (training, grad on) each checkpointed block gets the sum, as before."""
    torch._dynamo.reset()
    original = flagged_loop(loop, checkpointing, depth=4).train()
    model = copy.deepcopy(original)
    notes = _prepared(model, form)
    (out, grads), (want, want_grads) = _run(model, IDS), _run(original, IDS)
    assert_close(out, want)
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], name)
    rep = normfuse.report(model)
    # per norm module (under per-block compile a checkpoint's recompute runs graphs of its own,
    # which the report lists as runs of the same modules)
    fused = {s.fqn: (s.fused, s.fused and s.fused_add, s.input_is_add) for s in rep.sites}
    assert len(fused) == 9 and all(f for f, _, _ in fused.values()), str(rep)
    # 8 add-fed norms: with checkpoints on, only the last pair crosses (to the final norm)
    assert sum(a for _, a, _ in fused.values()) == (5 if checkpointing else 8), str(rep)
    [note] = [n for n in notes if n.startswith("cross-block")]
    assert ("checkpointed blocks" in note) == checkpointing, note
    assert f"({'holds' if checkpointing else 'does not hold'} now)" in note, note
    if form == "register_module":
        # dynamo compiles the element's own __call__ as that form's frame: each flip recompiles
        # it, and past dynamo's recompile limit a recompute would run it eagerly
        return
    # the same model, the flag turned the other way, in the next forward (a recompile under dynamo)
    model.checkpointing = original.checkpointing = not checkpointing
    (out, grads), (want, want_grads) = _run(model, IDS), _run(original, IDS)
    assert_close(out, want)


def test_an_eval_forward_without_grad_hands_pairs_into_a_checkpointing_loop():
    """A checkpoint without grad keeps nothing for a recompute: the pair goes in."""
    model = flagged_loop("if_else", True, depth=3).eval()
    original = copy.deepcopy(model)
    rewrite_streams(model)
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[1] is not None))
    with torch.no_grad():
        assert torch.equal(model(IDS), original(IDS))
    assert seen == [False, True, True]
    seen.clear()
    model(IDS)  # grad on: the loop checkpoints, each block gets the sum
    assert seen == [False, False, False]


def test_a_test_reading_the_loop_variable_is_taken_as_checkpointing_always():
    class EveryOther(HelperMethodLoop):
        def forward(self, ids):
            x = self.embed(ids)
            for i, layer in enumerate(self.blocks):
                x = checkpoint(layer, x, use_reentrant=False) if i % 2 else layer(x)
            return self.head(self.final_norm(x))

    model = EveryOther(depth=3).train()
    [result] = rewrite_streams(model)
    assert result.applied and result.checkpointed and "read at each forward" not in result.describe()


def test_a_loop_the_analysis_cannot_take_is_named_in_the_report():
    torch._dynamo.reset()
    model = normfuse.optimize(_HelperReadingTheStream(depth=2).train(), cross_checkpoints=True)
    _run(model, IDS)
    text = str(normfuse.report(model))
    assert "cross-block: blocks: left as it was" in text and "_HelperReadingTheStream.run_layer" in text, text
    assert "returns something else than what the block returns" in text


class _StreamReturnedToo(nn.Module):
    def __init__(self):
        super().__init__()
        toy = _toy()
        self.tok, self.blocks, self.norm = toy.tok, toy.blocks, toy.final_norm

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x), x  # the stream's last value, returned as is besides its norm


class _HiddenStatesCollector(nn.Module):
    def __init__(self):
        super().__init__()
        toy = _toy()
        self.tok, self.blocks, self.norm = toy.tok, toy.blocks, toy.final_norm

    def forward(self, ids):
        x, seen = self.tok(ids), []
        for block in self.blocks:
            x = block(x)
            seen.append(x)  # reads the stream between blocks: a pair would leak here
        return self.norm(x), seen


def _my_checkpoint(block, x):
    return block(x)


class _UnknownWrapperLoop(CheckpointedStack):
    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = _my_checkpoint(block, x)
        return self.head(self.final_norm(x))


@pytest.mark.parametrize("cross_checkpoints", [False, True])
def test_reentrant_checkpoint_in_the_loop_gets_the_sum_and_the_final_norm_the_pair(cross_checkpoints):
    original = checkpointed_stack("reentrant", depth=3)
    model = copy.deepcopy(original)
    [result] = rewrite_streams(model, cross_checkpoints)
    assert result.applied and "reentrant checkpoint would hide a pair" in result.describe()
    seen = []  # whether each block gets a residual (a pair) and is asked for the sum
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append((args[1] is not None, args[3])))
    _assert_identical(_run(original, IDS), _run(model, IDS))
    # forward, then the reentrant recompute of each block in backward (last block first): the same calls
    forward = [(False, True), (False, True), (False, False)]
    assert seen == forward + forward[::-1]


@pytest.mark.parametrize("model,reason", [
    (_HiddenStatesCollector(), "reads `x` other than to call the next block"),
    (_StreamReturnedToo(), "`x` is read again besides the final norm"),
    (_UnknownWrapperLoop(), "only checkpointing with a literal use_reentrant passes it"),
    (ToyTransformer(final_norm=False), "does not go straight into a norm module"),
])
def test_streams_that_do_not_fit_are_left_with_the_reason(model, reason):
    before = {n: type(m) for n, m in model.named_modules()}
    [result] = rewrite_streams(model)
    assert not result.applied and reason in result.reason
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert "forward" not in model.blocks[0].__dict__


def test_hf_llama_with_gradient_checkpointing_is_bit_identical():
    original = hf_model("llama", num_hidden_layers=3).train()
    original.gradient_checkpointing_enable()
    model = copy.deepcopy(original)
    [result] = rewrite_streams(model)
    assert result.applied and result.blocks == 3 and result.final_norm == "norm"
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    _assert_identical(_run(original, input_ids=ids), _run(model, input_ids=ids))


def test_per_block_compile_fuses_the_add_that_crosses_each_boundary():
    depth = 3

    def compiled_per_block(rewrite):
        torch._dynamo.reset()
        model = _toy(depth=depth)
        if rewrite:
            rewrite_streams(model)
        for i, block in enumerate(model.blocks):  # torchtitan's apply_compile
            model.blocks.register_module(str(i), torch.compile(block, backend="normfuse"))
        out, _ = _run(model, IDS)
        rep = normfuse.report(model)  # the report of the blocks' graphs, found through their parameters
        return [(s.fqn, s.fused and s.fused_add) for s in rep.sites], rep, out

    plain, rep_plain, out_plain = compiled_per_block(False)
    crossed, rep, out_crossed = compiled_per_block(True)
    norms = [f"blocks.{i}.norm{j}" for i in range(depth) for j in (1, 2)]
    # every block's norms, each under its own path, though the blocks share their code (one graph
    # may run for several blocks); the final norm runs eagerly, outside the compiled blocks
    assert [fqn for fqn, _ in plain] == [fqn for fqn, _ in crossed] == norms
    assert rep.uncaptured == rep_plain.uncaptured == ["final_norm"]
    assert "not captured: final_norm" in str(rep)
    # without the pairs the first norm of each block is fused alone
    assert [fused for _, fused in plain] == [False, True] * depth
    # with them: block 0 (a plain tensor in) as before; blocks 1.. fuse the add that crossed
    assert [fused for _, fused in crossed] == [False] + [True] * (2 * depth - 1)
    assert any(s.reuses for s in rep_plain.sites), "one compiled graph serves the blocks"
    assert_close(out_plain, out_crossed)


def test_optimize_applies_it_by_default_and_says_so():
    model = normfuse.optimize(_toy())
    assert isinstance(model.blocks[0](ResidualPair(model.tok(IDS), None, None)), ResidualPair)
    assert any("3 blocks hand the residual pair" in note for note in normfuse.report(model).notes)
    assert isinstance(model.blocks[0](model.tok(IDS)), torch.Tensor)  # called by other code: as before
    off = normfuse.optimize(_toy(), cross_block=False)
    assert type(off.blocks[0]) is type(_toy().blocks[0]) and not normfuse.report(off).notes


def test_compiled_blocks_hand_pairs_as_eager_does():
    """Under dynamo a list element takes a shortcut for the plain tuple its owner's loop hands
    on; a block called by other code, with a ResidualPair or a tensor, goes the general way."""
    original = _toy()
    model = copy.deepcopy(original)
    rewrite_streams(model)
    x = original.tok(IDS)
    eager_pair = model.blocks[1](ResidualPair(x, x * 0.5, operator.add))
    compiled_pair = torch.compile(lambda p: model.blocks[1](p), backend="eager", fullgraph=True)(
        ResidualPair(x, x * 0.5, operator.add))
    assert isinstance(compiled_pair, ResidualPair) and isinstance(eager_pair, ResidualPair)
    assert all(torch.equal(a, b) for a, b in zip(compiled_pair[:2], eager_pair[:2]))
    compiled_sum = torch.compile(lambda t: model.blocks[1](t), backend="eager", fullgraph=True)(x)
    assert isinstance(compiled_sum, torch.Tensor) and torch.equal(compiled_sum, original.blocks[1](x))
    # the owner's loop, one graph: the same outputs and gradients as the original, bit for bit
    torch._dynamo.reset()
    compiled = copy.deepcopy(model)
    compiled.compile(backend="eager", fullgraph=True)
    _assert_identical(_run(original, IDS), _run(compiled, IDS))


def test_rewritten_model_pickles_and_deep_copies():
    import io
    original = _toy()
    model = copy.deepcopy(original)
    rewrite_streams(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert isinstance(loaded.blocks[1](ResidualPair(original.tok(IDS), None, None)), ResidualPair)
    _assert_identical(_run(original, IDS), _run(loaded, IDS))
    _assert_identical(_run(copy.deepcopy(original), IDS), _run(copy.deepcopy(model), IDS))


@pytest.mark.parametrize("family", ["llama", "opt"])
@pytest.mark.parametrize("optimized", [False, True])
def test_hf_output_hidden_states_are_the_added_stream(optimized, family):
    # transformers records each layer's output in a hook: the layers then return it added
    original = hf_model(family, num_hidden_layers=3)
    model = copy.deepcopy(original)
    if optimized:
        normfuse.optimize(model, cross_block=True)
    else:
        rewrite_streams(model)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    want = original(input_ids=ids, output_hidden_states=True)
    got = model(input_ids=ids, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 4
    for a, b in zip(got.hidden_states, want.hidden_states):
        assert isinstance(a, torch.Tensor)
        assert_close(a, b)
    if not optimized:
        assert all(torch.equal(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
    assert_close(got.last_hidden_state, want.last_hidden_state)
    # and without recording, the pairs cross the blocks again
    assert_close(model(input_ids=ids).last_hidden_state, want.last_hidden_state)


def test_blocks_with_output_hooks_are_left_with_the_reason():
    model = _toy()
    seen = []
    model.blocks[1].register_forward_hook(lambda module, args, output: seen.append(output))
    [result] = rewrite_streams(model)
    assert not result.applied and "forward hook" in result.reason and "un-added pair" in result.reason
    model(IDS)
    assert isinstance(seen[0], torch.Tensor)


class _SwitchedBlock(nn.Module):
    """OPT's shape: the sum reshaped, then a config switch that may norm it (Post-Norm)."""

    def __init__(self, n=16, post=False):
        super().__init__()
        self.norm1, self.fc, self.norm2 = nn.LayerNorm(n), nn.Linear(n, n), nn.LayerNorm(n)
        self.post = post

    def forward(self, x):
        shape = x.shape
        residual = x.reshape(-1, x.shape[-1])
        h = self.fc(self.norm1(residual))
        x = (residual + h).view(shape)
        if self.post:
            x = self.norm2(x)
        return x


class _SwitchedStack(nn.Module):
    def __init__(self, post):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(_SwitchedBlock(post=post) for _ in range(3))
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
        return self.norm(x)


@pytest.mark.parametrize("post", [False, True])
def test_reshaped_add_and_config_switch_before_the_return(post):
    original = _SwitchedStack(post)
    model = copy.deepcopy(original)
    [result] = rewrite_streams(model)
    assert result.applied, result.reason
    x = torch.randn(2, 5, 16, requires_grad=True)
    seen = []
    model.layers[1].register_forward_pre_hook(lambda module, args: seen.append(args[1] is not None))
    _assert_identical(_run(original, x), _run(model, x))
    # switch off: the reshaped operands cross the boundary; on: the normed sum does
    assert seen == [not post]
    out = normfuse.optimize(copy.deepcopy(original))(x)
    assert_close(out, original(x))


def test_audit_regroups_as_optimize_would_and_puts_the_model_back():
    model = _toy()
    classes = [type(m) for m in model.modules()]
    rep = normfuse.audit(model, IDS)
    assert any("3 blocks hand the residual pair" in note for note in rep.notes)
    assert "3 blocks hand the residual pair" in str(rep.to_dict()["notes"])
    assert [type(m) for m in model.modules()] == classes
    assert not model._forward_pre_hooks and not model._forward_hooks and "_normfuse_stream" not in model.__dict__
    assert not normfuse.audit(model, IDS, config=normfuse.FuseConfig(cross_block=False)).notes
    rewrite_streams(model)  # a stream the user rewrote stays rewritten
    normfuse.audit(model, IDS)
    assert "_normfuse_stream" in model.__dict__


def test_hf_owner_with_a_graph_break_before_the_loop_keeps_the_loop_in_one_graph():
    # CTRL sets a buffer in its forward (a graph break before the layer loop): transformers'
    # output collector is then set outside the traced frame, where dynamo can read it only
    # through a graph break per layer. It is not read while no recorder hook is installed.
    model = hf_model("ctrl").eval()
    inputs = {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))}
    want = copy.deepcopy(model)(**inputs).last_hidden_state
    normfuse.optimize(model)
    assert torch.equal(model(**inputs).last_hidden_state, want)
    rep = normfuse.report(model)
    counts = rep.counts()
    assert counts["sites"] == 5 and counts["fused_with_add"] == 4, str(rep)
    assert {s.graph for s in rep.sites} == {1}  # the loop and the final norm: one graph


def test_hf_hidden_states_asked_after_the_model_was_captured_without_them():
    # the first call captures graphs with no recorder hook installed (pairs cross the layers);
    # asking for hidden states installs the hooks: the layers must then return the added stream
    original = hf_model("llama", num_hidden_layers=3)
    model = normfuse.optimize(copy.deepcopy(original))
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    first = model(input_ids=ids).last_hidden_state
    got = model(input_ids=ids, output_hidden_states=True).hidden_states
    want = original(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 4
    for a, b in zip(got, want):
        assert isinstance(a, torch.Tensor)
        assert_close(a, b)
    assert torch.equal(model(input_ids=ids).last_hidden_state, first)


def test_a_deep_rewritten_stack_deep_copies_and_pickles():
    # what a block needs of the next one lives in the stream, not in each block: no chain of
    # references that deepcopy or pickle would follow block after block, past the recursion limit
    import io
    model = ToyTransformer(placement="pre", kind="rms_norm", spelling="llama", hidden=8, depth=400)
    rewrite_streams(model)
    copied = copy.deepcopy(model)
    stream = copied.blocks[3].__dict__["_normfuse_stream_element"]
    assert stream.receivers["2"] is copied.blocks[3] and stream.receivers["399"] is None
    torch.save(model, io.BytesIO())


def test_models_pickled_by_an_earlier_version_load_and_run():
    """tests/data/models_pickled_by_0.1.0.pt: torch.save of a model with its streams regrouped
    and of an optimized one, written by normfuse 0.1.0 (before the stream code and the model's
    forward moved between modules): they load, compute what they computed then, and the
    optimized one reports its sites. The saved outputs were computed on another CPU, whose
    kernels may round the last bit differently: here the two models agree bit for bit with each
    other and with the saved outputs up to the tolerance table."""
    from pathlib import Path

    saved = torch.load(Path(__file__).parent / "data" / "models_pickled_by_0.1.0.pt", weights_only=False)
    regrouped, optimized, ids = saved["regrouped"], saved["optimized"], saved["ids"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # its graph calls add_norm with the flat keywords
        out_regrouped, out_optimized = regrouped(ids), optimized(ids)
    assert torch.equal(out_optimized, out_regrouped)
    assert torch.equal(saved["out_optimized"], saved["out_regrouped"])
    assert_close(out_regrouped, saved["out_regrouped"])
    assert isinstance(regrouped.blocks[0](ResidualPair(regrouped.tok(ids), None, None)), ResidualPair)
    rep = normfuse.report(optimized)
    assert [s.fqn for s in rep.sites] == ["blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2",
                                          "final_norm"]
    assert rep.counts()["fused_with_add"] == 5  # the first norm's position add too, fused today
    assert [s.call for s in rep.sites] == [f"g0.c{k}" for k in range(5)]  # 0.1 kept the call as a string


def test_new_pickles_name_the_cross_block_modules_and_old_names_still_resolve():
    """A model rewritten now pickles under normfuse.passes.cross_block (its swapped classes
    under .classes, which rebuilds them); normfuse.passes.boundary, the path models pickled by
    0.1.0 name, rebuilds the same classes."""
    import io
    import pickle
    import sys

    from normfuse.passes import boundary

    named = []

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.append((module, name))
            return super().find_class(module, name)

    original = _toy()
    model = copy.deepcopy(original)
    rewrite_streams(model)
    loaded = Recording(io.BytesIO(pickle.dumps(model))).load()
    ours = [(module, name) for module, name in named if module.startswith("normfuse.passes.")]
    assert ours and all(module.startswith("normfuse.passes.cross_block.") for module, _ in ours), ours
    swapped = [(module, name) for module, name in ours if name.startswith("_nf_swapped_")]
    assert {module for module, _ in swapped} == {"normfuse.passes.cross_block.classes"}
    for module, name in swapped:
        assert getattr(boundary, name) is getattr(sys.modules[module], name)
    _assert_identical(_run(original, IDS), _run(loaded, IDS))


class _TwoStreams(nn.Module):
    """One owner, two block lists run one after the other, each into its own norm (videoprism's
    vision model: spatial layers, then temporal layers)."""

    def __init__(self):
        super().__init__()
        first, second = _toy(depth=2), _toy(depth=3, kind="layer_norm", spelling="module")
        self.tok, self.spatial, self.norm1 = first.tok, first.blocks, first.final_norm
        self.temporal, self.norm2 = second.blocks, second.final_norm

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.spatial:
            x = block(x)
        features = self.norm1(x) * 0.5
        for block in self.temporal:
            features = block(features)
        return self.norm2(features)


def _model_state(model):
    """What a rewrite may change on a model: classes, instance attributes, hooks."""
    return [(name, type(m), sorted(m.__dict__), list(m._forward_pre_hooks), list(m._forward_hooks))
            for name, m in model.named_modules()]


def test_an_owner_with_two_block_lists_gets_a_stream_for_each():
    original = _TwoStreams()
    model = copy.deepcopy(original)
    state = _model_state(model)
    results = rewrite_streams(model)
    assert [(r.fqn, r.applied, r.blocks, r.final_norm) for r in results] == [("spatial", True, 2, "norm1"),
                                                                             ("temporal", True, 3, "norm2")]
    seen = []
    for block in (*model.spatial, *model.temporal):
        block.register_forward_pre_hook(lambda module, args: seen.append(args[1] is not None))
    _assert_identical(_run(original, IDS), _run(model, IDS))
    assert seen == [False, True, False, True, True]  # each list's first block gets a tensor
    rewrite_streams(model)  # idempotent: each list keeps its stream
    undo_streams(model)
    for block in (*model.spatial, *model.temporal):
        block._forward_pre_hooks.clear()
    assert _model_state(model) == state
    normfuse.optimize(model)
    assert torch.equal(model(IDS), original(IDS))
    counts = normfuse.report(model).counts()
    assert (counts["sites"], counts["fused"], counts["fused_with_add"]) == (12, 12, 10)


def test_hf_videoprism_two_block_lists_in_one_forward():
    pytest.importorskip("transformers")
    from zoo.models import zoo_models
    original, _, inputs = zoo_models()["hf:videoprism_vision"].build()
    want = original(**inputs).last_hidden_state
    model = normfuse.optimize(copy.deepcopy(original))
    assert torch.equal(model(**inputs).last_hidden_state, want)
    rep = normfuse.report(model)
    counts = rep.counts()
    assert (counts["sites"], counts["fused"], counts["fused_with_add"]) == (10, 10, 10), str(rep)
    # each list is read as its own stream; both are left as they were: the model also returns each
    # list's last value as is (last_spatial_hidden_state), which would be the un-added pair
    notes = [n for n in rep.notes if n.startswith("cross-block")]
    assert [n.split(":")[1].strip() for n in notes] == ["spatial_layers", "temporal_layers"], rep.notes
    assert all("is read again besides the final norm" in n for n in notes), notes
    assert all(isinstance(v, torch.Tensor) for v in model(**inputs).values())


def test_a_rewrite_that_fails_midway_leaves_the_stream_as_it_was(monkeypatch):
    from normfuse.passes.cross_block import install
    original = _TwoStreams()
    model = copy.deepcopy(original)
    state = _model_state(model)
    swap, calls = install._swap_class, []

    def failing_swap(module, *args, **kwargs):  # the temporal list's second block fails to swap
        calls.append(module)
        if module is model.temporal[1]:
            raise RuntimeError("planted")
        swap(module, *args, **kwargs)

    monkeypatch.setattr(install, "_swap_class", failing_swap)
    spatial, temporal = rewrite_streams(model)
    assert spatial.applied and not temporal.applied
    assert "not rewritten (RuntimeError: planted); the stream is as it was" in temporal.describe()
    assert model.temporal[0] in calls  # swapped before the failure, and put back
    undo_streams(model)
    assert _model_state(model) == state


def test_a_preparation_that_fails_leaves_the_model_exactly_as_it_was(monkeypatch):
    from normfuse.passes.cross_block import install
    original = _TwoStreams()
    model = copy.deepcopy(original)
    state = _model_state(model)
    describe = install._describe

    def failing_describe(result, *args):  # after the first stream is installed: a failure outside any stream
        if result.fqn == "temporal":
            raise RuntimeError("planted")
        describe(result, *args)

    monkeypatch.setattr(install, "_describe", failing_describe)
    done = normfuse.prepare(model)
    assert _model_state(model) == state and not done.streams
    assert any("prepare: failed (RuntimeError: planted); the model's code is as it was" in n for n in done.notes)
    normfuse.optimize(model)  # optimize still captures and fuses, with the note in its report
    assert torch.equal(model(IDS), original(IDS))
    assert any("prepare: failed" in n for n in normfuse.report(model).notes)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_reentrant_checkpoint_behind_a_flag_gets_the_sum_only_while_the_flag_is_on(checkpointing):
    from loops import ReentrantIfElseLoop
    original = ReentrantIfElseLoop(depth=3).train()
    original.checkpointing = checkpointing
    model = copy.deepcopy(original)
    rewrite_streams(model, cross_checkpoints=True)  # never into a reentrant checkpoint
    seen = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda module, args: seen.append(args[1] is not None))
    _assert_identical(_run(original, IDS), _run(model, IDS))
    # the block's recompute in backward (reentrant: last block first) is called as in the forward
    assert seen == ([False, False, False] * 2 if checkpointing else [False, True, True])


@pytest.mark.parametrize("form", ["optimize", "module.compile", "register_module"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_hf_gradient_checkpointing_layer_is_read_when_the_model_runs(form, checkpointing, request):
    """transformers' GradientCheckpointingLayer checkpoints in its own __call__ while
    ``gradient_checkpointing`` is set and the model trains: the flag, read per call."""
    torch._dynamo.reset()
    if form != "optimize":
        # the user's own torch.compile keeps the user's dynamo settings: with transformers 5.25 a
        # checkpointed layer has a side effect dynamo traces only so (docs/training_at_scale.md,
        # "How a checkpointed region runs"); optimize sets it itself
        setting = torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
        setting.__enter__()
        request.addfinalizer(lambda: setting.__exit__(None, None, None))
    original = hf_model("llama", num_hidden_layers=3).train()
    if checkpointing:
        original.gradient_checkpointing_enable()
    model = copy.deepcopy(original)
    _prepared(model, form, blocks="layers", final_norm="norm")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    (out, grads), (want, want_grads) = _run(model, input_ids=ids), _run(original, input_ids=ids)
    assert_close(out, want)
    for name, grad in grads.items():
        assert_close(grad, want_grads[name], name)
    rep = normfuse.report(model)
    with_add = {s.fqn for s in rep.sites if s.fused and s.fused_add}
    # 6 add-fed norms (layer 0's first norm reads the embedding): a checkpointed layer keeps the sum
    expected = {f"layers.{i}.post_attention_layernorm" for i in range(3)} | {"norm"}
    if not checkpointing:
        expected |= {f"layers.{i}.input_layernorm" for i in (1, 2)}
    assert with_add == expected, str(rep)


class _OptionalFinalNorm(_StreamReturnedToo):
    def forward(self, ids):  # torchtitan's decoder: the final norm may be left out (pipeline stages)
        h = self.tok(ids)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return h


def test_a_final_norm_behind_its_own_existence_test_takes_the_pair():
    original = _OptionalFinalNorm()
    model = copy.deepcopy(original)
    [result] = rewrite_streams(model)
    assert result.applied and result.final_norm == "norm", result.describe()
    _assert_identical(_run(original, IDS), _run(model, IDS))
