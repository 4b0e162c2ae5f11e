"""Audit a model: where its norms sit, which would fuse and why not, and what fusing is worth.

    rep = normfuse.audit(model, input_ids)          # the model is not changed
    print(rep); rep.to_html(); rep.to_json()

    $ normfuse audit hf:llama --layers 2 --format markdown
    $ normfuse audit my_models.py:build --graph stream.svg --format html --out report.html

The graph is captured with dynamo and a recording backend (no rewrite), and the pass runs
in analysis mode. ``hf:`` targets are built on the meta device, so a 70B-shaped model
takes no memory: only shapes and dtypes flow. The HBM byte counts per site are read off
the captured graph (docs/audit.md states the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from normfuse.errors import InvalidModelError, InvalidOptionError, NormfuseError, closest
from normfuse.preparation import prepare
from normfuse.reporting import Site, folded_steps

__all__ = ["audit", "AuditReport", "SiteAudit", "register_cli", "BANDWIDTHS", "DEFAULT_BANDWIDTH",
           "parse_bandwidth", "site_bytes", "verdict"]

# Peak HBM bandwidth of current accelerators, bytes/s (vendor data sheets).
BANDWIDTHS = {
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H200": 4.8e12,
    "B200": 8.0e12,
    "A100 80GB SXM": 2.039e12,
    "L40S": 0.864e12,
    "MI300X": 5.3e12,
}
DEFAULT_BANDWIDTH = "H100 SXM"

# Placements whose residual stream passes through adds only (Pre-Norm family) and those
# that normalize the stream itself (Post-Norm family); embedding and standalone norms are neither.
PRE_FAMILY = ("pre", "res_post", "sandwich", "parallel")
POST_FAMILY = ("post", "deepnorm")


def parse_bandwidth(value: Any = None) -> tuple[str, float]:
    """(label, bytes/s) from None (the default GPU), a GPU name in BANDWIDTHS, a number of
    TB/s, or a string such as ``"3.35TB/s"``, ``"900 GB/s"``."""
    if value is None:
        value = DEFAULT_BANDWIDTH
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidOptionError(f"bandwidth must be positive, got {value}.")
        return f"{value:g} TB/s", float(value) * 1e12
    text = str(value).strip()
    for name, bw in BANDWIDTHS.items():
        if text.lower() == name.lower():
            return f"{name} {bw / 1e12:g} TB/s", bw
    low = text.lower().replace(" ", "").removesuffix("/s")
    for unit, scale in (("tb", 1e12), ("gb", 1e9), ("", 1e12)):
        if low.endswith(unit):
            try:
                number = float(low[:len(low) - len(unit)] if unit else low)
            except ValueError:
                continue
            if number > 0:
                return f"{number:g} {unit.upper() or 'TB'}/s", number * scale
    raise InvalidOptionError(
        f"cannot read bandwidth {value!r}.{closest(text, BANDWIDTHS)} Give a number of TB/s (3.35), a string "
        f"such as '900GB/s', or one of: {', '.join(BANDWIDTHS)}.")


# --------------------------------------------------------------------------- byte arithmetic

def _numel_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except Exception:  # noqa: BLE001 - a symbolic size without a hint
            return 0
    if isinstance(value, (tuple, list)):
        return sum(_numel_bytes(v) for v in value)
    return 0


def _bytes(node: Any) -> int:
    """Bytes of the tensor(s) a node produces, from the graph's shape metadata."""
    if not isinstance(node, fx.Node):
        return 0
    for key in ("val", "example_value"):
        if key in node.meta:
            return _numel_bytes(node.meta[key])
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "shape"):
        return math.prod(int(d) for d in tm.shape) * tm.dtype.itemsize
    return 0


def _last_dim(node: Any) -> int:
    from normfuse.passes.canonical import node_shape
    shape = node_shape(node)
    try:
        return int(shape[-1]) if shape else 1
    except Exception:  # noqa: BLE001
        return 1


