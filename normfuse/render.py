"""Render an ``AuditReport``: a plain-text table, Markdown, one self-contained HTML file, and an
SVG picture of the residual stream (written by hand: no plotting dependency)."""

from __future__ import annotations

import html
import os
from typing import Any

__all__ = ["text_report", "markdown_report", "html_report", "stream_svg", "PLACEMENT_COLORS", "fmt_bytes"]

# one color per placement (colorblind-safe Okabe-Ito order)
PLACEMENT_COLORS = {
    "pre": "#0072B2", "post": "#D55E00", "res_post": "#009E73", "sandwich": "#CC79A7",
    "parallel": "#E69F00", "deepnorm": "#882255", "embedding": "#56B4E9", "standalone": "#777777",
}

COLUMNS = ("id", "fqn", "source", "norm", "placement", "hidden_size", "status", "fwd bytes eager -> fused")


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_us(us: float) -> str:
    return f"{us / 1000:.3f} ms" if abs(us) >= 1000 else f"{us:.1f} us"


def _short_source(source: str | None) -> str:
    if not source:
        return "?"
    path, _, line = source.rpartition(":")
    parts = path.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}"


def _rows(rep) -> list[tuple[str, ...]]:
    rows = []
    for s in rep.sites:
        site = s.site
        rows.append((site.id, site.fqn or "?", _short_source(site.source), f"{site.kind} ({site.form})",
                     site.placement, str(site.hidden_size or "?"), s.status,
                     f"{fmt_bytes(s.eager.fwd)} -> {fmt_bytes(s.fused.fwd)}"))
    return rows


def _summary_lines(rep) -> list[str]:
    s = rep.summary()
    b = s["bytes"]
    e, f = b["eager"], b["fused"]
    shape = f"batch {s['batch']} x seq {s['seq']}" if s["batch"] else "the given inputs"
    lines = [
        f"{s['sites']} norm sites in {s['graphs']} graph(s); {s['fused']} would fuse "
        f"({s['fused_with_add']} with their residual add): {_dict(s['by_op'])}",
        f"placements: {_dict(s['by_placement'])}; kinds: {_dict(s['by_kind'])}; forms: {_dict(s['by_form'])}",
        f"verdict: {s['verdict']}; {s['conversion']}",
        f"captured by {s['capture']}",
    ]
    if s["not_fused"]:
        lines.append(f"not fused: {_dict(s['not_fused'])}")
    lines += [
        f"HBM bytes moved by the norm sites per forward at {shape} ({s['tokens']} rows, {s['dtype']}): "
        f"{fmt_bytes(e['fwd'])} eager -> {fmt_bytes(f['fwd'])} fused "
        f"({_ratio(e['fwd'], f['fwd'])}); {e['fwd_kernels']} -> {f['fwd_kernels']} kernels",
        f"training (forward + backward): {fmt_bytes(e['fwd'] + e['bwd'])} -> {fmt_bytes(f['fwd'] + f['bwd'])} "
        f"({_ratio(e['fwd'] + e['bwd'], f['fwd'] + f['bwd'])}); "
        f"{e['fwd_kernels'] + e['bwd_kernels']} -> {f['fwd_kernels'] + f['bwd_kernels']} kernels",
        f"at {s['bandwidth']} peak: forward {_fmt_us(e['fwd_us'])} -> {_fmt_us(f['fwd_us'])} "
        f"({_saves(b['saved_fwd_us'])}), training step {_fmt_us(e['train_us'])} -> "
        f"{_fmt_us(f['train_us'])} ({_saves(b['saved_train_us'])}); bytes / bandwidth, a lower bound",
    ]
    return lines


def _saves(us: float) -> str:
    return f"saves {_fmt_us(us)}" if us >= 0 else f"costs {_fmt_us(-us)} more"


def _dict(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items()) or "none"


def _ratio(before: float, after: float) -> str:
    return f"{before / after:.2f}x less" if after and before >= after else (
        f"{after / before:.2f}x more" if before else "n/a")


def text_report(rep) -> str:
    rows = [COLUMNS, *_rows(rep)]
    widths = [min(max(len(r[i]) for r in rows), 48) for i in range(len(COLUMNS))]
    out = [f"normfuse audit: {rep.model}"]
    for k, r in enumerate(rows):
        out.append("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append("")
    out += _summary_lines(rep)
    out += [f"not analyzed: {r.name} ({r.op}): {r.reason}" for r in rep.regions_not_analyzed]
    out += list(rep.notes)
    out += [f"warning: {w}" for w in rep.warnings]
    return "\n".join(out)


def _md_cell(v: Any) -> str:
    return str(v).replace("|", "\\|")


def markdown_report(rep) -> str:
    out = [f"# normfuse audit: {rep.model}", ""]
    out += [f"- {line}" for line in _summary_lines(rep)]
    out += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in _rows(rep):
        out.append("| " + " | ".join(_md_cell(c) for c in r) + " |")
    out += [f"\n> not analyzed: {r.name} ({r.op}): {r.reason}" for r in rep.regions_not_analyzed]
    out += [f"\n> {note}" for note in rep.notes]
    out += [f"\n> warning: {w}" for w in rep.warnings]
    return "\n".join(out) + "\n"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 6px;text-align:left}
