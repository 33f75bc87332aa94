"""The chart's dashboard drawn as a PNG from a Prometheus's data, for docs/operations.md.

Grafana is not part of the test bed (its build is a Go server plus a JavaScript front end
that a headless browser would then have to render), so this draws what the dashboard
shows: every panel of ``encoderpool_codegen.monitoring.PANELS``, its queries run as
``query_range`` over the last 15 minutes, one line per series, with the panel's legend
format. It uses Pillow, which the test environment already has: no plotting package to
add to the locked environment, and no browser.
"""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from encoderpool_codegen.monitoring import PANELS, Panel

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
          (140, 86, 75), (227, 119, 194), (127, 127, 127)]  # fmt: skip
PANEL_W, PANEL_H, PAD = 560, 230, 12
PLOT_LEFT, PLOT_TOP, PLOT_BOTTOM = 64, 28, 58


def query_range(url: str, promql: str, start: float, end: float, step: float) -> list[Any]:
    q = urllib.parse.urlencode({"query": promql, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{url}/api/v1/query_range?{q}", timeout=60) as resp:
        body = json.load(resp)
    return list(body["data"]["result"])


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's ``{{label}}`` legend format; the series' labels when there is none."""
    named = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt).strip()
    return named or ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "value"


def _fmt(v: float, unit: str) -> str:
    if unit == "percentunit":
        return f"{v * 100:.0f}%"
    if unit == "bytes" and abs(v) >= 1024:
        exp = min(int(math.log(abs(v), 1024)), 4)
        return f"{v / 1024**exp:.1f}{'BKMGT'[exp]}"
    if unit == "s" and 0 < abs(v) < 1:
        return f"{v * 1000:.3g}ms"
    return f"{v:.3g}"


def _panel(
    d: ImageDraw.ImageDraw,
    x0: int,
    y0: int,
    panel: Panel,
    series: list[tuple[str, list[tuple[float, float]]]],
    start: float,
    end: float,
) -> None:
    d.rectangle([x0, y0, x0 + PANEL_W, y0 + PANEL_H], outline=(200, 200, 200))
    d.text((x0 + 8, y0 + 8), panel.title, fill="black")
    left, top = x0 + PLOT_LEFT, y0 + PLOT_TOP
    right, bottom = x0 + PANEL_W - 10, y0 + PANEL_H - PLOT_BOTTOM
    values = [v for _, points in series for _, v in points if math.isfinite(v)]
    if not values:
        d.text((left + 10, (top + bottom) // 2), "no data", fill=(160, 0, 0))
        return
    lo, hi = min(0.0, min(values)), max(values)
    hi = hi if hi > lo else lo + 1.0
    for frac in (0.0, 0.5, 1.0):
        y = bottom - frac * (bottom - top)
        d.line([(left, y), (right, y)], fill=(230, 230, 230))
        d.text((x0 + 6, y - 6), _fmt(lo + frac * (hi - lo), panel.unit), fill="black")
    minutes = (end - start) / 60
    d.text((left, bottom + 4), f"-{minutes:.0f} min", fill=(90, 90, 90))
    d.text((right - 24, bottom + 4), "now", fill=(90, 90, 90))

    def xy(t: float, v: float) -> tuple[float, float]:
        return (
            left + (t - start) / (end - start) * (right - left),
            bottom - (v - lo) / (hi - lo) * (bottom - top),
        )

    for i, (name, points) in enumerate(series[: len(COLORS)]):
        color = COLORS[i]
        line = [xy(t, v) for t, v in points if math.isfinite(v)]
        if len(line) == 1:
            (px, py) = line[0]
            d.ellipse([px - 2, py - 2, px + 2, py + 2], fill=color)
        elif line:
            d.line(line, fill=color, width=2)
        lx = left + (i % 3) * 160
        ly = bottom + 18 + (i // 3) * 12
        d.rectangle([lx, ly + 2, lx + 8, ly + 10], fill=color)
        d.text((lx + 12, ly), name[:24], fill="black")


def render(url: str, namespace: str, pool: str, path: Path, minutes: float = 15) -> int:
    """Draw every panel for one pool into ``path``; returns how many panels had data."""
    end = time.time()
    start = end - minutes * 60
    step = max(5.0, (end - start) / 240)
    cols = 2
    rows = math.ceil(len(PANELS) / cols)
    header = 36
    im = Image.new(
        "RGB", (cols * (PANEL_W + PAD) + PAD, header + rows * (PANEL_H + PAD) + PAD), "white"
    )
    d = ImageDraw.Draw(im)
    d.text(
        (PAD, 12),
        f"encoderpool dashboard, pool {namespace}/{pool} (panels of the chart's dashboard, "
        f"drawn from Prometheus; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(end))})",
        fill="black",
    )
    with_data = 0
    for i, panel in enumerate(PANELS):
        series: list[tuple[str, list[tuple[float, float]]]] = []
        for expr, fmt in panel.targets:
            promql = expr.replace("$namespace", namespace).replace("$pool", pool)
            for r in query_range(url, promql, start, end, step):
                points = [(float(t), float(v)) for t, v in r["values"]]
                series.append((legend(fmt, r["metric"]), points))
        with_data += bool(series)
        x0 = PAD + (i % cols) * (PANEL_W + PAD)
        y0 = header + (i // cols) * (PANEL_H + PAD)
        _panel(d, x0, y0, panel, series, start, end)
    path.parent.mkdir(parents=True, exist_ok=True)
    im.save(path, format="PNG", optimize=True)
    return with_data