def _numel(node: Any) -> int:
    from normfuse.passes.canonical import tensor_meta
    t = tensor_meta(node)
    try:
        return int(math.prod(int(d) for d in t.shape)) if t is not None else 0
    except Exception:  # noqa: BLE001
        return 0


@dataclass
class Traffic:
    """HBM bytes and kernel launches of one way of computing a site, forward and backward."""

    fwd: int = 0
    bwd: int = 0
    fwd_kernels: int = 0
    bwd_kernels: int = 0

    def add(self, fwd: int = 0, bwd: int = 0, fwd_kernels: int = 0, bwd_kernels: int = 0) -> None:
        self.fwd += fwd
        self.bwd += bwd
        self.fwd_kernels += fwd_kernels
        self.bwd_kernels += bwd_kernels

    def to_dict(self) -> dict[str, int]:
        return {"fwd": self.fwd, "bwd": self.bwd, "fwd_kernels": self.fwd_kernels, "bwd_kernels": self.bwd_kernels}


def _is_free(index, node: fx.Node) -> bool:
    """Nodes that launch no kernel: views/reshapes, identity dropout, getitem, casts to the same dtype."""
    from normfuse.passes.canonical import node_dtype
    if node.op not in ("call_function", "call_method", "call_module") or node.target is operator.getitem:
        return True
    prim = index.prim(node)
    if prim == "view":
        return True
    if prim == "dropout":  # identity in eval mode or at p = 0
        from normfuse.passes.find import identity_dropout
        return identity_dropout(index.canon(node))
    if prim == "cast":
        src = index.canon(node)["input"]
        return node_dtype(src) == node_dtype(node)
    return False


def _eager(index, node: fx.Node) -> Traffic:
    """What one eager kernel moves: its forward, and the backward autograd runs for it."""
    t = Traffic()
    if _is_free(index, node):
        return t
    prim = index.prim(node)
    ins = [a for a in node.all_input_nodes if _bytes(a)]
    out = _bytes(node)
    reads = sum(_bytes(a) for a in ins)
    if prim in ("layer_norm", "rms_norm"):
        m = index.canon(node)
        x = m["input"]
        rows = _numel(x) // max(1, _last_dim(x))
        # ATen native_layer_norm returns its stats as outputs (counted in `out`); the torch-level
        # calls write them too, as buffers the graph does not show
        stats = 0 if m.multi_output else (2 if prim == "layer_norm" else 1) * 4 * rows
        t.add(fwd=reads + out + stats, fwd_kernels=1)
        # backward: reads dy, x, stats, weight; writes dx, dweight, dbias
        params = sum(_bytes(p) for p in (m["weight"], m["bias"]) if isinstance(p, fx.Node))
        t.add(bwd=2 * _bytes(x) + out + stats + 2 * params, bwd_kernels=1)
        return t
    if prim == "dropout":
        # training-mode dropout also writes its keep mask (one byte an element), which the
        # backward reads with the gradient (free in eval mode: _is_free)
        t.add(fwd=reads + out + _numel(node), fwd_kernels=1)
        t.add(bwd=out + _numel(node) + reads, bwd_kernels=1)
        return t
    t.add(fwd=reads + out, fwd_kernels=1)
    if prim in ("add", "sub"):
        # the gradient passes through unchanged; a broadcast operand needs a reduction of it
        for a in ins:
            if _numel(a) < _numel(node):
                t.add(bwd=out + _bytes(a), bwd_kernels=1)
    elif prim in ("mul", "div"):
        # d(a*b)/da = g*b: read g and the other operand(s), write the operand's grad
        for a in ins:
            t.add(bwd=out + (reads - _bytes(a)) + _bytes(a) + (_bytes(a) if prim == "div" else 0), bwd_kernels=1)
    elif prim in ("mean", "var"):
        t.add(bwd=out + (reads if prim == "var" else 0) + reads, bwd_kernels=1)
    elif prim == "cast":
        t.add(bwd=out + reads, bwd_kernels=1)
    else:  # pow, square, rsqrt, sqrt, reciprocal and anything else: read g and the input, write its grad
        t.add(bwd=out + 2 * reads, bwd_kernels=1)
    return t