th{background:#f3f3f3}tr.nofuse td{background:#fff4f0}.chip{display:inline-block;width:10px;height:10px;
border-radius:5px;margin-right:4px}ul{padding-left:18px}.svg{overflow-x:auto;margin:12px 0}
"""


def html_report(rep) -> str:
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>normfuse audit: {e(rep.model)}</title>"
             f"<style>{_CSS}</style></head><body>", f"<h1>normfuse audit: {e(rep.model)}</h1>", "<h2>Summary</h2><ul>"]
    parts += [f"<li>{e(line)}</li>" for line in _summary_lines(rep)]
    parts += [f"<li><b>not analyzed:</b> {e(f'{r.name} ({r.op}): {r.reason}')}</li>" for r in rep.regions_not_analyzed]
    parts += [f"<li>{e(note)}</li>" for note in rep.notes]
    parts += [f"<li><b>warning:</b> {e(w)}</li>" for w in rep.warnings]
    parts.append("</ul><h2>Residual stream</h2><div class='svg'>")
    parts.append(stream_svg(rep))
    parts.append("</div><h2>Sites</h2><table id='sites'><tr>" + "".join(f"<th>{e(c)}</th>" for c in COLUMNS) + "</tr>")
    for s, r in zip(rep.sites, _rows(rep)):
        color = PLACEMENT_COLORS.get(s.site.placement, "#000")
        cells = [e(c) for c in r]
        cells[4] = f"<span class='chip' style='background:{color}'></span>{cells[4]}"
        cells[2] = f"<span title='{e(s.site.source or '')}'>{cells[2]}</span>"
        parts.append(f"<tr class='{'fuse' if s.would_fuse else 'nofuse'}'>"
                     + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    parts.append("</table></body></html>")
    return "\n".join(parts)


# --------------------------------------------------------------------------- the picture

def _groups(rep) -> list[tuple[str, list]]:
    """Sites grouped along the stream: before the first block, each block in order, after the last."""
    groups: list[tuple[str, list]] = []
    seen_block = False
    for s in rep.sites:
        if s.block is not None:
            label, seen_block = f"{s.site.graph}:{s.block}", True
        else:
            label = f"{s.site.graph}:{'out' if seen_block else 'in'}:{s.site.fqn or s.site.id}"
        if groups and groups[-1][0] == label:
            groups[-1][1].append(s)
        else:
            groups.append((label, [s]))
    return groups


def stream_svg(rep, per_row: int = 16) -> str:
    """The residual stream left to right (wrapping every ``per_row`` blocks): one box per block,
    one marker per site colored by placement; filled when it would fuse, hollow when not."""
    e = html.escape
    groups = _groups(rep)
    widest = max((len(sites) for _, sites in groups), default=1)
    box_w, gap, row_h, top = max(64, 20 * widest + 12), 10, 92, 40  # markers 14 px wide, 6 px apart
    n_rows = max(1, -(-len(groups) // per_row))
    width = max(min(len(groups), per_row) * (box_w + gap) + 40, 560)
    legend_y = top + n_rows * row_h + 10
    height = legend_y + 40
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
           f"viewBox='0 0 {width} {height}' font-family='sans-serif' font-size='11'>",
           f"<text x='10' y='20' font-size='14'>residual stream of {e(rep.model)}: {len(rep.sites)} norm sites, "
           f"{sum(s.would_fuse for s in rep.sites)} would fuse</text>"]
    for k, (label, sites) in enumerate(groups):
        r, c = divmod(k, per_row)
        x0 = 20 + c * (box_w + gap)
        y_line = top + r * row_h + 40
        if c == 0:
            out.append(f"<line x1='10' y1='{y_line}' x2='{width - 10}' y2='{y_line}' stroke='#999' "
                       "stroke-width='3' marker-end='none'/>")
        is_block = sites[0].block is not None
        name = f"block {sites[0].block}" if is_block else (sites[0].site.fqn or sites[0].site.id).rsplit(".", 1)[-1]
        fill = "#f7f7f7" if is_block else "#ffffff"
        out.append(f"<rect x='{x0}' y='{y_line - 28}' width='{box_w}' height='56' rx='6' fill='{fill}' "
                   f"stroke='#bbb' class='block'/>")
        out.append(f"<text x='{x0 + box_w / 2}' y='{y_line - 32}' text-anchor='middle'>{e(name[:12])}</text>")
        step = box_w / (len(sites) + 1)
        for i, s in enumerate(sites):
            cx = x0 + step * (i + 1)
            color = PLACEMENT_COLORS.get(s.site.placement, "#000")
            filled = color if s.would_fuse else "#ffffff"
            tip = (f"{s.site.id} {s.site.fqn or ''} [{s.site.placement}, {s.site.kind}] {s.status}; "
                   f"fwd {fmt_bytes(s.eager.fwd)} -> {fmt_bytes(s.fused.fwd)}")
            out.append(f"<circle class='site' cx='{cx:.1f}' cy='{y_line}' r='7' fill='{filled}' stroke='{color}' "
                       f"stroke-width='2.5' data-placement='{s.site.placement}' data-fused='{int(s.would_fuse)}'>"
                       f"<title>{e(tip)}</title></circle>")
            if s.site.op in ("add_norm", "norm_add") and s.would_fuse:
                out.append(f"<text x='{cx:.1f}' y='{y_line + 20}' text-anchor='middle' font-size='9'>+</text>")
    x = 20
    for placement in [p for p in PLACEMENT_COLORS if any(s.site.placement == p for s in rep.sites)]:
        color = PLACEMENT_COLORS[placement]
        out.append(f"<circle cx='{x}' cy='{legend_y}' r='6' fill='{color}' stroke='{color}'/>"
                   f"<text x='{x + 10}' y='{legend_y + 4}'>{placement}</text>")
        x += 20 + 7 * len(placement) + 14
    out.append(f"<circle cx='{x}' cy='{legend_y}' r='6' fill='#fff' stroke='#333' stroke-width='2'/>"
               f"<text x='{x + 10}' y='{legend_y + 4}'>hollow: would not fuse; '+': fused with its residual add"
               "</text>")
    out.append("</svg>")
    return "\n".join(out)


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
