"""The HTML report: one self-contained page (inline SVG and CSS, one tiny inline script,
nothing fetched) rendered from report snapshots (``stats(report=True)``).

Per run: the diagnosis paragraph, a table of the stages (and where Ray stages ran), and
the plots:

- ``timeline``: one row per stage, one cell per time bucket, shaded by how busy the
  stage's workers were (worker starts, stops and restarts as ticks);
- ``throughput``: samples/s through the last stage (the one nearest the loop);
- ``batches``: batches/s delivered to the loop;
- ``wait``: the loop's mean wait per step, ms, per bucket (the first batch, which
  waits for the start-up, is not a step);
- ``depth``: parts in flight per stage (peak per bucket);
- ``breakdown``: where the time goes: per stage busy / blocked / idle, and the loop's
  compute / wait.

Every plot is an ``<svg class="plot" data-plot="NAME">``; a line's ``<polyline
class="series">`` carries ``data-points`` (its number of points) and a ``<circle
class="pt">`` per point; a bar is a ``<rect class="bar">``. The script counts the
points into ``<body data-points>`` once the page loads and logs any error of the page
with ``console.error`` (the browser test reads both).
"""

from __future__ import annotations

import html
import math

from zephon.report.diagnose import diagnose, stage_title

__all__ = ["render_html"]

W, H = 760, 190  # a plot's size, px
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 14, 30  # its margins
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
SHARE_COLORS = {"busy": "#2ca02c", "blocked": "#d62728", "idle": "#c7c7c7",
                "compute": "#1f77b4", "wait": "#ff7f0e"}

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:800px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px;margin:18px 0 4px}
p.diagnosis{background:#f4f6fa;border-left:4px solid #1f77b4;padding:10px 14px}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 8px;border-bottom:1px solid #ddd;
text-align:right}td:first-child,th:first-child{text-align:left}
svg.plot{display:block;background:#fff;border:1px solid #e3e3e3}
svg text{font-size:11px;fill:#444}.legend span{display:inline-block;margin-right:14px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px;vertical-align:middle}
"""

_SCRIPT = """
window.addEventListener("error", function (e) {
  console.error("zephon report: " + (e.message || e.type));
});
window.addEventListener("load", function () {
  var n = 0;
  document.querySelectorAll("polyline.series").forEach(function (line) {
    n += Number(line.getAttribute("data-points"));
  });
  document.body.setAttribute("data-points", String(n));
});
"""


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _nice(top: float) -> float:
    """A round axis maximum at or above ``top``."""
    if top <= 0:
        return 1.0
    step = 10 ** math.floor(math.log10(top))
    for k in (1, 2, 2.5, 5, 10):
        if k * step >= top:
            return k * step
    return 10 * step


def _tick(value: float) -> str:
    """A short axis label: 0.5, 20, 2.5k, 1.2M."""
    for limit, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}"


def _frame(name: str, x_max: float, y_max: float, y_label: str, height: int = H) -> list[str]:
    """An svg's opening tag, axes and ticks (x: seconds of the run)."""
    inner_h = height - TOP - BOTTOM
    out = [f'<svg class="plot" data-plot="{name}" xmlns="http://www.w3.org/2000/svg" '
           f'width="{W}" height="{height}" viewBox="0 0 {W} {height}" role="img">',
           f'<line x1="{LEFT}" y1="{TOP + inner_h}" x2="{W - RIGHT}" y2="{TOP + inner_h}" '
           'stroke="#888"/>',
           f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + inner_h}" stroke="#888"/>']
    for k in range(5):
        x = LEFT + (W - LEFT - RIGHT) * k / 4
        out.append(f'<text x="{x:.1f}" y="{height - 10}" text-anchor="middle">'
                   f'{x_max * k / 4:.3g} s</text>')
    if y_label:
        for k in range(3):
            y = TOP + inner_h * (1 - k / 2)
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                       f'{_tick(y_max * k / 2)}</text>')
        out.append(f'<text x="12" y="{TOP + inner_h / 2:.1f}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {TOP + inner_h / 2:.1f})">{_esc(y_label)}</text>')
    return out


def _lines(name: str, t: list[float], bucket: float, series: dict[str, list[float]],
           y_label: str) -> str:
    """A line plot of ``series`` (label -> one value per bucket) over bucket midpoints."""
    x_max = (len(t) * bucket) or 1.0
    y_max = _nice(max((max(v) for v in series.values() if v), default=0.0))
    out = _frame(name, x_max, y_max, y_label)
    inner_w, inner_h = W - LEFT - RIGHT, H - TOP - BOTTOM
    legend = []
    for k, (label, values) in enumerate(series.items()):
        color = COLORS[k % len(COLORS)]
        pts = [(LEFT + inner_w * (t[i] + bucket / 2) / x_max,
                TOP + inner_h * (1 - v / y_max)) for i, v in enumerate(values)]
        out.append(f'<polyline class="series" data-series="{_esc(label)}" '
                   f'data-points="{len(pts)}" fill="none" stroke="{color}" stroke-width="1.8" '
                   'points="' + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) + '"/>')
        out.extend(f'<circle class="pt" cx="{x:.1f}" cy="{y:.1f}" r="1.8" fill="{color}"/>'
                   for x, y in pts)
        legend.append(f'<span><i style="background:{color}"></i>{_esc(label)}</span>')
    out.append("</svg>")
    return "\n".join(out) + f'\n<div class="legend">{"".join(legend)}</div>'