def _accumulations(node: fx.Node) -> Traffic:
    """Autograd sums the grads of a value read by k kernels: k-1 adds of (read 2, write 1)."""
    from normfuse.passes.canonical import real_users
    k = len(real_users(node))
    return Traffic(bwd=3 * (k - 1) * _bytes(node), bwd_kernels=k - 1) if k > 1 else Traffic()


def _site_nodes(state, op: str | None) -> list[fx.Node]:
    """The graph nodes the fused op would replace (for an unfused site: the norm alone)."""
    m = state.match
    nodes = list(m.nodes)
    if op == "add_norm" and state.in_add is not None and state.lead is None:  # the lead prices the add
        add = state.in_add
        folded = state.fold.nodes if state.fold is not None else []
        nodes = [*reversed(folded), add.node, *add.chain, *nodes]
        if add.scaled is not None:  # alpha * x of DeepNorm, computed before the add
            scale = add.node.all_input_nodes[add.scaled] if len(add.node.all_input_nodes) > add.scaled else None
            if scale is not None and scale not in nodes:
                nodes.insert(0, scale)
    elif op == "norm_add" and state.output_add is not None:
        nodes = [*nodes, *state.output_chain, state.output_add.node]
    seen: list[fx.Node] = []
    for n in nodes:
        if n not in seen:
            seen.append(n)
    return seen


def _widening(dtype: torch.dtype | None, residual_dtype: torch.dtype | None) -> float:
    """The extra bytes per byte of a 16-bit stream tensor kept in ``residual_dtype`` (0: none)."""
    if residual_dtype is None or dtype not in (torch.float16, torch.bfloat16):
        return 0.0
    return residual_dtype.itemsize / dtype.itemsize - 1.0


def _kernel_operands(state) -> list:
    """The tensors an add_norm kernel reads for the sum: the add's operands, or, with a folded
    branch, its x, x1 and per-row scale in place of the branch value."""
    fold = state.fold
    if fold is None or not fold.folded:
        return list(state.in_add.operands)
    rest = [a for a in state.in_add.operands if a is not fold.nodes[0]]
    return [fold.x, fold.x1, fold.rowscale, *rest]


def _escapes(node: fx.Node, inside: set) -> bool:
    from normfuse.passes.canonical import real_users
    return any(u not in inside for u in real_users(node))


