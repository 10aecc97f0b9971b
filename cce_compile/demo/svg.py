"""The demo's figure as an SVG file, written with the standard library alone, so that `make demo`
installs nothing beside torch and cce_compile: matplotlib and its dependencies took ~12 s to
install (their layer with cce_compile ~30 s) and ~3.5 s to draw, of a two-minute budget
(2 cores, 2026-11-29).

Two panel kinds: ``line_panel`` (lines and dots over a linear or log y axis) and ``bar_panel``
(bars, with points on a second y axis at the right). Each returns one ``<g>`` element as text;
``figure`` puts panels side by side in one document. Every series is one element carrying its
label (``data-label``): a ``<path>`` for a line, a ``<g>`` of ``<circle>`` for dots. A value a
scale cannot place (NaN, infinite, or not positive on a log axis) is not drawn: a line breaks
there, a dot or a bar is left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from xml.sax.saxutils import escape, quoteattr

# matplotlib's "tab" colours, which the figure used when matplotlib drew it.
COLORS = {"gray": "#7f7f7f", "blue": "#1f77b4", "orange": "#ff7f0e", "red": "#d62728"}
FONT_SIZE = 11  # pixels; tick labels and legends one smaller, titles one larger
CHAR_WIDTH = 0.56  # a sans-serif character's mean width per pixel of font size, for layout
# A panel's plot area within its box: room for the title above, tick labels and axis labels.
MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 64, 16, 30, 44


@dataclasses.dataclass(frozen=True)
class Box:
    """A rectangle in the figure, in pixels from its top-left corner."""

    x: float
    y: float
    width: float
    height: float

    def inner(self, right: float = MARGIN_RIGHT) -> Box:
        """The plot area of a panel that fills this box."""
        return Box(
            self.x + MARGIN_LEFT,
            self.y + MARGIN_TOP,
            self.width - MARGIN_LEFT - right,
            self.height - MARGIN_TOP - MARGIN_BOTTOM,
        )


@dataclasses.dataclass(frozen=True)
class Series:
    """One labelled series: ``ys`` at x = 0, 1, 2, ... unless ``xs`` is given."""

    label: str
    ys: Sequence[float]
    color: str
    style: str = "line"  # "line", "dashed" or "dots"
    xs: Sequence[float] | None = None
    radius: float = 2.2  # a dot's, in pixels

    def points(self) -> list[tuple[float, float]]:
        xs = range(len(self.ys)) if self.xs is None else self.xs
        return list(zip(xs, self.ys))


@dataclasses.dataclass(frozen=True)
class Scale:
    """Data to pixels along one axis: ``lo``..``hi`` (log10 of the data on a log scale) onto
    ``start``..``end``."""

    lo: float
    hi: float
    start: float
    end: float
    log: bool = False

    def places(self, value: float) -> bool:
        return math.isfinite(value) and (value > 0 or not self.log)

    def __call__(self, value: float) -> float:
        v = math.log10(value) if self.log else value
        return self.start + (v - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def linear_range(values: Sequence[float], include_zero: bool = False) -> tuple[float, float]:
    """The span of the finite values with a 5% margin (0..1 without any; a width of its own
    around a single value); with ``include_zero``, from 0 without a margin there."""
    finite = [v for v in values if math.isfinite(v)] + ([0.0] if include_zero else [])
    if not finite:
        return 0.0, 1.0
    lo, hi = min(finite), max(finite)
    if include_zero and lo == hi == 0:
        return 0.0, 1.0
    if lo == hi:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = 0.05 * (hi - lo)
    return (lo if include_zero and lo == 0 else lo - pad), (
        hi if include_zero and hi == 0 else hi + pad
    )


def log_range(values: Sequence[float]) -> tuple[float, float]:
    """Whole decades (as log10) around the positive finite values; 0.1..1 without any."""
    positive = [v for v in values if math.isfinite(v) and v > 0]
    if not positive:
        return -1.0, 0.0
    lo, hi = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
    return float(lo), float(hi if hi > lo else lo + 1)


def linear_ticks(lo: float, hi: float, count: int = 5, integer: bool = False) -> list[float]:
    """About ``count`` round values (1, 2, 2.5 or 5 times a power of ten apart) in lo..hi;
    whole numbers only with ``integer`` (an axis of steps)."""
    raw = (hi - lo) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * 0.999)
    if integer:
        step = max(1, round(step))
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def log_ticks(lo: float, hi: float) -> list[float]:
    """Powers of ten in the decades lo..hi (log10), at most about eight of them."""
    every = max(1, math.ceil((hi - lo) / 8))
    return [10.0**k for k in range(int(lo), int(hi) + 1, every)]


def tick_text(value: float, log: bool = False) -> str:
    if log:
        return f"1e{round(math.log10(value))}"
    return f"{value:.6g}"


def tick_labels(values: Sequence[float], log: bool = False) -> list[str]:
    """``tick_text`` of each value, with as many more digits as it takes to tell them apart
    (ticks over a span far smaller than their size: two runs' nearly equal losses)."""
    labels = [tick_text(v, log) for v in values]
    for digits in range(7, 13):
        if log or len(set(labels)) == len(labels):
            break
        labels = [f"{v:.{digits}g}" for v in values]
    return labels


def _text(x: float, y: float, content: str, size: int = FONT_SIZE, **attributes) -> str:
    extra = "".join(
        f" {name.replace('_', '-')}={quoteattr(str(v))}" for name, v in attributes.items()
    )
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}"{extra}>{escape(content)}</text>'