def _timeline(snap: dict) -> str:
    """Per stage, per bucket: a cell shaded by the stage's busy fraction; worker events
    as ticks."""
    series, stages = snap["series"], snap["stages"]
    t, bucket = series["t"], series["bucket_s"]
    x_max = (len(t) * bucket) or 1.0
    rows = sorted(stages)
    row_h = 26
    height = TOP + BOTTOM + row_h * max(1, len(rows))
    out = _frame("timeline", x_max, 0.0, "", height)
    inner_w = W - LEFT - RIGHT
    cell_w = inner_w * bucket / x_max
    for r, node in enumerate(rows):
        y = TOP + r * row_h
        out.append(f'<text x="{LEFT - 6}" y="{y + row_h / 2 + 4:.1f}" text-anchor="end">'
                   f'{_esc(node)}</text>')
        for i, busy in enumerate(series.get(f"{node}.busy", [0.0] * len(t))):
            x = LEFT + inner_w * t[i] / x_max
            out.append(f'<rect class="cell" data-busy="{busy:.3f}" x="{x:.1f}" y="{y + 2}" '
                       f'width="{max(cell_w, 0.5):.1f}" height="{row_h - 4}" '
                       f'fill="{SHARE_COLORS["busy"]}" fill-opacity="{0.08 + 0.92 * busy:.3f}">'
                       f'<title>{_esc(node)} {t[i]:.2f} s: {100 * busy:.0f} % busy</title></rect>')
        for event in snap["events"]:
            if event["node"] == node:
                x = LEFT + inner_w * min(event["t"], x_max) / x_max
                color = "#d62728" if event["kind"] == "restart" else "#333"
                out.append(f'<line class="event" data-kind="{_esc(event["kind"])}" '
                           f'x1="{x:.1f}" x2="{x:.1f}" y1="{y}" y2="{y + row_h}" '
                           f'stroke="{color}" stroke-width="1.2"/>')
    out.append("</svg>")
    return "\n".join(out) + ('\n<div class="legend"><span><i style="background:'
                             f'{SHARE_COLORS["busy"]}"></i>busy (darker: busier)</span>'
                             '<span><i style="background:#333"></i>worker start/stop</span>'
                             '</div>')


def _breakdown(snap: dict) -> str:
    """Stacked horizontal bars: per stage busy/blocked/idle; the loop's compute/wait."""
    consumer = snap["consumer"]
    rows = [(stage_title(node, s), {k: s[k] for k in ("busy", "blocked", "idle")})
            for node, s in sorted(snap["stages"].items())]
    spent = consumer["compute_s"] + consumer["wait_s"]
    if spent > 0:
        rows.append(("training loop", {"compute": consumer["compute_s"] / spent,
                                       "wait": consumer["wait_s"] / spent}))
    bar_h, gap, label_w = 22, 10, 230
    height = TOP + BOTTOM + (bar_h + gap) * max(1, len(rows))
    out = [f'<svg class="plot" data-plot="breakdown" xmlns="http://www.w3.org/2000/svg" '
           f'width="{W}" height="{height}" viewBox="0 0 {W} {height}" role="img">']
    inner_w = W - label_w - RIGHT
    for r, (label, shares) in enumerate(rows):
        y, x = TOP + r * (bar_h + gap), float(label_w)
        out.append(f'<text x="{label_w - 6}" y="{y + bar_h / 2 + 4:.1f}" text-anchor="end">'
                   f'{_esc(label[:38])}</text>')
        for kind, share in shares.items():
            w = inner_w * share
            out.append(f'<rect class="bar" data-kind="{kind}" data-share="{share:.4f}" '
                       f'x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar_h}" '
                       f'fill="{SHARE_COLORS[kind]}"><title>{_esc(label)}: {kind} '
                       f'{100 * share:.0f} %</title></rect>')
            if w > 34:
                out.append(f'<text x="{x + w / 2:.1f}" y="{y + bar_h / 2 + 4:.1f}" '
                           f'text-anchor="middle" style="fill:#fff">{100 * share:.0f} %</text>')
            x += w
    out.append("</svg>")
    legend = "".join(f'<span><i style="background:{c}"></i>{k}</span>'
                     for k, c in SHARE_COLORS.items())
    return "\n".join(out) + f'\n<div class="legend">{legend}</div>'