def site_bytes(index, state, op: str | None, residual_dtype: torch.dtype | None = None
               ) -> tuple[Traffic, Traffic, list[fx.Node]]:
    """(eager, fused, nodes): HBM traffic of a site as the graph computes it and as the fused op
    ``op`` would ("add_norm" | "norm_add" | "norm"; None: not fused, so the same as eager).
    ``residual_dtype``: the stream's sums kept in this dtype (``optimize(residual_dtype=)``)."""
    from normfuse.passes.canonical import node_dtype
    nodes = _site_nodes(state, op)
    inside = set(nodes)
    eager = Traffic()
    for n in nodes:
        e = _eager(index, n)
        eager.add(e.fwd, e.bwd, e.fwd_kernels, e.bwd_kernels)
        if not _is_free(index, n):
            # the norm output's grads are summed before either backward, so only inner values count
            a = _accumulations(n) if n is not nodes[-1] else Traffic()
            eager.add(a.fwd, a.bwd, a.fwd_kernels, a.bwd_kernels)
    if op is None:
        return eager, Traffic(eager.fwd, eager.bwd, eager.fwd_kernels, eager.bwd_kernels), nodes
    m = state.match
    if state.lead is not None:
        # computed by its lead norm's kernel, which reads the sum once: this norm adds its
        # parameters and output (forward), dy1 and its parameter grads (backward), no kernel
        params = sum(_bytes(p) for p in (m.weight, m.bias) if isinstance(p, fx.Node))
        return eager, Traffic(fwd=params + _bytes(m.output), bwd=_bytes(m.output) + 2 * params), nodes
    n_cols = m.hidden_size or 1
    x_bytes = _bytes(m.input)
    rows = _numel(m.input) // n_cols
    stats = (2 if m.kind == "layer_norm" else 1) * 4 * rows
    params = sum(_bytes(p) for p in (m.weight, m.bias) if isinstance(p, fx.Node))
    y_bytes = _bytes(m.output)
    fused = Traffic(fwd_kernels=1, bwd_kernels=1)
    if op == "add_norm":
        add = state.in_add.node
        operands = sum(_bytes(a) for a in _kernel_operands(state) if isinstance(a, fx.Node))
        s_bytes = _bytes(add)
        sum_chain = [add, *state.in_add.chain]
        stored = any(_escapes(n, inside) for n in sum_chain)
        # fwd: read x, residual, weight, bias; write y, s (when used elsewhere), stats
        fused.add(fwd=operands + params + y_bytes + (s_bytes if stored else 0) + stats)
        # bwd: when grads are needed the kernel always stores s (add_norm's return_sum or
        # _grad_needed): a training step pays one more write of s in the forward when nothing
        # else reads it, or reads ds when something does; the backward kernel reads s. Then
        # dy, stats and weight; it writes dx, dresidual (unless it is dx itself: residual_scale 1,
        # same dtypes), dweight, dbias
        rebuild = 2 * s_bytes
        dtypes = {node_dtype(a) for a in state.in_add.operands if isinstance(a, fx.Node)}
        shared = state.in_add.residual_scale == 1.0 and len(dtypes) == 1
        grads = operands // 2 if shared else operands
        fused.add(bwd=y_bytes + rebuild + stats + 2 * params + grads)
        wide = _widening(node_dtype(add), residual_dtype)
        if wide:  # the stream in fp32: the sum written, the residual read, s re-read, dresidual wider
            fused.add(fwd=int(wide * s_bytes) * (2 if stored else 1), bwd=int(wide * s_bytes) * 3)
    elif op == "norm_add":
        out = state.output_add.node
        residual = [a for a in state.output_add.operands if isinstance(a, fx.Node) and a is not m.output]
        res = sum(_bytes(a) for a in residual)
        stored = _escapes(m.output, inside)
        fused.add(fwd=x_bytes + res + params + _bytes(out) + (y_bytes if stored else 0) + stats)
        # bwd: read dout (and dy when y was stored), f, stats, weight; write df, dresidual (unless
        # it is dout itself: residual_scale 1, same dtype), dweight, dbias
        shared = state.output_add.residual_scale == 1.0 and all(node_dtype(a) == node_dtype(out) for a in residual)
        fused.add(bwd=_bytes(out) + (y_bytes if stored else 0) + x_bytes + stats + 2 * params + x_bytes
                  + (0 if shared else res))
        wide = _widening(node_dtype(out), residual_dtype)
        if wide:  # the stream in fp32: out written and the residual read wider, their grads too
            fused.add(fwd=int(wide * (_bytes(out) + res)), bwd=int(wide * (_bytes(out) + res)))
    else:  # "norm"
        fused.add(fwd=x_bytes + params + y_bytes + stats)
        fused.add(bwd=y_bytes + x_bytes + stats + 2 * params + x_bytes)
    return eager, fused, nodes


# --------------------------------------------------------------------------- the report