def _frame(box: Box, plot: Box, title: str, xlabel: str, ylabel: str) -> list[str]:
    """The plot area's outline, the panel's title above it and the axes' labels."""
    middle_y = plot.y + plot.height / 2
    parts = [
        f'<rect x="{plot.x:.1f}" y="{plot.y:.1f}" width="{plot.width:.1f}" '
        f'height="{plot.height:.1f}" fill="none" stroke="#000" stroke-width="0.8"/>',
        _text(box.x + box.width / 2, box.y + 18, title, FONT_SIZE + 1, text_anchor="middle"),
        _text(
            box.x + 14,
            middle_y,
            ylabel,
            text_anchor="middle",
            transform=f"rotate(-90 {box.x + 14:.1f} {middle_y:.1f})",
        ),
    ]
    if xlabel:
        bottom = plot.y + plot.height + 34
        parts.append(_text(plot.x + plot.width / 2, bottom, xlabel, text_anchor="middle"))
    return parts


def _y_ticks(plot: Box, scale: Scale, ticks: Sequence[float], right: bool = False) -> list[str]:
    """Tick marks and their labels on the plot's left (or right) edge."""
    x = plot.x + plot.width if right else plot.x
    direction = 1 if right else -1
    parts = []
    for value, label in zip(ticks, tick_labels(ticks, scale.log)):
        y = scale(value)
        parts.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x + 4 * direction:.1f}" y2="{y:.1f}" '
            'stroke="#000" stroke-width="0.8"/>'
        )
        anchor = "start" if right else "end"
        parts.append(_text(x + 7 * direction, y + 3.5, label, FONT_SIZE - 1, text_anchor=anchor))
    return parts


def _x_ticks(plot: Box, scale: Scale, ticks: Sequence[float], labels: Sequence[str]) -> list[str]:
    """Tick marks and their labels under the plot."""
    bottom = plot.y + plot.height
    parts = []
    for value, label in zip(ticks, labels):
        x = scale(value)
        parts.append(
            f'<line x1="{x:.1f}" y1="{bottom:.1f}" x2="{x:.1f}" y2="{bottom + 4:.1f}" '
            'stroke="#000" stroke-width="0.8"/>'
        )
        parts.append(_text(x, bottom + 16, label, FONT_SIZE - 1, text_anchor="middle"))
    return parts


def _pixels(series: Series, xscale: Scale, yscale: Scale) -> list[tuple[float, float] | None]:
    """Each point's place in pixels, None where a scale cannot place it."""
    return [
        (xscale(x), yscale(y)) if xscale.places(x) and yscale.places(y) else None
        for x, y in series.points()
    ]


