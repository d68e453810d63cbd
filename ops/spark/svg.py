"""Tiny inline-SVG charts for the report: stacked bars (with an optional line) and lines.

Every mark carries a <title> with its exact value, so hovering shows the number.
"""
from __future__ import annotations

import html
import math

W, H = 900, 260
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 28, 36


def _nice_max(value: float) -> float:
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    for step in (1, 2, 2.5, 5, 10):
        if value <= step * exp:
            return step * exp
    return 10 * exp


def _fmt(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:g}M"
    if v >= 1e4:
        return f"{v / 1e3:g}k"
    return f"{v:g}"


def _frame(labels, y_max: float, y_label: str, chart_id: str, legend) -> list[str]:
    plot_h = H - TOP - BOTTOM
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" id="{chart_id}" class="chart" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="{html.escape(y_label)}">']
    for k in range(5):
        v = y_max * k / 4
        y = TOP + plot_h - plot_h * k / 4
        out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(v)}</text>')
    out.append(f'<text x="12" y="{TOP - 10}">{html.escape(y_label)}</text>')
    step = (W - LEFT - RIGHT) / max(len(labels), 1)
    for i, label in enumerate(labels):
        out.append(f'<text x="{LEFT + step * (i + 0.5):.1f}" y="{H - BOTTOM + 16}" '
                   f'text-anchor="middle">{html.escape(label)}</text>')
    x = LEFT
    for name, color in legend:
        out.append(f'<rect x="{x}" y="{H - 14}" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="{H - 5}">{html.escape(name)}</text>')
        x += 24 + 7 * len(name)
    return out


def _y(v: float, y_max: float) -> float:
    plot_h = H - TOP - BOTTOM
    return TOP + plot_h - plot_h * (v / y_max)


def _polyline(labels, values, y_max, color, name) -> list[str]:
    step = (W - LEFT - RIGHT) / max(len(labels), 1)
    out, run = [], []
    points = [(LEFT + step * (i + 0.5), v, labels[i]) for i, v in enumerate(values)]
    for x, v, label in points + [(None, None, None)]:
        if v is None:
            if len(run) > 1:
                out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="'
                           + " ".join(f"{px:.1f},{_y(pv, y_max):.1f}" for px, pv, _ in run) + '"/>')
            run = []
            continue
        run.append((x, v, label))
        out.append(f'<circle cx="{x:.1f}" cy="{_y(v, y_max):.1f}" r="3" fill="{color}">'
                   f'<title>{html.escape(name)} {html.escape(label)}: {v:g}</title></circle>')
    return out


def bar_chart(labels, series, *, y_label: str, id: str, line=None) -> str:
    """Stacked bars: series = [(name, values, color)]; line = (name, values, color) or None."""
    totals = [sum(s[1][i] or 0 for s in series) for i in range(len(labels))]
    y_max = _nice_max(max(totals + (list(line[1]) if line else []) + [0]))
    legend = [(s[0], s[2]) for s in series] + ([(line[0], line[2])] if line else [])
    out = _frame(labels, y_max, y_label, id, legend)
    step = (W - LEFT - RIGHT) / max(len(labels), 1)
    for i, label in enumerate(labels):
        base = 0.0
        for name, values, color in series:
            v = values[i] or 0
            if v:
                y_top, y_bottom = _y(base + v, y_max), _y(base, y_max)
                out.append(f'<rect class="bar" x="{LEFT + step * i + step * 0.15:.1f}" y="{y_top:.1f}" '
                           f'width="{step * 0.7:.1f}" height="{y_bottom - y_top:.1f}" fill="{color}">'
                           f'<title>{html.escape(name)} {html.escape(label)}: {v:g}</title></rect>')
            base += v
    if line:
        out += _polyline(labels, line[1], y_max, line[2], line[0])
    out.append("</svg>")
    return "".join(out)


def line_chart(labels, series, *, y_label: str, id: str) -> str:
    """Lines with points; None values leave gaps."""
    values = [v for s in series for v in s[1] if v is not None]
    y_max = _nice_max(max(values + [0]))
    out = _frame(labels, y_max, y_label, id, [(s[0], s[2]) for s in series])
    for name, vals, color in series:
        out += _polyline(labels, vals, y_max, color, name)
    if not values:
        out.append(f'<text x="{W / 2}" y="{H / 2}" text-anchor="middle">no decisions in this period</text>')
    out.append("</svg>")
    return "".join(out)
