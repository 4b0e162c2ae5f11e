"""The words the project uses, each defined once.

Every module that names a norm kind, a placement, a form, a fused op, a dtype the
kernels take or a key it stores in ``node.meta`` imports it from here.
"""

from __future__ import annotations

from enum import StrEnum

import torch

__all__ = ["KINDS", "TORCH_NORMS", "Placement", "PLACEMENTS", "PRE_FAMILY", "POST_FAMILY", "LOW_PRECISION", "FINAL_NORM_NAME", "FORMS", "FUSED_OPS", "KERNEL_DTYPES", "CONVERTED_META", "FINAL_META",
           "GRAPH_META", "QUANT_DTYPES", "QUANT_SCALE_FORMS",
           "QUANT_APPLY", "QUANT_SCALE_OUT", "GATE_POSITIONS", "GATE_ACTIVATIONS", "COPY_FILE"]

# what a norm computes; l2_norm: F.normalize(x, dim=-1, eps) * sqrt(N), an RMSNorm whose eps clamps the
# row's L2 norm (x / max(||x||_2, eps) * sqrt(N)) instead of being added to the mean square
KINDS = ("layer_norm", "rms_norm", "l2_norm")
# torch's own norm modules (a norm call made by one is reported as the "module" form)
TORCH_NORMS = (torch.nn.LayerNorm, torch.nn.RMSNorm)

class Placement(StrEnum):
    """Where a norm sits on the residual stream (normfuse/passes/classify.py)."""

    PRE = "pre"
    POST = "post"
    RES_POST = "res_post"
    SANDWICH = "sandwich"
    PARALLEL = "parallel"
    DEEPNORM = "deepnorm"
    EMBEDDING = "embedding"
    STANDALONE = "standalone"


PLACEMENTS = tuple(p.value for p in Placement)
# placements whose residual stream passes through adds only (the Pre-Norm family), and those that
# normalize the stream itself (the Post-Norm family, which prenorm=True converts); embedding and
# standalone norms are neither
PRE_FAMILY = (Placement.PRE, Placement.RES_POST, Placement.SANDWICH, Placement.PARALLEL)
POST_FAMILY = (Placement.POST, Placement.DEEPNORM)

# how the graph spells it: a torch norm module, a functional call, an ATen op, or written
# out (the decomposed forms name their rounding order: llama rounds before the weight,
# gemma multiplies by 1 + w in fp32)
FORMS = ("module", "functional", "aten", "decomposed:layer_norm", "decomposed:rms_norm", "decomposed:llama",
         "decomposed:gemma", "normalize")  # normalize: F.normalize(x, dim=-1) (x / max(||x||_2, eps)), then a scale

# what a site becomes: the add before the norm folded in, the add after it, the norm alone, or
# (q and k norms) the norm with the rotary embedding after it
FUSED_OPS = ("add_norm", "norm_add", "norm", "qk_norm_rope")

# activation, weight and rounding dtypes the fused kernels take (fp64 runs on CPU only)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# the 16-bit ones: an upcast from them to fp32 is exact; a residual stream in them can be kept in fp32
LOW_PRECISION = (torch.float16, torch.bfloat16)

# node.meta / gm.meta keys of the Post-Norm -> Pre-Norm conversion
CONVERTED_META = "normfuse_converted"     # on the nodes of a converted norm: its fqn
FINAL_META = "normfuse_final_norm"        # on a final norm node: its fqn
FINAL_NORM_NAME = FINAL_META              # the attribute name of a final norm the conversion registers
GRAPH_META = "normfuse_prenorm"           # on the graph module: the streams converted in it
# node.meta key of the rewrite

# the quantization epilogue of add_norm (normfuse/kernels/reference.py): the fp8 dtypes it writes,
# how a dynamic scale is formed from the amax, how it is applied, and which scale is returned
QUANT_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANT_SCALE_FORMS = ("amax/max", "max/amax", "max*(1/amax)")
QUANT_APPLY = ("div", "mul", "mul_reciprocal")
QUANT_SCALE_OUT = ("scale", "reciprocal")

# the gated norms of add_norm (normfuse/kernels/reference.py): where the gate multiplies, and by what
GATE_POSITIONS = ("before", "after")
GATE_ACTIVATIONS = ("silu", "sigmoid")

# the file name of an edited copy of a function from a file dynamo does not trace (torch.nn's
# norms, given a residual pair): a name dynamo traces, from which the original path reads back
COPY_FILE = "<normfuse copy of {path}>"
