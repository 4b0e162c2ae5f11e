"""What the zoo (tests/zoo/models.py) must show, model by model; tests/zoo/test_zoo.py asserts it.

Columns, per model, in one forward pass (batch 2, 8 tokens or 32x32 / 64x64 images, fp32, CPU):
- norms, fused, fused_with_add, input_is_add, placements: normfuse's report (sites found, sites
  rewritten, rewritten together with their residual add, sites whose input is an add, placement).
- eager_norms, eager_input_is_add: the independent eager count of tests/zoo/count.py (norm calls,
  and those whose input is the tensor an add returned). Where it differs from normfuse's the note
  says why (a norm normfuse does not see, or an add behind a reshape the simple count misses).
- check: normfuse.check (forward; outputs against fp64 under normfuse/tolerances.py, every fused
  site numerically and symbolically), "ok", "FAILS" or "raises <error>"; checked_sites: sites it
  verified; bitwise: the optimized outputs equal eager's bit for bit.
- note: why an entry departs from "every norm found and fused, check ok, counts agree". "defect N"
  names an open defect of the project's issue list; a finding not on that list says "open:".

Regenerate an entry with `python -m tests.zoo.make_table --measure NAME`.
"""

# notes shared by several entries
COHERE_LAYER_NORM = (
    "CohereLayerNorm computes (x - mean) twice, seen as one value; the fused op's LayerNorm reduces the r"
    'ow in another order than the written-out mean and variance: within the tolerance rule'
)
ASSOCIATIVE_SCAN = (
    "outputs within tolerance, not bit-identical: under dynamo transformers' Mamba mixer takes its associative"
    " scan (another summation order), eager its sequential loop; every site is 0 ulp from its original"
)
CHANNEL_NORMS = (
    'channel norms (permute -> layer_norm -> permute): the eager count does not follow an add through the'
    ' permute; normfuse fuses that add on contiguous rows (channels_last) and on NCHW tensors (the channe'
    'l-norm kernels read the channels strided)'
)
MAXVIT_CHANNEL_NORMS = (
    CHANNEL_NORMS + '; every site is bit-identical to its subgraph, the model output is not (within the '
    'rule, ratio 1.13); so it was before the channel-norm kernels, with 12 of 16 adds fused (cause not a'
    'nalysed)'
)
NN_TRANSFORMER_FAST_PATH = (
    "the encoder layers run PyTorch's fused encoder-layer op (torch._transformer_encoder_layer_fwd, nn's "
    'eval fast path) in the captured graph: their 4 norms are inside it; the eager count (a TorchFunction'
    'Mode, which turns the fast path off) sees all 12; outputs within tolerance, not bit-identical: eager'
    " takes nn.MultiheadAttention's native fast path, the captured graph the composite one"
)
NN_ENCODER_FAST_PATH = (
    "the layers run PyTorch's fused encoder-layer op (torch._transformer_encoder_layer_fwd, nn's eval fas"
    't path) in the captured graph: their 4 norms are inside it, only the final norm is a site; the eager'
    ' count (a TorchFunctionMode, which turns the fast path off) sees all 5'
)
NN_DECODER_MHA_PATH = (
    "outputs within tolerance, not bit-identical: eager takes nn.MultiheadAttention's native fast path, t"
    'he captured graph the composite one'
)

XT_NORMALIZE = ("x-transformers' RMSNorm / ScaleNorm / SimpleRMSNorm are F.normalize(x, dim=-1) * sqrt(d) * g: "
                "the l2_norm call (eps clamps the row's L2 norm)")

HYPER_CONNECTIONS = (
    "hyper-connections: each block's norm reads a weighted sum of 4 residual streams ((pre * streams).sum(dim=2)), "
    "fused alone with that reason, and the norm over the flattened streams reads the mixed streams through a view "
    "that merges the stream and hidden dims (fused alone, with its reason); the eager count does not follow either"
)