@dataclass
class SiteAudit:
    """One site: what the pass says about it, and its HBM traffic before and after fusion."""

    site: Site
    would_fuse: bool
    status: str                     # "would fuse as add_norm" or the reason it would not
    eager: Traffic
    fused: Traffic
    block: int | None = None        # index of the block (layer) the site sits in, when the path says
    rows: int = 0                   # rows the norm normalizes per forward (batch x seq for a text model)

    def to_dict(self) -> dict[str, Any]:
        d = self.site.to_dict()
        d.update(would_fuse=self.would_fuse, status=self.status, block=self.block, rows=self.rows,
                 bytes_eager=self.eager.to_dict(), bytes_fused=self.fused.to_dict())
        return d


def verdict(placements) -> tuple[str, str]:
    """(model verdict, conversion note) from the placements of its sites."""
    ps = set(placements)
    pre, post = ps & set(PRE_FAMILY), ps & set(POST_FAMILY)
    if pre and post:
        return "mixed", (f"not convertible as a whole: Pre-Norm ({', '.join(sorted(pre))}) and Post-Norm "
                         f"({', '.join(sorted(post))}) blocks; prenorm=True converts only the Post-Norm ones")
    if post:
        return "Post-Norm", ("convertible to Pre-Norm with normfuse.optimize(model, prenorm=True) "
                             "(changes the function by design; fine-tune after converting)")
    if pre:
        return "Pre-Norm", "already Pre-Norm: nothing to convert"
    return "no residual norms", "no norm sits on a residual stream"


@dataclass
class AuditReport:
    """Everything ``normfuse.audit`` found: one ``SiteAudit`` per norm, and the totals."""

    sites: list[SiteAudit] = field(default_factory=list)
    model: str = ""
    batch: int | None = None
    seq: int | None = None
    tokens: int | None = None       # rows the norms see per forward (batch x seq for a text model)
    dtype: str | None = None
    bandwidth: str = ""
    bandwidth_bytes_per_s: float = 0.0
    graphs: int = 0
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    regions: list = field(default_factory=list)   # nested subgraphs (normfuse.reporting.Region)
    capture: str = ""               # how the graphs were captured: one of CAPTURE_PATHS
    notes: list[str] = field(default_factory=list)  # streams regrouped across blocks, as optimize would

    # --- totals
    def totals(self) -> dict[str, Any]:
        e = Traffic()
        f = Traffic()
        for s in self.sites:
            e.add(**s.eager.to_dict())
            f.add(**s.fused.to_dict())
        bw = self.bandwidth_bytes_per_s or 1.0
        out = {"eager": e.to_dict(), "fused": f.to_dict()}
        for name, t in (("eager", e), ("fused", f)):
            out[name]["fwd_us"] = t.fwd / bw * 1e6
            out[name]["train_us"] = (t.fwd + t.bwd) / bw * 1e6
        out["saved_fwd_bytes"] = e.fwd - f.fwd
        out["saved_train_bytes"] = (e.fwd + e.bwd) - (f.fwd + f.bwd)
        out["saved_fwd_us"] = out["eager"]["fwd_us"] - out["fused"]["fwd_us"]
        out["saved_train_us"] = out["eager"]["train_us"] - out["fused"]["train_us"]
        return out

    def summary(self) -> dict[str, Any]:
        from collections import Counter
        placements = [s.site.placement for s in self.sites]
        v, conversion = verdict(placements)
        ops = Counter(s.site.op for s in self.sites if s.would_fuse)
        return {
            "model": self.model, "batch": self.batch, "seq": self.seq, "tokens": self.tokens, "dtype": self.dtype,
            "sites": len(self.sites),
            # the same keys as FusionReport.counts(); here they count what would fuse
            "fused": sum(s.would_fuse for s in self.sites),
            "fused_with_add": sum(s.would_fuse and s.site.op in ("add_norm", "norm_add") for s in self.sites),
            "by_op": dict(ops),
            # fused kernels (two norms of one value share one) and what they take from the branch
            "fused_calls": len({s.site.call or s.site.id for s in self.sites if s.would_fuse}),
            **{key: sum(getattr(s.site, key) for s in self.sites if s.would_fuse)
               for key in ("fused_x1", "fused_rowscale", "fused_dropout")},
            "by_placement": dict(Counter(placements)),
            "by_kind": dict(Counter(s.site.kind for s in self.sites)),
            "by_form": dict(Counter(s.site.form for s in self.sites)),
            "not_fused": dict(Counter(s.status for s in self.sites if not s.would_fuse)),
            "verdict": v, "conversion": conversion,
            "bandwidth": self.bandwidth, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "bytes": self.totals(), "graphs": self.graphs, "seconds": round(self.seconds, 3),
            "capture": self.capture,
        }

    def to_dict(self) -> dict[str, Any]:
        return {"sites": [s.to_dict() for s in self.sites], "summary": self.summary(),
                "regions": [r.to_dict() for r in self.regions], "notes": list(self.notes),
                "warnings": list(self.warnings)}

    @property
    def regions_not_analyzed(self) -> list:
        return [r for r in self.regions if not r.analyzed]

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)

    def to_table(self) -> str:
        from normfuse import render
        return render.text_report(self)

    def to_markdown(self) -> str:
        from normfuse import render
        return render.markdown_report(self)

    def to_html(self) -> str:
        from normfuse import render
        return render.html_report(self)

    def to_svg(self) -> str:
        from normfuse import render
        return render.stream_svg(self)

    def render(self, fmt: str = "table") -> str:
        formats = {"table": self.to_table, "json": lambda: self.to_json(indent=2), "markdown": self.to_markdown,
                   "html": self.to_html, "svg": self.to_svg}
        if fmt not in formats:
            raise InvalidOptionError(f"unknown format {fmt!r}.{closest(fmt, formats)} Use one of: {', '.join(formats)}.")
        return formats[fmt]()

    def __str__(self) -> str:
        return self.to_table()


