"""The notebook panel as HTML: a table of ranks, an inline SVG plot of rank 0's metrics, the GPUs.

Plain HTML with inline styles and an SVG ``polyline`` per metric, so every front end that
renders rich output (JupyterLab, Notebook 7, VS Code, a saved notebook) shows it without
a widget manager or JavaScript. The elements carry ``data-gpufleet*`` attributes (state, step,
number of points) that a program reading the page can rely on.
"""

from __future__ import annotations

from html import escape

from .snapshot import DONE, FAILED, RUNNING, STARTING, Snapshot
from .text import fmt_bytes, fmt_rate, fmt_seconds

_COLOURS = {STARTING: "#888", RUNNING: "#1f77b4", DONE: "#2ca02c", FAILED: "#d62728", "stopped": "#9467bd"}
_RUN_COLOURS = {"RUNNING": "#1f77b4", "SUCCESS": "#2ca02c", "FAILED": "#d62728", "TIMEDOUT": "#d62728",
                "CANCELED": "#9467bd", "PENDING": "#888"}  # fmt: skip
_LINE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd")
_CELL = "padding:2px 8px;text-align:left;white-space:nowrap"
#: Metrics drawn (the first ones logged; "loss" first when there is one).
MAX_LINES = 3


def _badge(text: str, colour: str) -> str:
    return (f'<span style="background:{colour};color:#fff;border-radius:3px;padding:0 5px;'
            f'font-size:90%">{escape(text)}</span>')  # fmt: skip


def _plotted(snap: Snapshot) -> list[str]:
    names = sorted(snap.metrics, key=lambda n: (n != "loss", "loss" not in n, n))
    return [n for n in names if snap.metrics[n]][:MAX_LINES]