def _table(snap: dict) -> str:
    head = ("stage", "runner", "workers", "busy", "blocked", "idle", "arena MiB", "restarts")
    rows = ["<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for node, s in sorted(snap["stages"].items()):
        cells = (stage_title(node, s), s["runner"], s["workers"], f"{100 * s['busy']:.0f} %",
                 f"{100 * s['blocked']:.0f} %", f"{100 * s['idle']:.0f} %",
                 s['arena_bytes'] >> 20, s["worker_restarts"])
        rows.append("<tr>" + "".join(f"<td>{_esc(c)}</td>" for c in cells) + "</tr>")
    return "<table>" + "".join(rows) + "</table>"


def _ray(snap: dict) -> str:
    """Where a run's Ray stages ran (``snap["ray"]``: stage -> its actors, nodes, units
    in flight and re-runs), or nothing."""
    ray = snap.get("ray") or {}
    if not ray:
        return ""
    items = "".join(f"<li>{_esc(node)}: {_esc(text)}</li>" for node, text in sorted(ray.items()))
    return f"<h3>Ray stages</h3><ul>{items}</ul>"


def _run_section(title: str, snap: dict) -> str:
    series = snap["series"]
    t, bucket = series["t"], series["bucket_s"]
    last = max(snap["stages"], default=None)  # the stage nearest the loop
    samples = series.get(f"{last}.samples", [0.0] * len(t)) if last else [0.0] * len(t)
    batches, steps, waits = series["batches"], series["steps"], series["wait_s"]
    c = snap["consumer"]
    parts = [f"<h2>{_esc(title)}</h2>",
             f'<p class="diagnosis">{_esc(diagnose(snap).text)}</p>',
             f"<p>{c['batches']} batches in {snap['elapsed_s']:.2f} s; first batch after "
             f"{c.get('startup_s', 0.0):.2f} s; wait per step p50 "
             f"{c.get('wait_p50_ms', 0.0):.1f} ms, p99 {c.get('wait_p99_ms', 0.0):.1f} ms; "
             f"time buckets of {bucket:g} s.</p>",
             _table(snap), _ray(snap),
             "<h3>Stage timeline</h3>", _timeline(snap),
             "<h3>Throughput</h3>",
             _lines("throughput", t, bucket,
                    {f"samples/s into {last or 'the loop'}": [v / bucket for v in samples]},
                    "samples/s"),
             _lines("batches", t, bucket,
                    {"batches/s to the loop": [v / bucket for v in batches]}, "batches/s"),
             "<h3>Consumer wait per batch</h3>",
             _lines("wait", t, bucket,
                    {"mean wait per step, ms": [1e3 * w / n if n else 0.0
                                                for w, n in zip(waits, steps, strict=True)]},
                    "ms"),
             "<h3>Queue depth</h3>",
             _lines("depth", t, bucket,
                    {node: series.get(f"{node}.depth", [0.0] * len(t))
                     for node in sorted(snap["stages"])} or {"none": [0.0] * len(t)},
                    "parts in flight"),
             "<h3>Where the time goes</h3>", _breakdown(snap)]
    return "\n".join(parts)


def render_html(runs: list[tuple[str, dict]], title: str = "zephon profile") -> str:
    """The report page for ``runs`` (``(title, report snapshot)`` each, in order)."""
    body = "\n".join(_run_section(name, snap) for name, snap in runs) or \
        "<p>No pipeline run was recorded.</p>"
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{_esc(title)}</title><style>{_CSS}</style>"
            f"<script>{_SCRIPT}</script></head>\n<body>\n<h1>{_esc(title)}</h1>\n{body}\n"
            "</body></html>\n")