# --------------------------------------------------------------------------- capture and analysis

def _block_of(fqn: str | None) -> int | None:
    """The first integer component of a module path ("layers.3.input_layernorm" -> 3)."""
    for part in (fqn or "").split("."):
        if part.isdigit():
            return int(part)
    return None


def _status(site: Site) -> tuple[bool, str]:
    if site.op is not None and site.reason in (None, "not applied (analysis only)"):
        return True, f"would fuse as {site.op}{folded_steps(site)}"
    return False, site.reason or "not rewritten"


def _audit_graph(analysis, sites: list[Site], residual_dtype: torch.dtype | None = None) -> list[SiteAudit]:
    """Price each site of one analyzed graph: bytes moved eagerly and by the fused op."""
    index, states = analysis
    site_of = {id(state): site for state, site in zip(states, sites)}
    out = []
    for state, site in zip(states, sites):
        would, status = _status(site)
        if would and state.lead is not None:  # computed by another norm's call
            status += f" (in {site_of[id(state.lead)].id}'s kernel)"
        eager, fused, _ = site_bytes(index, state, site.op if would else None, residual_dtype)
        rows = _numel(state.match.input) // state.match.hidden_size if state.match.hidden_size else 0
        out.append(SiteAudit(site, would, status, eager, fused, _block_of(site.fqn), rows))
    return out


class _GraphFailure(Exception):
    def __init__(self, messages):
        super().__init__("; ".join(messages))
        self.messages = list(messages)