def plot_svg(snap: Snapshot, width: int = 360, height: int = 140) -> str:
    """Rank 0's metrics against step, each line scaled to its own range (the legend gives the last value)."""
    names = _plotted(snap)
    if not names:
        return (f'<svg data-gpufleet-plot="" data-points="0" width="{width}" height="40">'
                '<text x="4" y="24" font-size="12" fill="#888">no metrics yet (gpufleet.tracking.log_metrics on rank 0)'
                "</text></svg>")  # fmt: skip
    left, right, top, bottom = 44, 8, 8, 22
    w, h = width - left - right, height - top - bottom
    steps = [s for n in names for s, _ in snap.metrics[n]]
    x0, x1 = min(steps), max(steps)
    parts = [f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>']
    total_points = 0
    legend = []
    for i, name in enumerate(names):
        points = _thin(snap.metrics[name], 400)
        values = [v for _, v in points]
        y0, y1 = min(values), max(values)
        span_x, span_y = (x1 - x0) or 1, (y1 - y0) or 1.0
        coords = " ".join(
            f"{left + (s - x0) / span_x * w:.1f},{top + h - (v - y0) / span_y * h:.1f}" for s, v in points
        )
        colour = _LINE_COLOURS[i % len(_LINE_COLOURS)]
        total_points += len(points)
        parts.append(f'<polyline data-metric="{escape(name)}" data-points="{len(points)}" fill="none" '
                     f'stroke="{colour}" stroke-width="1.5" points="{coords}"/>')  # fmt: skip
        if i == 0:
            parts.append(f'<text x="{left - 4}" y="{top + 9}" font-size="10" text-anchor="end" fill="#666">{y1:.3g}</text>')
            parts.append(f'<text x="{left - 4}" y="{top + h}" font-size="10" text-anchor="end" fill="#666">{y0:.3g}</text>')
        legend.append(f'<tspan fill="{colour}">{escape(name)} {values[-1]:.4g}</tspan>')
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="10" fill="#666">step {x0}</text>')
    parts.append(f'<text x="{left + w}" y="{height - 6}" font-size="10" text-anchor="end" fill="#666">{x1}</text>')
    parts.append(f'<text x="{left + w / 2:.0f}" y="{height - 6}" font-size="10" text-anchor="middle">'
                 + "  ".join(legend) + "</text>")  # fmt: skip
    return (f'<svg data-gpufleet-plot="" data-points="{total_points}" width="{width}" height="{height}" '
            f'xmlns="http://www.w3.org/2000/svg">' + "".join(parts) + "</svg>")  # fmt: skip


def _thin(points: tuple[tuple[int, float], ...], at_most: int) -> list[tuple[int, float]]:
    if len(points) <= at_most:
        return list(points)
    stride = len(points) / at_most
    kept = [points[int(i * stride)] for i in range(at_most)]
    return kept + [points[-1]]


def _ranks_table(snap: Snapshot) -> str:
    usage = any(r.cpu_percent is not None for r in snap.ranks)
    head = ["rank", "state", "step", "steps/s", *(["CPU", "memory"] if usage else []), "last line"]
    rows = ["<tr>" + "".join(f'<th style="{_CELL}">{h}</th>' for h in head) + "</tr>"]
    for r in snap.ranks:
        step = f"{r.step}/{r.total}" if r.total else str(r.step)
        cells = [str(r.rank), _badge(r.state, _COLOURS.get(r.state, "#888")), step, fmt_rate(r.rate)]
        if usage:
            cells += [f"{r.cpu_percent:.0f}%" if r.cpu_percent is not None else "",
                      fmt_bytes(r.rss_bytes) if r.rss_bytes else ""]  # fmt: skip
        line = r.error if r.state == FAILED and r.error else r.last_line
        colour = ";color:#d62728" if r.state == FAILED else ";color:#555"
        cells.append(f'<span style="font-family:monospace{colour}">{escape(line[:120])}</span>')
        rows.append(
            f'<tr data-rank="{r.rank}" data-state="{r.state}" data-step="{r.step}">'
            + "".join(f'<td style="{_CELL}">{c}</td>' for c in cells) + "</tr>"
        )
    return '<table style="border-collapse:collapse;font-size:12px;margin:0">' + "".join(rows) + "</table>"


def _gpus_table(snap: Snapshot) -> str:
    if not snap.gpus:
        return ""
    rows = []
    for g in snap.gpus:
        util = f"{g.util_percent:.0f}%" if g.util_percent is not None else "?"
        mem = f"{fmt_bytes(g.mem_used)} / {fmt_bytes(g.mem_total)}" if g.mem_used is not None else "?"
        pct = (g.util_percent or 0) / 100
        bar = (f'<span style="display:inline-block;width:60px;height:8px;background:#eee">'
               f'<span style="display:block;width:{pct * 60:.0f}px;height:8px;background:#2ca02c"></span></span>')  # fmt: skip
        rows.append(f'<tr data-gpu="{g.index}"><td style="{_CELL}">GPU {g.index} {escape(g.name)}</td>'
                    f'<td style="{_CELL}">{bar} {util}</td><td style="{_CELL}">{mem}</td></tr>')  # fmt: skip
    return '<table style="border-collapse:collapse;font-size:12px;margin:0">' + "".join(rows) + "</table>"


def _header(snap: Snapshot) -> str:
    bits = [f"<b>gpufleet</b> run <code>{escape(snap.run_id)}</code>"]
    if snap.attempt > 1:
        bits.append(f"attempt {snap.attempt}")
    bits.append(_badge(snap.state, _RUN_COLOURS.get(snap.state, "#888")))
    bits.append(f'<span data-gpufleet-elapsed="{snap.elapsed_s:.1f}">{fmt_seconds(snap.elapsed_s)}</span>')
    if snap.state == "RUNNING":
        step = f"step {snap.step}/{snap.total}" if snap.total else f"step {snap.step}"
        bits.append(step)
        if snap.rate is not None:
            bits.append(f"{fmt_rate(snap.rate)} steps/s")
        if snap.eta_s is not None:
            bits.append(f"ETA {fmt_seconds(snap.eta_s)}")
    return " · ".join(bits)


def _summary(snap: Snapshot) -> str:
    counts = snap.counts()
    ranks = f"{len(snap.ranks)} ranks" + "".join(f", {n} {s}" for s, n in sorted(counts.items()) if s != DONE)
    lines = [f"{snap.state.lower()} in {fmt_seconds(snap.elapsed_s)} · {ranks} · step {snap.step}"]
    final = snap.last_metrics()
    if final:
        lines.append("final " + ", ".join(f"{escape(k)} {v:.4g}" for k, v in sorted(final.items())))
    if snap.message:
        lines.append(f'<span style="color:#d62728">{escape(snap.message)}</span>')
    lines.append(f"run id <code>{escape(snap.run_id)}</code> · <code>gpufleet get {escape(snap.run_id)}</code>")
    if snap.mlflow_run_id:
        lines.append(f"MLflow run <code>{escape(snap.mlflow_run_id)}</code>: {escape(snap.mlflow_link or '')}")
    return '<div data-gpufleet-summary="" style="font-size:12px">' + "<br>".join(lines) + "</div>"


def render(snap: Snapshot) -> str:
    """The panel: live while the run goes on, the summary (with the final table and plot) once it ended."""
    ended = snap.state != "RUNNING"
    body = [f'<div style="font-size:13px;margin-bottom:4px">{_header(snap)}</div>']
    if ended:
        body.append(_summary(snap))
    body.append('<div style="display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start">'
                f"<div>{_ranks_table(snap)}{_gpus_table(snap)}</div><div>{plot_svg(snap)}</div></div>")  # fmt: skip
    return (f'<div data-gpufleet-panel="" data-state="{escape(snap.state)}" data-ranks="{len(snap.ranks)}" '
            f'data-step="{snap.step}" style="border:1px solid #ddd;border-radius:4px;padding:6px 8px;'
            f'font-family:sans-serif">' + "".join(body) + "</div>")  # fmt: skip