def _series(series: Series, xscale: Scale, yscale: Scale) -> str:
    """One series as one element: a path (broken where a value cannot be placed) or dots."""
    label = quoteattr(series.label)
    placed = _pixels(series, xscale, yscale)
    if series.style == "dots":
        dots = "".join(
            f'<circle cx="{p[0]:.1f}" cy="{p[1]:.1f}" r="{series.radius}"/>'
            for p in placed
            if p is not None
        )
        return f'<g class="series" data-label={label} fill="{series.color}">{dots}</g>'
    commands = []
    for i, point in enumerate(placed):
        if point is None:
            continue
        after = placed[i + 1] if i + 1 < len(placed) else None
        if i > 0 and placed[i - 1] is not None:
            commands.append(f"L{point[0]:.1f},{point[1]:.1f}")
        elif after is None:  # a point with no neighbour drawn: a short dash, or it is not seen
            commands.append(f"M{point[0] - 3:.1f},{point[1]:.1f} h6")
        else:
            commands.append(f"M{point[0]:.1f},{point[1]:.1f}")
    dash = ' stroke-dasharray="6 3"' if series.style == "dashed" else ""
    return (
        f'<path class="series" data-label={label} d="{" ".join(commands)}" fill="none" '
        f'stroke="{series.color}" stroke-width="1.4"{dash}/>'
    )


def _drawn(series: Sequence[Series], xscale: Scale, yscale: Scale) -> list[tuple[float, float]]:
    """What a legend could hide, in pixels: each dot, each line's vertices and midpoints."""
    drawn = []
    for s in series:
        placed = _pixels(s, xscale, yscale)
        drawn += [p for p in placed if p is not None]
        if s.style != "dots":
            drawn += [
                ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2)
                for a, b in zip(placed, placed[1:])
                if a is not None and b is not None
            ]
    return drawn


def _legend_corner(plot: Box, width: float, height: float, drawn) -> tuple[float, float]:
    """The legend's top-left corner: of the plot's four corners (top right first), the one
    whose legend would cover the fewest drawn points."""
    lefts = (plot.x + plot.width - width - 6, plot.x + 6)
    tops = (plot.y + 6, plot.y + plot.height - height - 6)
    corners = [(left, top) for top in tops for left in lefts]

    def covered(corner: tuple[float, float]) -> int:
        left, top = corner
        return sum(left <= x <= left + width and top <= y <= top + height for x, y in drawn)

    return min(corners, key=covered)  # min keeps the first of equals


def _legend(plot: Box, series: Sequence[Series], drawn: list[tuple[float, float]]) -> list[str]:
    """A key in the corner of the plot that hides the fewest ``drawn`` points (in pixels): each
    series' mark and label, one per line."""
    size = FONT_SIZE - 1
    width = 34 + CHAR_WIDTH * size * max(len(_legend_label(s)) for s in series)
    height = 6 + 14 * len(series)
    left, top = _legend_corner(plot, width, height, drawn)
    parts = [
        f'<rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height:.1f}" '
        'fill="#fff" fill-opacity="0.85" stroke="#ccc" stroke-width="0.8"/>'
    ]
    for i, s in enumerate(series):
        y = top + 12 + 14 * i
        if s.style == "dots":
            parts.append(
                f'<circle cx="{left + 15:.1f}" cy="{y - 3:.1f}" r="{s.radius}" fill="{s.color}"/>'
            )
        else:
            dash = ' stroke-dasharray="6 3"' if s.style == "dashed" else ""
            parts.append(
                f'<line x1="{left + 6:.1f}" y1="{y - 3:.1f}" x2="{left + 24:.1f}" '
                f'y2="{y - 3:.1f}" stroke="{s.color}" stroke-width="1.4"{dash}/>'
            )
        parts.append(_text(left + 29, y, _legend_label(s), size))
    return parts


def _legend_label(series: Series) -> str:
    """The series' label, and how many of its values are not finite (not drawn)."""
    missing = sum(not math.isfinite(y) for y in series.ys)
    return series.label + (f" ({missing} non-finite, not drawn)" if missing else "")