EXPECTED = {
    # --- encoder
    "hf:bert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:roberta": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:albert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:distilbert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:electra": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:deberta": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=False,
        note=(
        "DebertaLayerNorm computes (x - mean) twice, seen as one value; the fused op reduces the row in "
        "another order than the written-out mean and variance: within the tolerance rule")),
    "hf:deberta-v2": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:xlm-roberta": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:camembert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:mpnet": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:ernie": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:roformer": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:convbert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:megatron-bert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:esm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:data2vec-text": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:rembert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:modernbert": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:roberta-prelayernorm": dict(norms=6, fused=6, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "pre": 4, "standalone": 1},
        eager_norms=6, eager_input_is_add=5, check="ok", checked_sites=6, bitwise=True),
    "hf:xlm-roberta-xl": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:mobilebert": dict(norms=0, fused=0, fused_with_add=0, input_is_add=0, placements={},
        eager_norms=0, eager_input_is_add=0, check="ok", checked_sites=0, bitwise=True),
    "hf:nomic_bert": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"embedding": 1, "post": 4},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:eurobert": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:esmc": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True,
        note=(
        "open: the q/k norms are bias-free LayerNorms over all heads (hidden_size), each followed by .to(dtype), "
        "the view to heads, the transpose and HF's rotate_half RoPE: fused as norms, no RoPE found after them")),
    # --- decoder
    "hf:gpt2": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:gpt_neo": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:gptj": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=True),
    "hf:gpt_neox": dict(norms=5, fused=5, fused_with_add=3, input_is_add=3, placements={"parallel": 4, "pre": 1},
        eager_norms=5, eager_input_is_add=3, check="ok", checked_sites=5, bitwise=True),
    "hf:llama": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:mistral": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:qwen2": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:qwen3": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:phi": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=True),
    "hf:phi3": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:gemma": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:gemma2": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "sandwich": 4, "standalone": 1},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:gemma3_text": dict(norms=13, fused=13, fused_with_add=4, input_is_add=4, placements={"pre": 4, "sandwich": 4, "standalone": 5},
        eager_norms=13, eager_input_is_add=4, check="ok", checked_sites=13, bitwise=True, rope=4, fused_rope=4),
    "hf:falcon": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=True),
    "hf:bloom": dict(norms=6, fused=6, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 2},
        eager_norms=6, eager_input_is_add=4, check="ok", checked_sites=6, bitwise=True),
    "hf:opt": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=1, check="ok", checked_sites=5, bitwise=True,
        note=(
        "count: OPT flattens the stream (reshape(-1, d)) between the add and the final-layer norm; normfuse sees "
        "through the reshape, the simple eager count does not")),
    "hf:codegen": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=True),
    "hf:stablelm": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:starcoder2": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:olmo": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:olmo2": dict(norms=9, fused=9, fused_with_add=4, input_is_add=1, placements={"pre": 1, "res_post": 3, "sandwich": 1, "standalone": 4},
        eager_norms=9, eager_input_is_add=1, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:cohere": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=False,
        note=COHERE_LAYER_NORM),
    "hf:cohere2": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=False,
        note=COHERE_LAYER_NORM),
    "hf:granite": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:mpt": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:persimmon": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:biogpt": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:xglm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:ctrl": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True,
        note=(
        "open: the first norm reads (embeds + pos) + token_type_embeds where token_type_embeds is the int 0; "
        "normfuse does not take `x + 0` for the residual add (the real add sits behind it); the eager count does")),
    "hf:gpt_bigcode": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:helium": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:glm": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:glm4": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "sandwich": 4, "standalone": 1},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:nemotron": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:smollm3": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:exaone4": dict(norms=9, fused=9, fused_with_add=4, input_is_add=1, placements={"pre": 1, "res_post": 3, "sandwich": 1, "standalone": 4},
        eager_norms=9, eager_input_is_add=1, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:arcee": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:seed_oss": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:hunyuan_v1_dense": dict(norms=9, fused=9, fused_with_add=8, input_is_add=8, placements={"pre": 8, "standalone": 1},
        eager_norms=9, eager_input_is_add=8, check="ok", checked_sites=9, bitwise=True),
    "hf:ernie4_5": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:apertus": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:bitnet": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:openai-gpt": dict(norms=4, fused=4, fused_with_add=4, input_is_add=4, placements={"post": 4},
        eager_norms=4, eager_input_is_add=4, check="ok", checked_sites=4, bitwise=True),
    "hf:vaultgemma": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:diffllama": dict(norms=7, fused=7, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 3},
        eager_norms=7, eager_input_is_add=4, check="ok", checked_sites=7, bitwise=True),
    "hf:internlm3": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:flint": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=2, fused_rope=2),
    "hf:nanochat": dict(norms=10, fused=10, fused_with_add=8, input_is_add=8, placements={"pre": 8, "standalone": 2},
        eager_norms=10, eager_input_is_add=8, check="ok", checked_sites=10, bitwise=True),
    "hf:muse_glimmer_text": dict(norms=14, fused=14, fused_with_add=4, input_is_add=4, placements={"pre": 4, "sandwich": 4, "standalone": 6},
        eager_norms=14, eager_input_is_add=4, check="ok", checked_sites=14, bitwise=True, rope=2, fused_rope=2,
        note=(
        "one weightless qk_norm module normalizes q and k of each layer; q is multiplied by qk_scale_factor "
        "between its norm and its RoPE (a rounding the kernel does not make): q's norm is fused alone, its RoPE "
        "kept with that reason; k's norm is fused with its RoPE (2 of the 4 q/k sites)")),
    # --- moe
    "hf:mixtral": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:qwen2_moe": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:qwen3_moe": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:olmoe": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:granitemoe": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:jetmoe": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4,
        placements={"embedding": 1, "pre": 3, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True,
        note=(
        "open: a graph break in every block: JetMoeTopKGating calls expert_size.tolist() (data-dependent Python "
        "ints), which dynamo does not trace by default (capture_scalar_outputs=False); dynamo captures graphs per "
        "block's code and runs them for both layers: the report lists each layer's norms under its own path. The "
        "residual pair carried across the blocks (cross_block) brings the add that ends a block into the next "
        "block's graph (block 1's input_layernorm) and into the final norm's graph (that add reads two graph "
        "inputs, so it is classified 'embedding'). Under torch._dynamo.config.patch(capture_scalar_outputs=True) "
        "the model is one graph and normfuse fuses 5/5, 4 with their add, bit-identical")),
    "hf:phimoe": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:ernie4_5_moe": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:gpt_oss": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:dots1": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:glm4_moe": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:llama4_text": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True,
        note=(
        "count: Llama4TextL2Norm (x * rsqrt(mean(x^2) + eps), no weight) is not named a norm, so the eager count "
        "misses its 4 q/k calls; normfuse finds and fuses them. Its RoPE (the complex form) runs before the norm: "
        "no RoPE after the q/k norms to fuse")),
    "hf:minimax_m2": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:afmoe": dict(norms=13, fused=13, fused_with_add=5, input_is_add=5, placements={"pre": 5, "sandwich": 3, "standalone": 5},
        eager_norms=13, eager_input_is_add=5, check="ok", checked_sites=13, bitwise=True, rope=4, fused_rope=4),
    "hf:laguna": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True, rope=4, fused_rope=4),
    "hf:inkling_text": dict(norms=10, fused=10, fused_with_add=4, input_is_add=6, placements={"pre": 6, "standalone": 4},
        eager_norms=10, eager_input_is_add=4, check="ok", checked_sites=10, bitwise=False,
        note=(
        "k goes through a short conv with its own residual (conv(k) + k, fp32) before the view to heads: normfuse "
        "takes that add for the k_norm's input (the eager count does not follow the view) and leaves it out of the "
        "call, the view moving the normalized dim; no RoPE (relative logits). Outputs within tolerance, not "
        "bit-identical: dynamo's graph differs from eager without normfuse too (backend='eager': max 1.2e-07)")),
    "hf:deepseek_v4": dict(norms=16, fused=16, fused_with_add=0, input_is_add=8, placements={"pre": 8, "standalone": 8},
        eager_norms=16, eager_input_is_add=0, check="ok", checked_sites=16, bitwise=True, note=HYPER_CONNECTIONS + (
        "; the eager count includes the two compressor kv_norms, which run in a frame dynamo skips (listed as not "
        "captured), and not the unweighted norms over the flattened streams (no module of a known norm class)")),
    "hf:hy_v4": dict(norms=16, fused=11, fused_with_add=0, input_is_add=5, placements={"pre": 5, "standalone": 11},
        eager_norms=16, eager_input_is_add=0, check="ok", checked_sites=11, bitwise=True, note=HYPER_CONNECTIONS + (
        "; its 5 hyper-connection norms (HYV4UnweightedRMSNorm) return rsqrt(mean(x^2) + eps) alone, which "
        "scales linear(x): listed with that reason, nothing to fuse")),
    "hf:glm5_next_text": dict(norms=11, fused=11, fused_with_add=0, input_is_add=7, placements={"pre": 7, "standalone": 4},
        eager_norms=11, eager_input_is_add=0, check="ok", checked_sites=11, bitwise=True, gated=2, fused_gate=2,
        note=HYPER_CONNECTIONS),
    # --- hybrid
    "hf:jamba": dict(norms=8, fused=8, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 4},
        eager_norms=8, eager_input_is_add=4, check="ok", checked_sites=8, bitwise=False,
        note=ASSOCIATIVE_SCAN),
    "hf:bamba": dict(norms=6, fused=6, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 2},
        eager_norms=6, eager_input_is_add=4, check="ok", checked_sites=6, bitwise=True),
    "hf:falcon_h1": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:mamba": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=False,
        note=ASSOCIATIVE_SCAN),
    "hf:mamba2": dict(norms=5, fused=5, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 3},
        eager_norms=5, eager_input_is_add=2, check="ok", checked_sites=5, bitwise=True, gated=2, fused_gate=2),
    "hf:nemotron_h": dict(norms=6, fused=6, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 2},
        eager_norms=6, eager_input_is_add=4, check="ok", checked_sites=6, bitwise=True, gated=1, fused_gate=1),
    "hf:qwen3_next": dict(norms=7, fused=7, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 3},
        eager_norms=7, eager_input_is_add=4, check="ok", checked_sites=7, bitwise=True, gated=2, fused_gate=2),
    "hf:recurrent_gemma": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:lfm2": dict(norms=7, fused=7, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 3},
        eager_norms=7, eager_input_is_add=4, check="ok", checked_sites=7, bitwise=True, rope=2, fused_rope=2),
    "hf:lfm2_moe": dict(norms=7, fused=7, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 3},
        eager_norms=7, eager_input_is_add=4, check="ok", checked_sites=7, bitwise=True, rope=2, fused_rope=2),
    "hf:rwkv": dict(norms=6, fused=6, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 2},
        eager_norms=6, eager_input_is_add=4, check="ok", checked_sites=6, bitwise=True),
    # --- encoder-decoder
    "hf:t5": dict(norms=12, fused=12, fused_with_add=10, input_is_add=10, placements={"pre": 10, "standalone": 2},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=12, bitwise=True),
    "hf:bart": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"embedding": 2, "post": 10},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:mbart": dict(norms=14, fused=14, fused_with_add=12, input_is_add=12, placements={"embedding": 2, "pre": 10, "standalone": 2},
        eager_norms=14, eager_input_is_add=12, check="ok", checked_sites=14, bitwise=True),
    "hf:pegasus": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"pre": 12},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:marian": dict(norms=10, fused=10, fused_with_add=10, input_is_add=10, placements={"post": 10},
        eager_norms=10, eager_input_is_add=10, check="ok", checked_sites=10, bitwise=True),
    "hf:blenderbot": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"pre": 12},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:blenderbot-small": dict(norms=12, fused=12, fused_with_add=11, input_is_add=11, placements={"embedding": 1, "post": 10, "standalone": 1},
        eager_norms=12, eager_input_is_add=11, check="ok", checked_sites=12, bitwise=True),
    "hf:mt5": dict(norms=12, fused=12, fused_with_add=10, input_is_add=10, placements={"pre": 10, "standalone": 2},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=12, bitwise=True),
    "hf:umt5": dict(norms=12, fused=12, fused_with_add=10, input_is_add=10, placements={"pre": 10, "standalone": 2},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=12, bitwise=True),
    "hf:longt5": dict(norms=12, fused=12, fused_with_add=6, input_is_add=6, placements={"pre": 6, "standalone": 6},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=12, bitwise=True,
        note=(
        "open: transformers' LongT5Stack builds the all-ones attention mask only outside dynamo (`if attention_mask "
        "is None and not is_torchdynamo_compiling()`), then _split_into_blocks reads None.shape: dynamo cannot "
        "trace the stack's forward, runs it eagerly and captures each block (one graph per block's code, run for "
        "both layers: the report lists each layer's norms under its own path) and the final norm on its own; the "
        "blocks return tuples, so the stream is not regrouped and the adds that end one graph cannot fold into the "
        "norm that starts the next. Passing attention_mask gives one graph")),
    "hf:plbart": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"deepnorm": 1, "embedding": 1, "post": 10},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:m2m_100": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"deepnorm": 2, "post": 2, "pre": 8},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:led": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"embedding": 2, "post": 10},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    "hf:switch_transformers": dict(norms=12, fused=12, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 8},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=12, bitwise=True,
        note=(
        "open: a graph break in each block with experts: SwitchTransformersExperts loops over "
        "greater(...).nonzero() (a Python loop over a data-dependent number of experts, which dynamo cannot "
        "capture even with capture_dynamic_output_shape_ops); dynamo captures one graph per block's code and runs "
        "it for both layers (the report lists each layer's norms under its own path); the blocks return tuples, "
        "so the stream is not regrouped and the adds that end one graph cannot fold into the norm that starts "
        "the next")),
    "hf:fsmt": dict(norms=10, fused=10, fused_with_add=10, input_is_add=10, placements={"post": 10},
        eager_norms=10, eager_input_is_add=10, check="ok", checked_sites=10, bitwise=True),
    "hf:whisper": dict(norms=12, fused=12, fused_with_add=12, input_is_add=12, placements={"pre": 12},
        eager_norms=12, eager_input_is_add=12, check="ok", checked_sites=12, bitwise=True),
    # --- vision
    "hf:vit": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:deit": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:beit": dict(norms=5, fused=5, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 2},
        eager_norms=5, eager_input_is_add=3, check="ok", checked_sites=5, bitwise=True),
    "hf:data2vec-vision": dict(norms=4, fused=4, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 1},
        eager_norms=4, eager_input_is_add=3, check="ok", checked_sites=4, bitwise=True),
    "hf:dinov2": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:vit_msn": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:ijepa": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "hf:vit_mae": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:swin": dict(norms=7, fused=7, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 4},
        eager_norms=7, eager_input_is_add=3, check="ok", checked_sites=7, bitwise=True),
    "hf:swinv2": dict(norms=7, fused=7, fused_with_add=4, input_is_add=1, placements={"pre": 1, "res_post": 3, "sandwich": 1, "standalone": 2},
        eager_norms=7, eager_input_is_add=1, check="ok", checked_sites=7, bitwise=True),
    "hf:donut-swin": dict(norms=6, fused=6, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 4},
        eager_norms=6, eager_input_is_add=2, check="ok", checked_sites=6, bitwise=True),
    "hf:convnext": dict(norms=5, fused=5, fused_with_add=1, input_is_add=1, placements={"pre": 1, "standalone": 4}, eager_norms=5, eager_input_is_add=0, check="ok", checked_sites=5, bitwise=True,
        note=CHANNEL_NORMS),
    "hf:convnextv2": dict(norms=5, fused=5, fused_with_add=1, input_is_add=1, placements={"pre": 1, "standalone": 4}, eager_norms=5, eager_input_is_add=0, check="ok", checked_sites=5, bitwise=True,
        note=CHANNEL_NORMS),
    "hf:segformer": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:pvt_v2": dict(norms=9, fused=9, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 5},
        eager_norms=9, eager_input_is_add=4, check="ok", checked_sites=9, bitwise=True),
    "hf:dinov2_with_registers": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:siglip_vision_model": dict(norms=6, fused=6, fused_with_add=5, input_is_add=5, placements={"pre": 5, "standalone": 1},
        eager_norms=6, eager_input_is_add=5, check="ok", checked_sites=6, bitwise=True),
    "hf:clip_vision_model": dict(norms=6, fused=6, fused_with_add=4, input_is_add=4, placements={"embedding": 1, "pre": 3, "standalone": 2},
        eager_norms=6, eager_input_is_add=4, check="ok", checked_sites=6, bitwise=True),
    "hf:dinov3_vit": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "hf:focalnet": dict(norms=7, fused=7, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 4},
        eager_norms=7, eager_input_is_add=3, check="ok", checked_sites=7, bitwise=True),
    "hf:vitdet": dict(norms=4, fused=4, fused_with_add=4, input_is_add=4, placements={"pre": 4},
        eager_norms=4, eager_input_is_add=2, check="ok", checked_sites=4, bitwise=True,
        note="a block ends with (x + mlp).permute(0, 3, 1, 2), the next begins with .permute(0, 2, 3, 1): the pass "
             "sees the inverse permutes cancel and fuses that add; the eager count does not follow an add through "
             "a permute"),
    "hf:videoprism_vision": dict(norms=10, fused=10, fused_with_add=10, input_is_add=10, placements={"pre": 10},
        eager_norms=10, eager_input_is_add=10, check="ok", checked_sites=10, bitwise=True,
        note="two block lists in one forward (spatial, then temporal layers); each list's first norm reads an "
             "embedding add that broadcasts (the call reads the table every S rows)"),
    "timm:vit_tiny_patch16_224": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "timm:deit_tiny_patch16_224": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "timm:eva02_tiny_patch14_224": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=5, bitwise=True),
    "timm:cait_xxs24_224": dict(norms=7, fused=7, fused_with_add=5, input_is_add=5, placements={"pre": 5, "standalone": 2},
        eager_norms=7, eager_input_is_add=5, check="ok", checked_sites=7, bitwise=True),
    "timm:swin_tiny_patch4_window7_224": dict(norms=7, fused=7, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 4},
        eager_norms=7, eager_input_is_add=0, check="ok", checked_sites=7, bitwise=True,
        note=(
        "count: timm's Swin reshapes the stream between the add and the next norm; normfuse sees through the "
        "reshape, the simple eager count does not")),
    "timm:convnext_atto": dict(norms=9, fused=9, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 6}, eager_norms=9, eager_input_is_add=0, check="ok", checked_sites=9, bitwise=True,
        note=CHANNEL_NORMS),
    "timm:convnextv2_atto": dict(norms=9, fused=9, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 6}, eager_norms=9, eager_input_is_add=0, check="ok", checked_sites=9, bitwise=True,
        note=CHANNEL_NORMS),
    "timm:coatnet_nano_rw_224": dict(norms=19, fused=19, fused_with_add=19, input_is_add=19, placements={"pre": 19}, eager_norms=19, eager_input_is_add=0, check="ok", checked_sites=19, bitwise=False,
        note=CHANNEL_NORMS + "; outputs within tolerance (1.0e-6 of 2.2), bit-identical to eager with torch's "
             "default thread count but not with one thread per process (as the suite runs); every site 0 ulp"),
    "timm:maxvit_tiny_tf_224": dict(norms=17, fused=17, fused_with_add=16, input_is_add=16, placements={"pre": 16, "standalone": 1}, eager_norms=17, eager_input_is_add=12, check="ok", checked_sites=17, bitwise=False,
        note=MAXVIT_CHANNEL_NORMS),
    "timm:mobilenetv5_300m_enc": dict(norms=184, fused=184, fused_with_add=32, input_is_add=32,
        placements={"pre": 32, "res_post": 2, "standalone": 150}, eager_norms=29, eager_input_is_add=0, check="ok",
        checked_sites=184, bitwise=False,
        note="gemma3n's vision tower: timm RmsNorm2d / RmsNormAct2d, norms written out over dim 1 of NCHW, all "
             "found and fused (before: 0 sites, no note); the eager count's class-name rule does not match "
             "RmsNormAct2d (29 of 184) nor follow an add through the channel permute; outputs within tolerance, "
             "not bit-identical"),
    "timm:edgenext_xx_small": dict(norms=20, fused=20, fused_with_add=7, input_is_add=7, placements={"pre": 7, "standalone": 13}, eager_norms=20, eager_input_is_add=1, check="ok", checked_sites=20, bitwise=True,
        note=CHANNEL_NORMS),
    "timm:efficientformer_l1": dict(norms=3, fused=3, fused_with_add=2, input_is_add=2, placements={"pre": 2, "standalone": 1},
        eager_norms=3, eager_input_is_add=2, check="ok", checked_sites=3, bitwise=True),
    "timm:levit_128s": dict(norms=0, fused=0, fused_with_add=0, input_is_add=0, placements={},
        eager_norms=0, eager_input_is_add=0, check="ok", checked_sites=0, bitwise=True),
    "timm:beit_base_patch16_224": dict(norms=5, fused=5, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 2},
        eager_norms=5, eager_input_is_add=3, check="ok", checked_sites=5, bitwise=True),
    "tv:vit": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "tv:swin_t": dict(norms=7, fused=7, fused_with_add=3, input_is_add=3, placements={"pre": 3, "standalone": 4},
        eager_norms=7, eager_input_is_add=3, check="ok", checked_sites=7, bitwise=True),
    "tv:swin_v2_t": dict(norms=7, fused=7, fused_with_add=4, input_is_add=1, placements={"pre": 1, "res_post": 3, "sandwich": 1, "standalone": 2},
        eager_norms=7, eager_input_is_add=1, check="ok", checked_sites=7, bitwise=True),
    "tv:convnext": dict(norms=5, fused=5, fused_with_add=1, input_is_add=1, placements={"pre": 1, "standalone": 4}, eager_norms=5, eager_input_is_add=0, check="ok", checked_sites=5, bitwise=True,
        note=CHANNEL_NORMS),
    "tv:maxvit": dict(norms=5, fused=5, fused_with_add=2, input_is_add=3, placements={"pre": 3, "standalone": 2},
        eager_norms=5, eager_input_is_add=2, check="ok", checked_sites=5, bitwise=True,
        note="the window attention's norm reads the MBConv's add through its window partition (a view that moves "
             "the normalized dim): an add-fed site with that reason, which the eager count (no reshape) does not "
             "see"),
    # --- torch.nn
    "nn:transformer_post": dict(norms=8, fused=8, fused_with_add=6, input_is_add=6, placements={"post": 6, "standalone": 2},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=8, bitwise=False,
        note=NN_TRANSFORMER_FAST_PATH),
    "nn:transformer_pre": dict(norms=8, fused=8, fused_with_add=6, input_is_add=6, placements={"pre": 6, "standalone": 2},
        eager_norms=12, eager_input_is_add=10, check="ok", checked_sites=8, bitwise=False,
        note=NN_TRANSFORMER_FAST_PATH),
    "nn:encoder_post": dict(norms=1, fused=1, fused_with_add=0, input_is_add=0, placements={"standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=1, bitwise=True,
        note=NN_ENCODER_FAST_PATH),
    "nn:encoder_pre": dict(norms=1, fused=1, fused_with_add=0, input_is_add=0, placements={"standalone": 1},
        eager_norms=5, eager_input_is_add=4, check="ok", checked_sites=1, bitwise=True,
        note=NN_ENCODER_FAST_PATH),
    "nn:decoder_post": dict(norms=7, fused=7, fused_with_add=6, input_is_add=6, placements={"post": 6, "standalone": 1},
        eager_norms=7, eager_input_is_add=6, check="ok", checked_sites=7, bitwise=False,
        note=NN_DECODER_MHA_PATH),
    "nn:decoder_pre": dict(norms=7, fused=7, fused_with_add=6, input_is_add=6, placements={"pre": 6, "standalone": 1},
        eager_norms=7, eager_input_is_add=6, check="ok", checked_sites=7, bitwise=False,
        note=NN_DECODER_MHA_PATH),
    # --- x-transformers 2.31.10 (TransformerWrapper, 2 layers of dim 32): the first norm reads
    # token + position embeddings, an add that broadcasts ((B, S, C) + (S, C)), folded into its call
    "xt:decoder_pre": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "xt:encoder_post": dict(norms=4, fused=4, fused_with_add=4, input_is_add=4, placements={"post": 4},
        eager_norms=4, eager_input_is_add=4, check="ok", checked_sites=4, bitwise=True),
    "xt:sandwich": dict(norms=9, fused=9, fused_with_add=5, input_is_add=5, placements={"pre": 5, "sandwich": 4},
        eager_norms=9, eager_input_is_add=5, check="ok", checked_sites=9, bitwise=True),
    "xt:rmsnorm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True, note=XT_NORMALIZE),
    "xt:scalenorm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=0, eager_input_is_add=0, check="ok", checked_sites=5, bitwise=True,
        note=XT_NORMALIZE + "; the eager count does not take the class name ScaleNorm for a norm"),
    "xt:simple_rmsnorm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True, note=XT_NORMALIZE),
    "xt:scale_residual": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True),
    "xt:gate_residual": dict(norms=5, fused=5, fused_with_add=1, input_is_add=1, placements={"pre": 1, "standalone": 4},
        eager_norms=5, eager_input_is_add=1, check="ok", checked_sites=5, bitwise=True, note=(
        "the GRU-gated residual is no add: the blocks' norms read the gate's output (standalone)")),
    "xt:qk_norm": dict(norms=5, fused=5, fused_with_add=5, input_is_add=5, placements={"pre": 5},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True, note=(
        "the q/k norms are l2norm (F.normalize times a learned scale, no sqrt(d)): a cosine normalization, as "
        "in Swin v2's attention, not a norm site")),
    "xt:rotary": dict(norms=5, fused=5, fused_with_add=4, input_is_add=4, placements={"pre": 4, "standalone": 1},
        eager_norms=5, eager_input_is_add=5, check="ok", checked_sites=5, bitwise=True, note=(
        "no absolute positions: the first norm reads the token embedding plus a Python 0 (the eager count "
        "takes x + 0 for an add, the graph holds no tensor add): standalone")),
    "xt:hyper_connections": dict(norms=9, fused=9, fused_with_add=0, input_is_add=7,
        placements={"pre": 7, "standalone": 2}, eager_norms=9, eager_input_is_add=0, check="ok", checked_sites=9,
        bitwise=True, note=(
        "hyper-connections (num_residual_streams=4): each branch norm reads an einsum over the 4 streams, fused "
        "alone with that reason; the residual's own norms read the streams' sum through a view that moves the "
        "normalized dim (with its reason); the first norm (embedding with positions) and the final norm (a plain "
        "sum of the streams over the last dim after a permute) are standalone; the eager count follows neither")),
}

# the default test run's share of the zoo: one or two of every group, and known findings
FAST = [
    "hf:llama",
    "hf:bert",
    "hf:gemma2",
    "hf:gpt_neox",
    "hf:deberta",
    "hf:cohere",
    "hf:mixtral",
    "hf:pegasus",
    "hf:lfm2",
    "hf:vit",
    "tv:swin_v2_t",
    "timm:deit_tiny_patch16_224",
    "nn:encoder_pre",
    "nn:decoder_post",
    "xt:decoder_pre",
]
