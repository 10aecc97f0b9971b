"""The demo's figure (cce_compile/demo/svg.py, report.figure): a valid SVG document whose
panels, series, ticks and numbers come from the runs, with zeros, NaNs and empty series left
undrawn rather than breaking the file."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET

import pytest

from cce_compile.demo import report, svg
from cce_compile.demo.train import Comparison, RunResult, Speed, StepZero

NS = "{http://www.w3.org/2000/svg}"


def parse(text: str) -> ET.Element:
    root = ET.fromstring(text.encode())
    assert root.tag == f"{NS}svg"
    return root


def panel(root: ET.Element, panel_id: str) -> ET.Element:
    (found,) = [g for g in root.iter(f"{NS}g") if g.get("id") == panel_id]
    return found


def texts(element: ET.Element) -> list[str]:
    return [t.text or "" for t in element.iter(f"{NS}text")]


def series(element: ET.Element) -> dict[str, ET.Element]:
    found = [e for e in element.iter() if e.get("class") == "series"]
    labels = [e.get("data-label") for e in found]
    assert len(set(labels)) == len(labels), labels  # one element per series
    return dict(zip(labels, found))


def vertices(path: ET.Element) -> list[list[tuple[float, float]]]:
    """A path's points, one list per unbroken piece."""
    pieces = []
    for command, x, y in re.findall(r"([ML])(-?[\d.]+),(-?[\d.]+)", path.get("d")):
        if command == "M":
            pieces.append([])
        pieces[-1].append((float(x), float(y)))
    return pieces


def comparison(steps=8, control=True, rate=1000.0, speed=True, peak=0.5) -> Comparison:
    base = [8.0 - 0.3 * i for i in range(steps)]
    fused = [loss + (0.0 if i < 2 else 1e-5 * 3**i) for i, loss in enumerate(base)]
    zero = StepZero(0.0, 9.5e-7, 5e-7, "wte.weight", 1e-6)
    return Comparison(
        RunResult("torch.compile", base, rate, 10.0, peak, weight_distance=[0.0] * steps),
        RunResult(
            "cce_compile",
            fused,
            1.25 * rate,
            8.0,
            None if peak is None else peak / 4,
            weight_distance=[0.0] + [1e-6 * 2**i for i in range(1, steps)],
        ),
        Speed([1.2, 1.25, 1.3, 1.1], 2, 2) if speed else None,
        zero,
        control=RunResult(
            "control", base[::-1], math.nan, math.nan, None, weight_distance=[1e-7] * steps
        )
        if control
        else None,
        control_step_zero=zero if control else None,
    )


META = {"arch": "gla", "vocab": 2048}


def test_the_three_panels_carry_the_runs():
    runs = comparison()
    root = parse(report.figure(META, runs))
    losses, distance, speed = (panel(root, i) for i in ("losses", "distance", "speed"))
    assert "GLA on the Python stdlib, V=2048" in texts(losses)
    assert {"step", "training loss (nats)", "torch.compile", "cce_compile"} <= set(texts(losses))
    assert "distance from torch.compile's run" in texts(distance)
    q1, q3 = runs.speed.quartiles
    ratio = f"cce_compile: {runs.speed.median:.2f}x (quartiles {q1:.2f}-{q3:.2f}x)"
    assert ratio in texts(speed) and "1.2" in ratio  # the median of 1.1, 1.2, 1.25, 1.3
    assert "thousand tokens/s (median step)" in texts(speed)
    assert "peak memory (GiB)" in texts(speed)
    # Each loss curve: one vertex per step, higher loss drawn higher (smaller y).
    curves = series(losses)
    assert set(curves) == {"torch.compile", "cce_compile"}
    for run in (runs.baseline, runs.fused):
        (piece,) = vertices(curves[run.name])
        assert len(piece) == len(run.losses)
        ys = [y for _, y in piece]
        assert ys == sorted(ys)  # the losses fall step by step
    assert curves["cce_compile"].get("stroke-dasharray")  # told apart from the baseline
    assert len(series(distance)) == 4  # dots and a line for cce_compile and the control


def test_log_axis_leaves_out_zeros_and_spans_the_values():
    runs = comparison(control=False)
    distance = panel(parse(report.figure(META, runs)), "distance")
    drawn = series(distance)
    gaps = [abs(a - b) for a, b in zip(runs.baseline.losses, runs.fused.losses)]
    dots = drawn["cce_compile: |loss difference| (0: not drawn)"]
    assert len(dots.findall(f"{NS}circle")) == sum(g > 0 for g in gaps) == len(gaps) - 2
    (line,) = vertices(drawn["cce_compile: weight distance"])
    assert len(line) == len(runs.fused.weight_distance) - 1  # step 0's distance is 0
    # Decades: one tick per power of ten from below the smallest value to above the largest.
    values = [v for v in gaps + runs.fused.weight_distance if v > 0]
    ticks = [float(t) for t in texts(distance) if re.fullmatch(r"1e-?\d+", t)]
    assert min(ticks) <= min(values) and max(ticks) >= max(values)
    assert all(b == pytest.approx(10 * a) for a, b in zip(ticks, ticks[1:]))