def line_panel(
    box: Box,
    panel_id: str,
    title: str,
    labels: tuple[str, str],
    series: Sequence[Series],
    log: bool = False,
) -> str:
    """Series over a shared x axis and a linear (or log10) y axis, with ticks, the axes'
    ``labels`` (x, y) and a legend; an empty or undrawable series keeps its legend entry."""
    plot = box.inner()
    xs = [x for s in series for x, _ in s.points()]
    ys = [y for s in series for _, y in s.points()]
    x_lo, x_hi = linear_range(xs, include_zero=True)  # steps: from 0, not from -1 at one step
    xscale = Scale(x_lo, x_hi, plot.x, plot.x + plot.width)
    y_lo, y_hi = log_range(ys) if log else linear_range(ys)
    yscale = Scale(y_lo, y_hi, plot.y + plot.height, plot.y, log=log)
    x_ticks = linear_ticks(x_lo, x_hi, integer=all(float(x).is_integer() for x in xs))
    y_ticks = log_ticks(y_lo, y_hi) if log else linear_ticks(y_lo, y_hi)
    parts = _frame(box, plot, title, *labels)
    parts += _x_ticks(plot, xscale, x_ticks, tick_labels(x_ticks))
    parts += _y_ticks(plot, yscale, y_ticks)
    parts += [_series(s, xscale, yscale) for s in series]
    if series:
        parts += _legend(plot, series, _drawn(series, xscale, yscale))
    return f'<g id="{panel_id}">' + "".join(parts) + "</g>"


def _bars(plot: Box, scale: Scale, bars: Sequence[tuple[str, float, str]]) -> list[str]:
    """One bar per (name, value, colour), each a labelled rect; "n/a" where it has no value."""
    slot = plot.width / len(bars)
    base = scale(0.0)
    parts = []
    for i, (name, value, color) in enumerate(bars):
        left = plot.x + slot * (i + 0.2)
        if not scale.places(value):
            parts.append(_text(left + slot * 0.3, base - 6, "n/a", text_anchor="middle"))
            continue
        top = scale(value)
        parts.append(
            f'<rect class="series" data-label={quoteattr(name)} x="{left:.1f}" '
            f'y="{min(top, base):.1f}" width="{slot * 0.6:.1f}" height="{abs(base - top):.1f}" '
            f'fill="{color}"/>'
        )
    return parts


def bar_panel(
    box: Box,
    panel_id: str,
    title: str,
    ylabel: str,
    bars: Sequence[tuple[str, float, str]],
    points: Series | None = None,
) -> str:
    """Bars of (name, value, colour) from zero, named under the axis; ``points`` (one value
    per bar) are drawn on a second y axis from zero at the right, labelled in their colour."""
    plot = box.inner(right=MARGIN_LEFT if points is not None else MARGIN_RIGHT)
    lo, hi = linear_range([value for _, value, _ in bars], include_zero=True)
    scale = Scale(lo, hi, plot.y + plot.height, plot.y)
    xscale = Scale(-0.5, len(bars) - 0.5, plot.x, plot.x + plot.width)
    parts = _frame(box, plot, title, "", ylabel)
    parts += _x_ticks(plot, xscale, range(len(bars)), [name for name, _, _ in bars])
    parts += _y_ticks(plot, scale, linear_ticks(lo, hi))
    parts += _bars(plot, scale, bars)
    if points is not None:
        p_lo, p_hi = linear_range(points.ys, include_zero=True)
        p_scale = Scale(p_lo, p_hi, plot.y + plot.height, plot.y)
        parts += _y_ticks(plot, p_scale, linear_ticks(p_lo, p_hi), right=True)
        parts.append(_series(points, xscale, p_scale))
        x, middle_y = box.x + box.width - 12, plot.y + plot.height / 2
        parts.append(
            _text(
                x,
                middle_y,
                points.label,
                fill=points.color,
                text_anchor="middle",
                transform=f"rotate(-90 {x:.1f} {middle_y:.1f})",
            )
        )
    return f'<g id="{panel_id}">' + "".join(parts) + "</g>"


def figure(width: float, height: float, panels: Sequence[str]) -> str:
    """The SVG document: a white background and the panels (each from the functions above)."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="DejaVu Sans, Arial, sans-serif">\n'
        f'<rect width="{width:.0f}" height="{height:.0f}" fill="#fff"/>\n'
        + "\n".join(panels)
        + "\n</svg>\n"
    )