def _first_cause(error: BaseException) -> str:
    """The innermost error's type and first line (dynamo wraps the user's error in its own)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    # dynamo puts the user's error on an "Explanation: ... got Error('...')" line
    explained = [line.strip() for line in text if line.strip().startswith("Explanation:")]
    if explained:
        return explained[0].removeprefix("Explanation:").strip()
    return f"{type(error).__name__}: {text[0] if text else ''}"


# How audit captured the graphs: one forward under dynamo, and when a meta-device forward
# builds tensors of its own (Falcon indexes with a Python list: a real meta tensor that
# fake-tensor tracing refuses), once more accepting such tensors as constants.
CAPTURE_PATHS = ("dynamo with fake tensors",
                 "dynamo with fake tensors, accepting the tensors the forward builds itself (fallback: the first "
                 "capture refused them)")
_NON_FAKE = "Please convert all Tensors to FakeTensors first"


def _capture_graphs(model: nn.Module, args: tuple, kwargs: dict, allow_constants: bool) -> list[fx.GraphModule]:
    from torch._subclasses.fake_tensor import fake_tensor_tls

    graphs: list[fx.GraphModule] = []

    def record(gm: fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    limits = {"recompile_limit": 64, "accumulated_recompile_limit": 4096}
    before = fake_tensor_tls.allow_non_fake_inputs_override
    try:
        if allow_constants:  # dynamo's own switch for tensors made outside its fake mode
            fake_tensor_tls.allow_non_fake_inputs_override = True
        with torch._dynamo.config.patch(**limits), torch.no_grad():
            torch.compile(model, backend=record, dynamic=False)(*args, **kwargs)
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = before
    return graphs


def _caused_by(error: BaseException, text: str) -> bool:
    while error is not None:
        if text in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def audit(model: nn.Module, *args: Any, config=None, bandwidth: Any = None, name: str | None = None,
          **kwargs: Any) -> AuditReport:
    """Audit ``model`` called as ``model(*args, **kwargs)``; the model is not changed.

    One forward runs under dynamo with a recording backend, on whatever device the model and
    inputs are on (meta-device models and inputs cost no memory and no compute). ``config``
    (a FuseConfig) is the one ``optimize`` would use; ``bandwidth`` prices the bytes
    (default: the peak of an H100 SXM, 3.35 TB/s).
    """
    from normfuse.config import make_config

    if not isinstance(model, nn.Module):
        raise InvalidModelError(f"audit takes a torch.nn.Module, got {type(model).__name__}. "
                                "Wrap a function in an nn.Module first.")
    cfg = make_config(config)
    label, bw = parse_bandwidth(bandwidth)
    start = time.perf_counter()
    rep = AuditReport(model=name or type(model).__name__, bandwidth=label, bandwidth_bytes_per_s=bw)
    was_training = model.training
    # audit the graphs optimize would see (its streams regrouped across blocks), then put the
    # model back as it was (the Pre-Norm conversion is not audited)
    preparation = prepare(model, cfg, prenorm=False)
    rep.notes += preparation.notes
    try:
        try:
            rep.capture = CAPTURE_PATHS[0]
            graphs = _capture_graphs(model, args, kwargs, allow_constants=False)
        except Exception as error:  # noqa: BLE001 - retried below, or raised with the cause
            if not _caused_by(error, _NON_FAKE):
                raise
            rep.capture = CAPTURE_PATHS[1]
            rep.warnings.append(f"captured by the fallback path ({rep.capture}): the forward builds a tensor "
                                f"of its own ({_first_cause(error)[:160]}...)")
            graphs = _capture_graphs(model, args, kwargs, allow_constants=True)
    except Exception as error:  # noqa: BLE001 - the user's forward failed: say where
        raise InvalidModelError(f"running {rep.model} to capture its graph failed: {_first_cause(error)}. "
                                "Check the example inputs (shapes, dtypes, device, sequence length) against "
                                "the model.") from error
    finally:
        model.train(was_training)
        preparation.undo()
    if not graphs:
        raise NormfuseError(f"dynamo captured no graph of {rep.model}: the forward ran eagerly (dynamo's "
                            "recompile limit may have been reached in this process; call "
                            "torch._dynamo.reset() and audit again).")
    from normfuse.passes.pipeline import NormFusionPass
    fusion = NormFusionPass(cfg, apply=False)
    for gm in graphs:
        result = fusion(gm)
        rep.regions += fusion.report.regions[len(fusion.report.regions) - len(result.report.regions):]
        # the same sites as numbered across every graph of the model
        numbered = fusion.report.sites[len(fusion.report.sites) - len(result.report.sites):]
        for number, analysis in enumerate(result.analyses):
            sites = [g for s, g in zip(result.report.sites, numbered) if s.graph == number]
            if analysis is None:  # the pass failed on this graph: its warning says why
                continue
            rep.sites += _audit_graph(analysis, sites, cfg.residual_dtype)
        rep.warnings += result.report.warnings
    rep.graphs = fusion.report.graphs
    first = next((s for s in rep.sites if s.rows), None)
    if first is not None:
        rep.tokens, rep.dtype = first.rows, first.site.dtype
    rep.seconds = time.perf_counter() - start
    return rep


# --------------------------------------------------------------------------- command line

def _run_cli(args: argparse.Namespace) -> int:
    from normfuse.errors import TargetError
    from normfuse.targets import is_config_target, load_target, parse_overrides

    start = time.perf_counter()
    try:
        label, bw = parse_bandwidth(args.bandwidth)
        overrides = parse_overrides(args.set)
        # a transformers config is audited in bf16 unless told; a factory's model keeps its own dtype
        dtype = args.dtype or ("bf16" if is_config_target(args.target) else None)
        model, margs, mkwargs = load_target(args.target, layers=args.layers, overrides=overrides, dtype=dtype,
                                            device=args.device, batch=args.batch, seq=args.seq)
    except (TargetError, InvalidOptionError) as error:
        print(f"normfuse audit: error: {error}", file=sys.stderr)
        return 2
    try:
        rep = audit(model, *margs, bandwidth=args.bandwidth, name=args.target, **mkwargs)
    except NormfuseError as error:
        print(f"normfuse audit: error: {error}", file=sys.stderr)
        return 1
    rep.batch = args.batch
    rep.seq = rep.tokens // args.batch if args.seq is None and rep.tokens else args.seq
    rep.seconds = time.perf_counter() - start
    from normfuse.render import write
    text = rep.render(args.format)
    if args.out:
        write(args.out, text)
        print(f"wrote {args.out} ({len(rep.sites)} sites, {args.format})", file=sys.stderr)
    else:
        print(text)
    if args.graph:
        write(args.graph, rep.to_svg())
        print(f"wrote {args.graph}", file=sys.stderr)
    return 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser(
        "audit", help="report every norm site of a model, what would fuse, and the HBM bytes it saves",
        description="Audit a model without weights, memory or a GPU: per-site table, verdict, and HBM bytes "
                    "moved by the norm sites before and after fusion.")
    p.add_argument("target", help="hf:<model_type> | path/to/config.json | file.py:factory | package.module:factory")
    p.add_argument("--layers", type=int, default=None, help="layer count of a transformers config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="change a config field (hf/config.json) or pass a factory keyword; repeatable")
    p.add_argument("--batch", type=int, default=1, help="batch size of the made inputs (default 1)")
    p.add_argument("--seq", type=int, default=None,
                   help="sequence length of the made inputs (default 2048, or the model's maximum if shorter)")
    p.add_argument("--dtype", default=None,
                   help="parameter/activation dtype (default: bf16 for a transformers config, the factory's own)")
    p.add_argument("--device", default="meta", choices=("meta", "cpu"),
                   help="build on the meta device (default: no memory, no compute) or on the CPU")
    p.add_argument("--bandwidth", default=None,
                   help=f"HBM bandwidth that prices the bytes: a GPU name ({', '.join(BANDWIDTHS)}), TB/s, or "
                        f"e.g. 900GB/s (default {DEFAULT_BANDWIDTH})")
    p.add_argument("--format", default="table", choices=("table", "json", "markdown", "html"))
    p.add_argument("--out", default=None, help="write the report to this file instead of stdout")
    p.add_argument("--graph", default=None, metavar="FILE.svg", help="also write a picture of the residual stream")
    p.set_defaults(func=_run_cli)
