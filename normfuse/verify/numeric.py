"""Numeric checking: rewritten vs original vs an fp64 reference of the original.

Whole model: run the original, the rewritten and an fp64 copy of the original (every
in-graph cast redirected to fp64) on the same inputs, forward and backward, and apply
the project's rule (``normfuse.tolerances.within_tolerance``) to every output and
gradient.

Per site: evaluate each fused call on the values that reached its original subgraph
in a run of the original graph, and hold it to that subgraph on three counts:
- same dtype and shape as the value it replaced;
- the accuracy rule against the subgraph evaluated in fp64 (catches changed math);
- the rounding budget of ``normfuse.tolerances.ROUNDING_BUDGET`` against the subgraph in
  its own dtype: a faithful rewrite differs only where the order of the row reduction
  flips a rounding (catches a moved or dropped rounding point). An fp32 output has no ulp
  budget; when its subgraph rounds to a narrower dtype on the way (autocast's fp32 norm of a
  bf16 sum), it is held to the rule against the fp64 evaluation that keeps those rounding
  points instead (``ROUNDED_REFERENCE_BUDGET``), which a dropped rounding breaks.

A norm the capture recorded under CUDA autocast (fp32 out of a 16-bit input) is evaluated
with autocast's fp32 policy on any device (``find.autocast_upcast``), so such graphs are
checked on CPU too.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode

from normfuse.passes.canonical import canonical, mutates, node_shape
from normfuse.passes.find import autocast_upcast
from normfuse.passes.graph import copy_graph_module  # noqa: F401  (one graph copy for the project)
from normfuse.passes.parts import PARTS
from normfuse.passes.record import runnable_target
from normfuse.tolerances import ROUNDED_REFERENCE_BUDGET, rounding_budget, within_tolerance
from normfuse.verify.sites import SitePair
from normfuse.vocabulary import LOW_PRECISION

__all__ = ["Fp64Mode", "grouped_mm_fp64", "fp64_copy", "model_copy", "tensors_with_history", "perturb_vectors", "to_fp64", "flatten", "OutputCheck", "failed_output", "compare", "ulp_diff",
           "run_graph", "copy_graph_module", "SiteNumeric", "check_site"]

F64 = torch.float64


# --------------------------------------------------------------------------- fp64 reference

def _widen(value: Any) -> Any:
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return F64
    return value


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(e) for e in offs.tolist()]
    return list(zip([0] + ends[:-1], ends))


def grouped_mm_fp64(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """``torch._grouped_mm`` for fp64 operands, which its kernels do not take (MoE experts):
    the same products, group by group, each one fp64 matmul; differentiable, so the
    reference's backward runs through it too.

    The layouts of ``torch._grouped_mm``: 3D x 3D is a batch of products; with ``offs`` the
    2D operand is cut into groups along its rows (2D x 3D), columns (3D x 2D) or the
    shared dim (2D x 2D, one output per group). Rows and columns past ``offs[-1]``, which
    the kernel leaves unwritten, are zeros here."""
    if offs is None:
        return torch.matmul(mat_a, mat_b)
    bounds = _group_bounds(offs)
    if mat_a.dim() == 2 and mat_b.dim() == 3:
        rows = [mat_a[s:e] @ mat_b[g] for g, (s, e) in enumerate(bounds)]
        rows.append(mat_a.new_zeros(mat_a.shape[0] - bounds[-1][1], mat_b.shape[-1]))
        return torch.cat(rows, dim=0)
    if mat_a.dim() == 3 and mat_b.dim() == 2:
        cols = [mat_a[g] @ mat_b[:, s:e] for g, (s, e) in enumerate(bounds)]
        cols.append(mat_a.new_zeros(mat_a.shape[1], mat_b.shape[1] - bounds[-1][1]))
        return torch.cat(cols, dim=1)
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return torch.stack([mat_a[:, s:e] @ mat_b[s:e] for s, e in bounds])
    raise ValueError(f"grouped mm of a {mat_a.dim()}D and a {mat_b.dim()}D operand with offs")


class Fp64Mode(TorchFunctionMode):
    """Redirects every cast to a floating dtype (and every ``dtype=`` of a float) to fp64.

    ``.to(bf16)``, ``.float()``, ``.half()``, ``.type(...)``, ``.type_as(t)`` and
    ``torch.zeros(..., dtype=torch.float32)`` all produce fp64, so a model copied to
    fp64 computes in fp64 everywhere, including where its code rounds on purpose.
    Inside the mode the default dtype is fp64 too: a tensor made from a Python float
    without a dtype (``torch.full((), torch.finfo(x.dtype).min)``, ``torch.tensor(0.5)``)
    is fp64, as it is fp32 next to fp32 tensors in the original run.
    """

    _TO_DOUBLE = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
    # ops with no fp64 kernel, computed in fp64 another way (exactly the same math)
    _GROUPED_MM = {torch._grouped_mm, torch.ops.aten._grouped_mm, torch.ops.aten._grouped_mm.default}

    def __enter__(self):
        self.__dict__.setdefault("_defaults", []).append(torch.get_default_dtype())  # one per entry
        torch.set_default_dtype(F64)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.set_default_dtype(self._defaults.pop())
        return super().__exit__(*exc)

    @staticmethod
    def grad(outputs: list, inputs: list, grad_outputs: list) -> tuple:
        """``torch.autograd.grad(..., allow_unused=True)`` with this mode on in backward.

        A mode is off inside its own handler, and ``torch.autograd.grad`` is a function it
        handles: checkpointed regions, which recompute their forward in backward, would
        recompute in the model's dtypes. The engine call below is not dispatched, so a mode
        entered around it stays on (autograd carries it into backward)."""
        from torch.autograd.graph import _engine_run_backward
        return _engine_run_backward(tuple(outputs), tuple(grad_outputs), False, False, tuple(inputs), True,
                                    accumulate_grad=False)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._TO_DOUBLE:
            return args[0].double()
        if func is torch.Tensor.type_as or (func is torch.Tensor.to and args[1:2] and
                                             isinstance(args[1], torch.Tensor)):
            other = args[1]
            if other.dtype.is_floating_point and args[0].dtype.is_floating_point:
                return args[0].to(F64)
            return func(*args, **kwargs)
        if func is torch.Tensor.type and (args[1:2] or "dtype" in kwargs):
            target = args[1] if args[1:2] else kwargs["dtype"]
            if isinstance(target, str):
                target = getattr(torch, target.split(".")[-1].replace("Tensor", "").lower() or "float", None)
            if isinstance(target, torch.dtype) and target.is_floating_point:
                return args[0].to(F64)
        if "dtype" in kwargs:
            kwargs["dtype"] = _widen(kwargs["dtype"])
        args = tuple(_widen(a) for a in args)
        if func in self._GROUPED_MM and args[0].dtype == F64 and kwargs.get("bias") is None:
            return grouped_mm_fp64(args[0], args[1], args[2] if args[2:] else kwargs.get("offs"))
        return func(*args, **kwargs)


def to_fp64(value: Any) -> Any:
    """Floating tensors (in any nesting of tuples, lists, dicts) to fp64; the rest as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(F64) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(to_fp64(v) for v in value) if not hasattr(value, "_fields") else \
            type(value)(*(to_fp64(v) for v in value))
    if isinstance(value, dict):
        return {k: to_fp64(v) for k, v in value.items()}
    return value


