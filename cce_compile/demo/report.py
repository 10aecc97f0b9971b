"""The demo's comparison table, what it says about speed and exactness, and the figure."""

from __future__ import annotations

import json
import math
import pathlib
import textwrap

from . import svg
from .train import WARM_STEPS, Comparison, RunResult, StepZero

# Printed under the CPU run's table. It names what the CPU path is, not how fast it is, so that
# it stays true as that path changes; the table and the speed line have this run's numbers.
CPU_NOTE = (
    "On the CPU the op runs its chunked PyTorch path; the speed above is this machine's, under "
    'its load at the time. The GPU (Triton) numbers are in README.md, "Performance and memory '
    'policy".'
)

# Per-step losses within this many float32 spacings (of the first loss) agree to rounding.
ROUNDING_ULPS = 16
# The control "diverges alike" when the two final weight distances are within this factor.
ALIKE_FACTOR = 10.0


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _rows(baseline: RunResult, fused: RunResult) -> list[tuple[str, str, str]]:
    """Every row that has a value on this device (a row neither run measured is left out)."""
    window = max(1, min(20, len(baseline.losses) // 5))
    rows = [
        ("tokens/s (median step)", baseline.tokens_per_s, fused.tokens_per_s, ",.0f"),
        ("step time (ms, median)", baseline.step_ms, fused.step_ms, ".1f"),
        ("peak memory (GiB)", baseline.peak_memory_gb, fused.peak_memory_gb, ".3f"),
        (
            "loss layer: share of step time",
            baseline.loss_time_share,
            fused.loss_time_share,
            ".1%",
        ),
        (
            "loss layer: share of peak memory",
            baseline.loss_memory_share,
            fused.loss_memory_share,
            ".1%",
        ),
        (
            f"final loss (mean of last {window} steps)",
            sum(baseline.losses[-window:]) / window,
            sum(fused.losses[-window:]) / window,
            ".4f",
        ),
        (
            "mean loss",
            sum(baseline.losses) / len(baseline.losses),
            sum(fused.losses) / len(fused.losses),
            ".4f",
        ),
        ("sites rewritten by the pass", baseline.rewritten_sites, fused.rewritten_sites, "d"),
        ("max batch that fits", baseline.max_batch, fused.max_batch, "d"),
        (
            "tokens/s at max batch",
            baseline.max_batch_tokens_per_s,
            fused.max_batch_tokens_per_s,
            ",.0f",
        ),
    ]
    return [
        (name, _fmt(a, spec), _fmt(b, spec))
        for name, a, b, spec in rows
        if a is not None or b is not None
    ]


def table(baseline: RunResult, fused: RunResult, logits_mib: float | None) -> str:
    """A plain-text comparison of the two runs."""
    rows = _rows(baseline, fused)
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'torch.compile':>16}  {'cce_compile':>16}"]
    lines += [f"{name:{width}}  {a:>16}  {b:>16}" for name, a, b in rows]
    if logits_mib is not None:
        line = f"logits footprint (one step's N x V logits): {logits_mib:,.0f} MiB"
        if baseline.peak_memory_gb is not None and fused.peak_memory_gb is not None:
            saved = (baseline.peak_memory_gb - fused.peak_memory_gb) * 1024
            line += f"; peak memory saved: {saved:,.0f} MiB ({saved / logits_mib:.0%} of it)"
        lines.append(line)
    return "\n".join(lines)


def _paragraph(text: str) -> str:
    return textwrap.fill(text, width=96, subsequent_indent="  ")


def speed_text(comparison: Comparison) -> str:
    speed = comparison.speed
    if speed is None:
        return _paragraph(
            f"Speed: not measured (the first {WARM_STEPS} steps compile and warm up and are not "
            f"timed; give --steps {WARM_STEPS + 2} or more)."
        )
    q1, q3 = speed.quartiles
    ratios = speed.block_ratios
    last = speed.warm_steps - 1
    return _paragraph(
        f"Speed: cce_compile ran at {speed.median:.2f}x torch.compile's tokens/s, the median "
        f"of {len(ratios)} blocks of {speed.block_steps} steps (the two runs interleaved, the "
        f"order swapped every step; steps 0-{last}, compilation and warm-up, not timed). "
        f"Spread of the block ratios: quartiles {q1:.2f}-{q3:.2f}x, min-max "
        f"{min(ratios):.2f}-{max(ratios):.2f}x." + _machine(speed)
    )


def _machine(speed) -> str:
    """The load the timed steps saw: the CPU path's many small GEMMs lose more than one large
    GEMM does when other processes share the cores."""
    if speed.load is None:
        return ""
    low, high = speed.load
    text = (
        f" Machine load (1-minute average) {low:.1f}-{high:.1f} on {speed.cores} cores; torch's "
        f"threads: {speed.threads}."
    )
    if speed.cores and high > speed.cores and speed.on_cpu and (speed.threads or 0) > 1:
        text += (
            " Other work shared the cores: the op's CPU path (many small GEMMs, each a "
            "parallel region) loses more to that than torch.compile's one large GEMM, so expect "
            "a lower ratio than on an idle machine; --threads 1 loses less."
        )
    return text


def _step_zero(zero: StepZero) -> str:
    return (
        f"the losses differ by {zero.loss_difference:.1e} nats (float32's spacing there: "
        f"{zero.loss_ulp:.1e}), the gradients by {zero.grad_difference:.1e} (relative L2 over "
        f"all weights; most in {zero.worst_tensor}: {zero.worst_difference:.1e})"
    )


def _largest(baseline: RunResult, other: RunResult) -> tuple[float, int]:
    diffs = [abs(a - b) for a, b in zip(baseline.losses, other.losses)]
    step = max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[step], step


def _first_above(baseline: RunResult, other: RunResult, limit: float) -> int | None:
    for step, (a, b) in enumerate(zip(baseline.losses, other.losses)):
        if abs(a - b) > limit:
            return step
    return None


def _first_non_finite(run: RunResult) -> int | None:
    return next((step for step, loss in enumerate(run.losses) if not math.isfinite(loss)), None)


def _diverged_text(comparison: Comparison) -> str | None:
    """Where a run's loss stopped being finite, said instead of a comparison of the runs (their
    differences are NaN from there on, and no verdict on the math follows from them)."""
    runs = [r for r in (comparison.baseline, comparison.fused, comparison.control) if r is not None]
    firsts = {run.name: _first_non_finite(run) for run in runs}
    if all(step is None for step in firsts.values()):
        return None
    where = "; ".join(
        f"{name}: {'finite throughout' if step is None else f'from step {step}'}"
        for name, step in firsts.items()
    )
    return _paragraph(
        "Exactness, step 0 (same initial weights, same batch): "
        + _step_zero(comparison.step_zero)
        + f". The losses stop being finite ({where}): training diverged (a learning rate too "
        "large for this model?), so the runs are not compared further."
    )


def exactness_text(comparison: Comparison) -> str:
    """Step 0's differences, the largest later one, and (with the control) why it grows; or
    where training diverged."""
    diverged = _diverged_text(comparison)
    if diverged is not None:
        return diverged
    base, fused, control = comparison.baseline, comparison.fused, comparison.control
    zero = comparison.step_zero
    largest, at = _largest(base, fused)
    rounding = ROUNDING_ULPS * zero.loss_ulp
    paragraphs = [
        "Exactness, step 0 (same initial weights, same batch): " + _step_zero(zero) + ".",
        f"Later steps: the largest per-step loss difference is {largest:.2e} nats (step {at})"
        + (
            f"; the weights are {fused.weight_distance[-1]:.1e} apart after the last step "
            "(relative L2)."
            if fused.weight_distance
            else "."
        ),
    ]
    grows = largest > rounding
    if control is not None:
        c_largest, c_at = _largest(base, control)
        paragraphs.append(
            "Control, torch.compile against itself with every initial weight moved up by one "
            "float32 ulp: at step 0 "
            + _step_zero(comparison.control_step_zero)
            + f"; later the largest per-step loss difference is {c_largest:.2e} nats (step "
            f"{c_at}); the weights are {control.weight_distance[-1]:.1e} apart after the last "
            "step."
        )
        mine, theirs = fused.weight_distance[-1], control.weight_distance[-1]
        if not grows:
            verdict = (
                "Both pairs agree to float32 rounding at every step "
                f"(within {ROUNDING_ULPS} spacings of the loss)."
            )
        elif theirs > 0 and 1 / ALIKE_FACTOR <= mine / theirs <= ALIKE_FACTOR:
            first, c_first = (_first_above(base, r, rounding) for r in (fused, control))
            verdict = (
                f"Both pairs drift apart alike (past {ROUNDING_ULPS} spacings at steps {first} "
                f"and {c_first}): training amplifies any rounding-sized difference, so the gap "
                "is chaos, not a difference in the math."
            )
        else:
            verdict = (
                f"cce_compile's weights end {mine / theirs:.1f}x as far from torch.compile's "
                "as the control's: not the growth of rounding alone; look for a difference "
                "in the math."
            )
        paragraphs.append(verdict)
    elif grows:
        paragraphs.append(
            "The gap starts at rounding (step 0) and grows through training. --control trains "
            "torch.compile against itself from weights moved by one float32 ulp, to show "
            "rounding alone growing alike (it costs a third run's steps)."
        )
    else:
        paragraphs.append(
            f"The runs agree to float32 rounding at every step (within {ROUNDING_ULPS} "
            "spacings of the loss)."
        )
    return "\n".join(_paragraph(p) for p in paragraphs)


def save(out_dir: pathlib.Path, meta: dict, comparison: Comparison) -> pathlib.Path:
    """The results JSON and an SVG (loss curves, the runs' divergence, tokens/s and memory);
    returns the SVG's path."""
    baseline, fused, control = comparison.baseline, comparison.fused, comparison.control
    out_dir.mkdir(parents=True, exist_ok=True)
    speed = comparison.speed
    payload = {
        "meta": meta,
        "runs": [baseline.__dict__, fused.__dict__],
        "control": None if control is None else control.__dict__,
        "speed": None
        if speed is None
        else speed.__dict__ | {"median": speed.median, "quartiles": speed.quartiles},
        "step_zero": comparison.step_zero.__dict__,
        "control_step_zero": None
        if comparison.control_step_zero is None
        else comparison.control_step_zero.__dict__,
    }
    stem = f"demo_{meta['arch']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    picture = out_dir / f"{stem}.svg"
    picture.write_text(figure(meta, comparison))
    return picture


# The figure's size in pixels; the panels' widths are in the ratio 2:2:1.
FIGURE_WIDTH, FIGURE_HEIGHT = 1560, 420


def figure(meta: dict, comparison: Comparison) -> str:
    """Three panels as one SVG document: both runs' losses, their distance from
    torch.compile's run (log scale), and tokens/s with peak memory."""
    unit = FIGURE_WIDTH / 5
    boxes = [
        svg.Box(0, 0, 2 * unit, FIGURE_HEIGHT),
        svg.Box(2 * unit, 0, 2 * unit, FIGURE_HEIGHT),
        svg.Box(4 * unit, 0, unit, FIGURE_HEIGHT),
    ]
    panels = [
        _loss_panel(boxes[0], meta, comparison),
        _distance_panel(boxes[1], comparison),
        _speed_panel(boxes[2], comparison),
    ]
    return svg.figure(FIGURE_WIDTH, FIGURE_HEIGHT, panels)


def _loss_panel(box: svg.Box, meta: dict, comparison: Comparison) -> str:
    baseline, fused = comparison.baseline, comparison.fused
    series = [
        svg.Series(baseline.name, baseline.losses, svg.COLORS["gray"]),
        svg.Series(fused.name, fused.losses, svg.COLORS["blue"], style="dashed"),
    ]
    title = f"{meta['arch'].upper()} on the Python stdlib, V={meta['vocab']}"
    return svg.line_panel(box, "losses", title, ("step", "training loss (nats)"), series)


def _distance_panel(box: svg.Box, comparison: Comparison) -> str:
    """Per step, |loss difference| (dots; a zero has no place on the log axis) and the weights'
    distance (a line) from torch.compile's run, for cce_compile and the control."""
    baseline = comparison.baseline
    pairs = [("cce_compile", comparison.fused, svg.COLORS["blue"])]
    if comparison.control is not None:
        pairs.append(("control (compile, 1 ulp)", comparison.control, svg.COLORS["orange"]))
    series = []
    for label, run, color in pairs:
        gaps = [abs(a - b) for a, b in zip(baseline.losses, run.losses)]
        series.append(
            svg.Series(f"{label}: |loss difference| (0: not drawn)", gaps, color, style="dots")
        )
        series.append(svg.Series(f"{label}: weight distance", run.weight_distance, color))
    title = "distance from torch.compile's run"
    labels = ("step", "loss: nats; weights: relative L2")
    return svg.line_panel(box, "distance", title, labels, series, log=True)


def _speed_panel(box: svg.Box, comparison: Comparison) -> str:
    """Tokens/s of both runs as bars, peak memory as points on the right axis; the title gives
    the speed ratio and its quartiles."""
    baseline, fused, speed = comparison.baseline, comparison.fused, comparison.speed
    bars = [
        (baseline.name, baseline.tokens_per_s / 1e3, svg.COLORS["gray"]),
        (fused.name, fused.tokens_per_s / 1e3, svg.COLORS["blue"]),
    ]
    title = "tokens/s: not measured"
    if speed is not None:
        q1, q3 = speed.quartiles
        title = f"cce_compile: {speed.median:.2f}x (quartiles {q1:.2f}-{q3:.2f}x)"
    memory = None
    if baseline.peak_memory_gb is not None and fused.peak_memory_gb is not None:
        memory = svg.Series(
            "peak memory (GiB)",
            [baseline.peak_memory_gb, fused.peak_memory_gb],
            svg.COLORS["red"],
            style="dots",
            radius=4,
        )
    ylabel = "thousand tokens/s (median step)"
    return svg.bar_panel(box, "speed", title, ylabel, bars, memory)
