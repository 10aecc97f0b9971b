"""The demo's comparison table and figure."""

from __future__ import annotations

import json
import pathlib

from .train import RunResult

# Printed under the CPU run's table. It names what the CPU path is for rather than a ratio, so
# that it stays true as that path gets faster; the table above it has this run's numbers.
CPU_NOTE = (
    "On the CPU the op runs its chunked PyTorch path, which today trades speed for memory; "
    'the GPU (Triton) numbers are in README.md, "Results".'
)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(baseline: RunResult, fused: RunResult, logits_mib: float | None) -> str:
    """A plain-text comparison of the two runs."""
    window = max(1, min(20, len(baseline.losses) // 5))
    diff = max(abs(a - b) for a, b in zip(baseline.losses, fused.losses))
    rows = [
        ("tokens/s", _fmt(baseline.tokens_per_s, ",.0f"), _fmt(fused.tokens_per_s, ",.0f")),
        ("step time (ms)", _fmt(baseline.step_ms, ".1f"), _fmt(fused.step_ms, ".1f")),
        (
            "peak memory (GiB)",
            _fmt(baseline.peak_memory_gb, ".3f"),
            _fmt(fused.peak_memory_gb, ".3f"),
        ),
        (
            "loss layer: share of step time",
            _fmt(baseline.loss_time_share, ".1%"),
            _fmt(fused.loss_time_share, ".1%"),
        ),
        (
            "loss layer: share of peak memory",
            _fmt(baseline.loss_memory_share, ".1%"),
            _fmt(fused.loss_memory_share, ".1%"),
        ),
        (
            "final loss (mean of last steps)",
            f"{sum(baseline.losses[-window:]) / window:.4f}",
            f"{sum(fused.losses[-window:]) / window:.4f}",
        ),
        (
            "mean loss",
            f"{sum(baseline.losses) / len(baseline.losses):.4f}",
            f"{sum(fused.losses) / len(fused.losses):.4f}",
        ),
        ("sites rewritten by the pass", str(baseline.rewritten_sites), str(fused.rewritten_sites)),
        ("max batch that fits", _fmt(baseline.max_batch, "d"), _fmt(fused.max_batch, "d")),
        (
            "tokens/s at max batch",
            _fmt(baseline.max_batch_tokens_per_s, ",.0f"),
            _fmt(fused.max_batch_tokens_per_s, ",.0f"),
        ),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'torch.compile':>16}  {'cce_compile':>16}"]
    lines += [f"{name:{width}}  {a:>16}  {b:>16}" for name, a, b in rows]
    lines.append(f"largest per-step loss difference between the runs: {diff:.2e} nats")
    if logits_mib is not None:
        line = f"logits footprint (one step's N x V logits): {logits_mib:,.0f} MiB"
        if baseline.peak_memory_gb is not None and fused.peak_memory_gb is not None:
            saved = (baseline.peak_memory_gb - fused.peak_memory_gb) * 1024
            line += f"; peak memory saved: {saved:,.0f} MiB ({saved / logits_mib:.0%} of it)"
        lines.append(line)
    return "\n".join(lines)


def save(out_dir: pathlib.Path, meta: dict, baseline: RunResult, fused: RunResult) -> None:
    """results JSON and a PNG with the loss curves and the memory / throughput bars."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "runs": [baseline.__dict__, fused.__dict__]}
    (out_dir / f"demo_{meta['arch']}.json").write_text(json.dumps(payload, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (curves, bars) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[2, 1])
    for run, style in ((baseline, "-"), (fused, "--")):
        curves.plot(run.losses, style, label=run.name, linewidth=1.2)
    curves.set_xlabel("step")
    curves.set_ylabel("training loss (nats)")
    curves.set_title(f"{meta['arch'].upper()} on the Python stdlib, V={meta['vocab']}")
    curves.legend()
    names = [baseline.name, fused.name]
    rates = [baseline.tokens_per_s / 1e3, fused.tokens_per_s / 1e3]
    bars.bar([0, 1], rates, color=["tab:gray", "tab:blue"])
    bars.set_xticks([0, 1], names)
    bars.set_ylabel("thousand tokens/s")
    if baseline.peak_memory_gb is not None:
        memory = bars.twinx()
        memory.plot([0, 1], [baseline.peak_memory_gb, fused.peak_memory_gb], "o", color="tab:red")
        memory.set_ylabel("peak memory (GiB)", color="tab:red")
        memory.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out_dir / f"demo_{meta['arch']}.png", dpi=110)
    plt.close(fig)
