"""Chart geometry for the HTML report: plain data that the template draws as inline SVG.

Every chart maps data to pixels with ``x_px = x0 + x / x_max * (x1 - x0)`` and
``y_px = y1 - y / y_max * (y1 - y0)``; ``x_max``/``y_max`` are written on the ``<svg>`` element
(``data-x-max``, ``data-y-max``) so a reader, or a test, can map the pixels back to numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

W, H = 720, 260
X0, X1, Y0, Y1 = 64, W - 20, 18, H - 44


def nice_step(span: float, count: int = 6) -> float:
    raw = max(span, 1e-9) / count
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)


def nice_max(value: float) -> float:
    step = nice_step(max(value, 1.0))
    return max(step, math.ceil(max(value, 1.0) / step) * step)


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def _ticks(vmax: float, to_px) -> list[tuple[float, str]]:
    step = nice_step(vmax)
    return [(round(to_px(i * step), 1), _fmt(i * step)) for i in range(int(vmax / step + 1e-9) + 1)]


def frame(x_max: float, y_max: float, x_label: str, y_label: str) -> dict:
    """Axes and the two scale functions of a chart."""

    def px(x):
        return X0 + x / x_max * (X1 - X0)

    def py(y):
        return Y1 - y / y_max * (Y1 - Y0)

    return {
        "w": W,
        "h": H,
        "x0": X0,
        "x1": X1,
        "y0": Y0,
        "y1": Y1,
        "x_max": x_max,
        "y_max": y_max,
        "x_label": x_label,
        "y_label": y_label,
        "xticks": _ticks(x_max, px),
        "yticks": _ticks(y_max, py),
        "px": px,
        "py": py,
    }


def sawtooth(sizes, step: int, x_max: float) -> list[tuple[int, int]]:
    """Padding tokens against num_tokens for batches of step, 2*step, ... tokens: the vertices of
    the curve (first batch of each size's segment, and the size itself)."""
    pts, prev = [], 0
    for s in sizes:
        first = prev + step
        if first <= s:
            pts += [(first, s - first), (s, 0)]
        prev = s
    return [(x, y) for x, y in pts if x <= x_max]


def padding_chart(sizes, step: int, limit: int, worst: tuple[int, int], beyond: str = "") -> dict:
    """Padding waste of one routine: a sawtooth up to its largest size, then (shaded, labelled
    ``beyond``) the batches up to ``limit`` that this routine's graphs do not take."""
    top = sizes[-1]
    x_max = min(limit, nice_max(top * 1.15))
    pts = sawtooth(sizes, step, x_max)
    f = frame(
        x_max,
        nice_max(max([y for _, y in pts] + [1]) * 1.1),
        "num_tokens of the batch",
        "padding tokens",
    )
    f["polyline"] = " ".join(f"{f['px'](x):.2f},{f['py'](y):.2f}" for x, y in pts)
    f["beyond"] = (
        {
            "x": round(f["px"](top), 1),
            "w": round(f["x1"] - f["px"](top), 1),
            "label": beyond,
            "cls": "eager" if beyond.endswith("eager") else "fallback",
        }
        if top < x_max
        else None
    )
    f["worst"] = (
        {
            "x": round(f["px"](worst[1]), 1),
            "y": round(f["py"](worst[0]), 1),
            "label": f"worst {worst[0]} @ {worst[1]}",
        }
        if worst[0]
        else None
    )
    return f


def bar_chart(bars: Sequence[tuple[str, float, str]], y_label: str) -> dict:
    """Vertical bars: (label, value, css class)."""
    f = frame(max(len(bars), 1), nice_max(max([v for _, v, _ in bars] + [1]) * 1.1), "", y_label)
    slot = (f["x1"] - f["x0"]) / max(len(bars), 1)
    f["bars"] = [
        {
            "x": round(f["x0"] + i * slot + slot * 0.2, 1),
            "w": round(slot * 0.6, 1),
            "y": round(f["py"](v), 1),
            "h": round(f["y1"] - f["py"](v), 1),
            "cx": round(f["x0"] + (i + 0.5) * slot, 1),
            "label": label,
            "value": _fmt(v),
            "cls": cls,
        }
        for i, (label, v, cls) in enumerate(bars)
    ]
    f["xticks"] = []
    return f


def spike_chart(
    points: list[tuple[float, float]],
    x_max: float,
    x_label: str,
    y_label: str,
    marks=(),
    bar_tokens: float = 1.0,
) -> dict:
    """Bars ``bar_tokens`` wide at numeric x positions (padding tokens per capture size, a
    histogram), with optional marks along the x axis (the capture sizes)."""
    f = frame(x_max, nice_max(max([v for _, v in points] + [1]) * 1.1), x_label, y_label)
    width = max(1.5, (f["x1"] - f["x0"]) / max(x_max, 1) * bar_tokens * 0.85)
    f["spikes"] = [
        {
            "x": round(f["px"](x) - width / 2, 2),
            "w": round(width, 2),
            "y": round(f["py"](v), 2),
            "h": round(f["y1"] - f["py"](v), 2),
            "title": f"{_fmt(x)}: {_fmt(v)}",
        }
        for x, v in points
        if x <= x_max
    ]
    f["marks"] = [round(f["px"](m), 1) for m in marks if m <= x_max]
    top = max(marks, default=x_max)
    f["beyond"] = (
        {
            "x": round(f["px"](top), 1),
            "w": round(f["x1"] - f["px"](top), 1),
            "label": f"above {top}: eager",
            "cls": "eager",
        }
        if marks and top < x_max
        else None
    )
    return f


def histogram(values, weights, x_max: float, bins: int = 64) -> list[tuple[float, float]]:
    """(bin centre, total weight) over [0, x_max]."""
    width = x_max / bins
    totals = [0.0] * bins
    for v, w in zip(values, weights):
        if 0 < v <= x_max:
            totals[min(int((v - 1) // width), bins - 1)] += w
    return [((i + 0.5) * width, t) for i, t in enumerate(totals)]


def tradeoff_chart(curve: list[tuple[int, float]], points: list[tuple[int, float, str, str]]):
    """Padding per step against the graph budget: the optimum at every budget as a step curve
    (``curve``: (graphs, padded tokens per step), ascending), and labelled ``points`` (graphs,
    padding, label, css class): the plan's list and the tuned one."""
    xs = [g for g, _ in curve] + [g for g, *_ in points]
    ys = [y for _, y in curve] + [y for _, y, *_ in points]
    f = frame(
        nice_max(max(xs + [1]) * 1.05),
        nice_max(max(ys + [0.0]) * 1.1),
        "graphs (budget)",
        "padded tokens per step",
    )
    steps, ends = [], [g for g, _ in curve[1:]] + [g for g, _ in curve[-1:]]
    for (g, y), g2 in zip(curve, ends):  # each budget's optimum holds until the next one's
        steps += [(g, y), (g2, y)]
    f["polyline"] = " ".join(f"{f['px'](x):.2f},{f['py'](y):.2f}" for x, y in steps)
    f["points"] = [
        {
            "x": round(f["px"](g), 1),
            "y": round(f["py"](y), 1),
            "label": label,
            "cls": cls,
            "title": f"{label}: {g} graphs, {y:.3f} padded tokens per step",
        }
        for g, y, label, cls in points
    ]
    return f