def _with_history(value: Any, path: str, found: dict[str, torch.Tensor], depth: int = 0) -> None:
    """The tensors with autograd history (not graph leaves) in a module attribute, through
    dicts, lists and tuples: what ``copy.deepcopy`` refuses to copy."""
    if isinstance(value, torch.Tensor):
        if value.grad_fn is not None:
            found[path] = value
    elif depth < 4 and isinstance(value, Mapping):
        for k, v in value.items():
            _with_history(v, f"{path}[{k!r}]", found, depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _with_history(v, f"{path}[{i}]", found, depth + 1)


def tensors_with_history(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Module attributes and buffers holding tensors with autograd history, by path: caches
    computed from parameters (timm's EfficientFormer and LeViT keep ``table[idx]`` in eval mode)."""
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if name not in ("_parameters", "_modules"):
                _with_history(value, f"{prefix}.{name}".lstrip("."), found)
    return found


def model_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``copy.deepcopy(model)`` that also works on a model holding tensors with autograd history:
    the copy holds detached copies of their values (no gradient flows through them)."""
    memo = {id(t): t.detach().clone() for t in tensors_with_history(model).values()}
    return copy.deepcopy(model, memo)


def fp64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` with every floating parameter and buffer in fp64, and every complex
    one in complex128 (``Module.to(torch.float64)`` would drop the imaginary part of a complex
    buffer: torchtitan's ``freqs_cis``)."""
    return model_copy(model)._apply(
        lambda t: t.to(torch.complex128) if t.is_complex() else t.to(F64) if t.is_floating_point() else t)


def perturb_vectors(model: torch.nn.Module, scale: float = 0.1, seed: int = 0) -> torch.nn.Module:
    """Add ``scale * N(0, 1)`` noise to every 1-D floating parameter (norm weights and biases,
    linear biases), in place; returns the model.

    A model built from its config has norm weights of exactly 1 and biases of 0. With
    those, rounding ``n`` before or after ``* weight`` gives the same bits and a dropped
    Gemma offset only scales by 1 - so a checker would miss the faults that matter. Trained
    weights are never 1; this gives a freshly built model weights like them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1 and p.is_floating_point():
                noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * scale
                p.add_(noise.to(p.device, p.dtype))
    return model


# --------------------------------------------------------------------------- outputs

def flatten(value: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Named tensors of a model output: tensors, tuples, lists, dicts, ModelOutputs."""
    if isinstance(value, torch.Tensor):
        return [(prefix or "output", value)]
    items: list[tuple[str, torch.Tensor]] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            items += flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            items += flatten(v, f"{prefix}[{i}]")
    return items


def ulp_diff(candidate: torch.Tensor, baseline: torch.Tensor) -> tuple[float, float]:
    """(max, fraction of elements that differ) of |candidate - baseline| in ulps of baseline's dtype."""
    dtype = baseline.dtype
    if not dtype.is_floating_point or baseline.numel() == 0:
        return 0.0, 0.0
    c, b = candidate.to(dtype), baseline
    if dtype.itemsize == 1:  # fp8 has no nextafter: its ulp from the exponent, in fp64
        c, b = c.double(), b.double()
        info = torch.finfo(dtype)
        exponent = torch.floor(torch.log2(b.abs().clamp(min=info.smallest_normal)))
        ulp = torch.exp2(exponent) * info.eps
    else:
        ulp = (torch.nextafter(b.abs(), torch.full_like(b, float("inf"))) - b.abs()).double()
    finite = b.isfinite() & c.isfinite()
    diff = (c.double() - b.double()).abs()
    ulps = torch.where(finite, diff / ulp, torch.zeros_like(diff))
    differ = (c != b) & finite
    return float(ulps.max()), float(differ.double().mean())


@dataclass
class OutputCheck:
    """One output (or gradient) held to the rule ``err(new) <= m * err(original) + atol``."""

    name: str
    dtype: str
    shape: tuple
    max_abs: float            # max |new - fp64|
    max_rel: float            # max_abs / max |fp64|
    err_original: float       # max |original - fp64|
    tolerance: float          # the bound max_abs must stay under
    ratio: float              # max_abs / err_original (inf when the original is exact and new is not)
    ulp_max: float            # max |new - original| in ulps of the dtype
    mismatch: float           # fraction of elements where new != original
    passed: bool
    reason: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return d


def failed_output(name: str, reason: str, like: torch.Tensor | None = None) -> OutputCheck:
    """An output that cannot be compared at all (missing, wrong shape, ...)."""
    inf = float("inf")
    dtype, shape = (str(like.dtype), tuple(like.shape)) if like is not None else ("", ())
    return OutputCheck(name, dtype, shape, inf, inf, 0.0, 0.0, inf, inf, 1.0, False, reason)


def _ratio(err: float, base: float) -> float:
    if base > 0:
        return err / base
    return 0.0 if err == 0 else float("inf")


def compare(name: str, candidate: torch.Tensor, baseline: torch.Tensor, reference: torch.Tensor,
            fidelity: bool = False, rounded: torch.Tensor | None = None) -> OutputCheck:
    """The project rule for one tensor; ``fidelity`` adds the rounding budget (per-site checks).
    ``rounded``: the fp64 reference that keeps the original's narrow rounding points, which an
    output with no ulp budget (fp32) is held to (``ROUNDED_REFERENCE_BUDGET``)."""
    dtype = baseline.dtype
    reason = None
    if candidate.dtype != baseline.dtype:
        reason = f"dtype {candidate.dtype} where the original has {baseline.dtype}"
    if candidate.shape != baseline.shape:
        if candidate.numel() == baseline.numel():
            candidate = candidate.reshape(baseline.shape)
        else:
            return failed_output(name, f"shape {tuple(candidate.shape)} where the original has "
                                       f"{tuple(baseline.shape)}", baseline)
    ok, err_c, err_b, bound = within_tolerance(candidate.detach(), baseline.detach(), reference.detach(), dtype)
    ulp_max, mismatch = ulp_diff(candidate.detach(), baseline.detach())
    if reason is None and not ok:
        reason = f"error {err_c:.3g} over the bound {bound:.3g} (original's error {err_b:.3g})"
    if reason is None and fidelity:
        max_ulps, max_fraction = rounding_budget(dtype)
        if ulp_max > max_ulps or mismatch > max_fraction:
            reason = (f"rounds differently from the original: {mismatch:.1%} of elements differ, by up to "
                      f"{ulp_max:.3g} ulp (budget: {max_fraction:.1%}, {max_ulps:g} ulp)")
    if reason is None and fidelity and rounded is not None and rounding_budget(dtype)[1] >= 1.0:
        off = _off_rounded_reference(candidate.detach(), baseline.detach(), rounded.detach(), dtype)
        if off > ROUNDED_REFERENCE_BUDGET:
            reason = (f"rounds differently from the original: {off:.1%} of elements are further from the fp64 "
                      "evaluation that keeps the original's narrow rounding points than the rule allows (budget: "
                      f"{ROUNDED_REFERENCE_BUDGET:.1%})")
    mag = reference.detach().double().abs().max().item() if reference.numel() else 0.0
    return OutputCheck(name, str(dtype), tuple(baseline.shape), err_c, err_c / mag if mag > 0 else err_c, err_b,
                       bound, _ratio(err_c, err_b), ulp_max, mismatch, reason is None, reason)


def _off_rounded_reference(candidate: torch.Tensor, baseline: torch.Tensor, rounded: torch.Tensor,
                           dtype: torch.dtype) -> float:
    """The fraction of elements of ``candidate`` outside the rule's bound against ``rounded``
    (the bound from the baseline's largest error there); non-finite places are the rule's."""
    cand, base, ref = candidate.double().reshape(rounded.shape), baseline.double(), rounded.double()
    finite = ref.isfinite() & cand.isfinite() & base.isfinite()
    if not finite.any():
        return 0.0
    _, _, _, bound = within_tolerance(base, base, ref, dtype)
    return float(((cand - ref).abs()[finite] > bound).double().mean())


# --------------------------------------------------------------------------- graphs

def _upcast_16bit(value: Any) -> Any:
    """A 16-bit floating tensor (in any nesting of tuples, lists, dicts) as fp32; the rest as is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_PRECISION else value
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast_16bit(v) for v in value)
    if isinstance(value, dict):
        return {k: _upcast_16bit(v) for k, v in value.items()}
    return value


def _run_autocast_norm(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    """A norm the capture recorded under CUDA autocast (``find.autocast_upcast``), as autocast's
    fp32 policy runs it on any device: the 16-bit input, weight and bias cast to fp32 first (CPU
    autocast and no autocast at all keep the 16-bit dtype)."""
    args, kwargs = _upcast_16bit(args), _upcast_16bit(kwargs)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        state = {k: _upcast_16bit(v) for k, v in (*module.named_parameters(), *module.named_buffers())}
        return torch.func.functional_call(module, state, args, kwargs)
    return node.target(*args, **kwargs)


def _run_node(gm: fx.GraphModule, node: fx.Node, load: Callable[[Any], Any]) -> Any:
    args = fx.node.map_arg(node.args, load)
    kwargs = fx.node.map_arg(node.kwargs, load)
    if node.op in ("call_function", "call_module") and autocast_upcast(node):
        return _run_autocast_norm(gm, node, args, kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "get_attr":
        obj = gm
        for part in node.target.split("."):
            obj = getattr(obj, part)
        return obj
    raise ValueError(f"cannot evaluate node {node.name} ({node.op})")


def run_graph(gm: fx.GraphModule, args: list[Any], fp64: bool = False) -> tuple[Any, dict[fx.Node, Any]]:
    """Run ``gm`` node by node on ``args``; returns (output, every node's value).

    ``fp64``: floating inputs widened and every cast redirected to fp64 (the reference)."""
    env: dict[fx.Node, Any] = {}
    inputs = iter(to_fp64(list(args)) if fp64 else args)
    load = env.__getitem__
    mode = Fp64Mode() if fp64 else None
    with torch.no_grad(), (mode if mode is not None else contextlib.nullcontext()):
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                return fx.node.map_arg(node.args[0], load), env
            else:
                kept = _kept_before_mutation(node, env)
                env[node] = _run_node(gm, node, load)
                env.update(kept)
    return None, env


def _kept_before_mutation(node: fx.Node, env: dict[fx.Node, Any]) -> dict[fx.Node, Any]:
    """Inputs an in-place node overwrites that nothing else reads (``a += b`` where ``a`` is read
    only there): their values from before, for a fused call that reads ``a`` and ``b`` in place
    of the sum. Inputs with other readers keep the mutated value they have for those readers."""
    if not mutates(node):
        return {}
    return {a: env[a].clone() for a in node.all_input_nodes[:1]
            if isinstance(env.get(a), torch.Tensor) and list(a.users) == [node]}


# --------------------------------------------------------------------------- per site

@dataclass
class SiteNumeric:
    """A fused call evaluated on what reached its original subgraph."""

    outputs: list[OutputCheck] = field(default_factory=list)
    passed: bool = True
    reason: str | None = None
    given_mask: bool = False   # compared with the kernel's dropout mask replayed through the original
    compared: bool = True      # False: not compared with the original subgraph (``reason`` says why); not passed

    @classmethod
    def not_compared(cls, why: str) -> "SiteNumeric":
        """A site the check does not compare with its original subgraph, by design (a Post-Norm
        block converted to Pre-Norm, a residual stream widened): neither passed nor failed."""
        return cls(passed=False, reason=why, compared=False)

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "compared": self.compared, "reason": self.reason,
                "given_mask": self.given_mask, "outputs": [o.to_dict() for o in self.outputs]}


def _narrow(value: Any) -> torch.dtype | None:
    """The dtype of a floating tensor narrower than fp32 (a rounding point), else None."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype.itemsize < 4:
        return value.dtype
    return None


def _subgraph_values(gm: fx.GraphModule, pair: SitePair, env: dict[fx.Node, Any], fp64: bool,
                     replay: dict[fx.Node, Callable] | None = None, rounded: bool = False) -> dict:
    """Every node of the pair's original subgraph evaluated on ``env``; ``replay`` computes
    some nodes another way (a dropout with a given mask). ``rounded`` (with ``fp64``): each
    value the original run holds in a dtype narrower than fp32 is rounded to it, so the fp64
    evaluation keeps the original's rounding points (a bf16 sum, n rounded before the weight)."""
    values: dict[fx.Node, Any] = {}
    replay = replay or {}

    def load(node):
        if node in values:
            return values[node]
        value = env[node]
        return to_fp64(value) if fp64 else value

    mode = Fp64Mode() if fp64 else contextlib.nullcontext()
    with torch.no_grad(), mode:
        for node in pair.nodes:
            values[node] = replay[node](load) if node in replay else _run_node(gm, node, load)
            narrow = _narrow(env.get(node)) if rounded else None
            if narrow is not None and isinstance(values[node], torch.Tensor):
                with torch._C.DisableTorchFunction():  # Fp64Mode would widen the rounding cast
                    values[node] = values[node].to(narrow).to(values[node].dtype)
    return values


# The seed the per-site check hands a fused dropout (any fixed seed: the mask is replayed).
_CHECK_SEED = 20240607


def _call_arguments(pair: SitePair, env: dict[fx.Node, Any]) -> tuple[list, dict]:
    """The fused call's positional arguments and options, with the original run's values."""
    def value(a):
        return env.get(a, a) if isinstance(a, fx.Node) else a

    roles = list(pair.args)
    args = [value(pair.args[r]) for r in roles[:4]]
    if pair.layout is not None:  # the call reads x and residual permuted; its sum goes back permuted
        args[:2] = [a if a is None else a.permute(pair.layout) for a in args[:2]]
    for i, arg in enumerate(pair.call.args[:4]):  # an operand the rewrite reshaped for the kernel (OLMo 2's q)
        shape = node_shape(arg)
        if isinstance(args[i], torch.Tensor) and shape is not None and tuple(args[i].shape) != shape \
                and all(isinstance(d, int) for d in shape) and args[i].numel() == torch.Size(shape).numel():
            args[i] = args[i].reshape(shape)
    kwargs = dict(pair.call.kwargs)
    for role in roles[4:]:
        kwargs[role] = value(pair.args[role])
        node = pair.call.kwargs.get(role)
        if isinstance(kwargs[role], torch.Tensor) and kwargs[role].is_complex() and isinstance(node, fx.Node) \
                and node.op == "call_function":  # a part the rewrite took of a complex value (freqs_cis.real)
            kwargs[role] = node.target(kwargs[role], *node.args[1:], **node.kwargs)
            shape = node_shape(node)  # of the value padded with the leading dims broadcasting adds
            if shape is not None and len(shape) > kwargs[role].dim():
                kwargs[role] = kwargs[role].reshape((1,) * (len(shape) - kwargs[role].dim()) + kwargs[role].shape)
    for part in PARTS:
        part.check_arguments(kwargs, args[0])
    if kwargs.get("dropout_p"):
        kwargs["seed"] = torch.tensor(_CHECK_SEED)
    return args, kwargs


def _mask_replay(node: fx.Node, x: torch.Tensor, p: float) -> dict[fx.Node, Callable]:
    """The folded dropout computed as eager's dropout does (``input * mask * (1 / (1 - p))``)
    with the mask the kernel drew from the check's seed."""
    from normfuse.kernels import dropout_keep_mask

    keep = dropout_keep_mask(x, p, torch.tensor(_CHECK_SEED))

    def replay(load):
        inp = load(canonical(node)["input"])
        return inp * keep.to(inp.dtype) * (1.0 / (1.0 - p))

    return {node: replay}


def check_site(gm: fx.GraphModule, pair: SitePair, env: dict[fx.Node, Any]) -> SiteNumeric:
    """Hold one fused call to its original subgraph; ``env``: values of a run of the original graph.
    A call that draws dropout is held to the original subgraph given the kernel's mask."""
    result = SiteNumeric()
    if pair.problem:
        result.passed, result.reason = False, pair.problem
        return result
    args, kwargs = _call_arguments(pair, env)
    with torch.no_grad():
        got = runnable_target(pair.call.target)(*args, **kwargs)
    # outputs the rewrite permutes back (the sum of an add moved through a permute, a channel norm's y)
    got = tuple(g.permute(pair.permuted_back[i]) if i in pair.permuted_back and g is not None else g
                for i, g in enumerate(got))
    replay = {}
    dropout = pair.dropout
    if dropout is not None:
        replay = _mask_replay(dropout, args[0], kwargs["dropout_p"])
        result.given_mask = True
    ref = _subgraph_values(gm, pair, env, fp64=True, replay=replay)
    base = _subgraph_values(gm, pair, env, fp64=False, replay=replay) if replay else env
    rounds = any(_narrow(env.get(n)) for n in pair.nodes)
    rounded = _subgraph_values(gm, pair, env, fp64=True, replay=replay, rounded=True) if rounds else ref
    for k, orig in pair.outputs:
        if got[k] is None:
            result.outputs.append(failed_output(orig.name, f"the fused call returned no value for {orig.name}"))
            continue
        result.outputs.append(compare(orig.name, got[k], base[orig], ref[orig], fidelity=True,
                                      rounded=rounded[orig] if rounds else None))
    failed = [o for o in result.outputs if not o.passed]
    if failed:
        result.passed = False
        result.reason = "; ".join(f"{o.name}: {o.reason}" for o in failed)
    return result