def test_the_bar_heights_follow_tokens_per_s():
    runs = comparison(rate=4000.0)
    bars = series(panel(parse(report.figure(META, runs)), "speed"))
    heights = {name: float(bars[name].get("height")) for name in ("torch.compile", "cce_compile")}
    assert heights["cce_compile"] == pytest.approx(1.25 * heights["torch.compile"], rel=0.01)
    memory = bars["peak memory (GiB)"].findall(f"{NS}circle")
    assert len(memory) == 2
    # The control's peak (None) is not drawn; cce_compile's is a quarter of compile's: lower.
    assert float(memory[1].get("cy")) > float(memory[0].get("cy"))


def test_nothing_measured_still_makes_a_figure():
    """Too few steps to time (NaN tokens/s, no Speed), no memory figure, one step: the panels
    say so instead of drawing a bar or raising."""
    runs = comparison(steps=1, control=False, rate=math.nan, speed=False, peak=None)
    root = parse(report.figure(META, runs))
    speed = panel(root, "speed")
    assert "tokens/s: not measured" in texts(speed)
    assert texts(speed).count("n/a") == 2 and not series(speed)
    distance = series(panel(root, "distance"))
    assert all(not list(e) and not e.get("d") for e in distance.values())  # all zeros


def test_empty_series_and_markup_in_labels():
    box = svg.Box(0, 0, 400, 300)
    text = svg.figure(
        400,
        300,
        [
            svg.line_panel(
                box,
                "p",
                "a <title> & more",
                ("x", "y"),
                [svg.Series("none & <yet>", [], "#000"), svg.Series("nan", [math.nan], "#000")],
                log=True,
            )
        ],
    )
    drawn = series(parse(text))
    assert set(drawn) == {"none & <yet>", "nan"}
    assert all(e.get("d") == "" for e in drawn.values())
    assert "a <title> & more" in texts(parse(text))


def one_panel(lines: list[svg.Series]) -> ET.Element:
    box = svg.Box(0, 0, 400, 300)
    return parse(svg.figure(400, 300, [svg.line_panel(box, "p", "t", ("x", "y"), lines)]))


def test_a_lone_point_is_drawn_and_the_steps_axis_starts_at_zero():
    """One step: each run's loss is a short dash (a path's lone point draws nothing), and the
    steps' axis runs from 0, not from -1."""
    losses = panel(parse(report.figure(META, comparison(steps=1, control=False))), "losses")
    for path in series(losses).values():
        assert re.fullmatch(r"M[\d.]+,[\d.]+ h6", path.get("d")), path.get("d")
    assert "-1" not in texts(losses) and "0" in texts(losses)
    gap = series(one_panel([svg.Series("gap", [1.0, math.nan, 2.0, 3.0], "#000")]))["gap"]
    assert [len(piece) for piece in vertices(gap)] == [1, 2]


def test_ticks_over_nearly_equal_values_have_distinct_labels():
    """Two runs' losses a few millionths apart: the y ticks are told apart."""
    assert svg.tick_labels([10.40640, 10.40641, 10.40642]) == ["10.4064", "10.40641", "10.40642"]
    root = one_panel([svg.Series("loss", [10.406401, 10.406402, 10.406403], "#000")])
    labels = [t for t in texts(root) if re.fullmatch(r"\d+\.\d+", t)]
    assert len(labels) >= 2 and len(set(labels)) == len(labels), labels


def test_the_legend_counts_the_values_it_cannot_draw():
    lines = [svg.Series("loss", [1.0, math.nan, math.inf], "#000"), svg.Series("ok", [1.0], "#111")]
    legend = texts(one_panel(lines))
    assert "loss (2 non-finite, not drawn)" in legend and "ok" in legend


@pytest.mark.parametrize(
    "lo, hi, integer, expected",
    [
        (0.0, 1.0, False, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]),
        (-0.35, 5.35, True, [0, 2, 4]),
        (8.45, 10.55, False, [8.5, 9.0, 9.5, 10.0, 10.5]),
        (-0.05, 1.05, True, [0, 1]),
    ],
)
def test_linear_ticks_are_round_and_inside(lo, hi, integer, expected):
    assert svg.linear_ticks(lo, hi, integer=integer) == pytest.approx(expected)


def test_ranges():
    assert svg.log_range([0.0, 3e-7, 2e-3, math.nan]) == (-7.0, -2.0)
    assert svg.log_range([1e-3]) == (-3.0, -2.0)
    assert svg.log_range([0.0]) == (-1.0, 0.0)
    assert svg.linear_range([2.0, 2.0]) == (1.8, 2.2)
    assert svg.linear_range([math.nan], include_zero=True) == (0.0, 1.0)
    assert svg.linear_range([3.0, 5.0], include_zero=True) == (0.0, pytest.approx(5.25))
