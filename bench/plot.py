"""Draws the loss head's time against its extra memory, every method as a ratio to torch.compile.

Reads the committed results (``bench/results/loss_head.json``, transcribed from the tables of
``bench/results/loss_head.md``) and writes ``docs/performance.png``: one panel per scenario
(bf16 or AMP; 10% ignored, frozen classifier, 50% ignored), one marker per method, shapes E
(filled) and B (hollow), torch.compile at (1, 1). The title and caption name the device, the
versions, the dates and the commits from the data file, so a new run needs only new rows there.

    .venv/bin/python -m pip install -e ".[bench]"    # matplotlib
    .venv/bin/python bench/plot.py
    .venv/bin/python bench/plot.py --data bench/results/loss_head.json --out docs/performance.png
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
PANELS = (("bf16", "bf16-frozen", "bf16-ign50"), ("amp", "amp-frozen", "amp-ign50"))
STYLE = {  # method: (label, marker, colour); the order is the legend's
    "torch_compile": ("torch.compile", "*", "black"),
    "default": ("cce_compile (default)", "o", "tab:blue"),
    "lean": ("cce_compile, lean", "s", "tab:cyan"),
    "trl_fused_head": ("TRL's fused head", "D", "tab:green"),
    "liger": ("Liger", "^", "tab:orange"),
    "apple_cce": ("Apple's CCE", "v", "tab:red"),
}
SHAPE_FILL = {"E": True, "B": False}
MEMORY_FLOOR = 1e-3  # a ratio recorded below it (0.000 at three decimals) is drawn on the floor
X_LIMITS, Y_LIMITS = (MEMORY_FLOOR / 1.6, 2.0), (0.45, 3.0)


def load(path: pathlib.Path) -> dict:
    data = json.loads(path.read_text())
    unknown = {row["method"] for row in data["rows"]} - STYLE.keys()
    if unknown:
        raise SystemExit(f"{path}: no marker for methods {sorted(unknown)}")
    return data


def draw_panel(ax, rows: list[dict], scenario: str, title: str) -> list[tuple[str, str, str]]:
    """One scenario's points; returns what it could not draw, for the caption."""
    missing = []
    for row in rows:
        if row["scenario"] != scenario:
            continue
        label, marker, colour = STYLE[row["method"]]
        if "fails" in row or row.get("memory_x") is None:
            reason = f"fails: {row['fails']}" if "fails" in row else "its memory was not recorded"
            missing.append((label, reason, scenario))
            continue
        if row["method"] == "torch_compile" and row["shape"] == "B":
            continue  # (1, 1) at both shapes: one star
        filled = SHAPE_FILL[row["shape"]]
        ax.scatter(
            max(row["memory_x"], MEMORY_FLOOR),
            row["time_x"],
            marker=marker,
            s=130 if marker == "*" else 70,
            facecolors=colour if filled else "none",
            edgecolors=colour,
            linewidths=1.6,
            zorder=3,
        )
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--", zorder=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*X_LIMITS)
    ax.set_ylim(*Y_LIMITS)
    ax.set_yticks([0.5, 0.75, 1, 1.5, 2, 3], labels=["0.5", "0.75", "1", "1.5", "2", "3"])
    ax.set_yticks([], minor=True)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.25)
    return missing


def caption(data: dict, missing: list[tuple[str, str, str]]) -> str:
    """Which run each method's points come from, and what is not drawn."""
    lines = []
    for run in data["runs"].values():
        in_run = {r["method"] for r in data["rows"] if r["run"] == run["commit"]}
        methods = [label for m, (label, _, _) in STYLE.items() if m in in_run - {"torch_compile"}]
        shared = ("torch", "triton", "cuda")  # in the title
        versions = ", ".join(f"{k} {v}" for k, v in run["versions"].items() if k not in shared)
        lines.append(
            f"{', '.join(methods)}: {run['date']}, commit {run['commit']} (code of {run['code']}), "
            f"ratios to that run's torch.compile; {versions}."
        )
    shapes = "; ".join(
        f"{'filled' if SHAPE_FILL[s] else 'hollow'}: {s} ({d})" for s, d in data["shapes"].items()
    )
    lines.append(f"{shapes}. Forward+backward of the loss head, bench/bench.py.")
    lines.append(
        f"A memory ratio below {MEMORY_FLOOR:g} (0.000 at three decimals) is drawn at "
        f"{MEMORY_FLOOR:g}. Data: bench/results/loss_head.json."
    )
    not_drawn = {}
    for label, reason, scenario in missing:
        not_drawn.setdefault((label, reason), []).append(scenario)
    for (label, reason), scenarios in not_drawn.items():
        names = ", ".join(dict.fromkeys(scenarios))
        lines.append(f"Not drawn: {label} in scenarios {names} ({reason}).")
    return "\n".join(lines)


def plot(data: dict, out: pathlib.Path) -> None:
    runs = list(data["runs"].values())
    first = runs[0]
    fig, axes = plt.subplots(2, 3, figsize=(13, 9), sharex=True, sharey=True)
    missing: list[tuple[str, str, str]] = []
    for row_axes, scenarios in zip(axes, PANELS):
        for ax, scenario in zip(row_axes, scenarios):
            missing += draw_panel(ax, data["rows"], scenario, data["scenarios"][scenario])
    for ax in axes[-1]:
        ax.set_xlabel("extra memory / torch.compile's (log)")
    for ax in axes[:, 0]:
        ax.set_ylabel("time / torch.compile's (log)")
    handles = [
        Line2D([], [], ls="", marker=m, ms=11 if m == "*" else 8, mfc=c, mec=c, label=label)
        for label, m, c in STYLE.values()
    ]
    handles += [
        Line2D([], [], ls="", marker="o", ms=8, mfc="grey" if fill else "none", mec="grey")
        for fill in SHAPE_FILL.values()
    ]
    for handle, shape in zip(handles[-len(SHAPE_FILL) :], SHAPE_FILL):
        handle.set_label(f"shape {shape}")
    fig.legend(
        handles=handles, loc="upper center", ncol=8, frameon=False, bbox_to_anchor=(0.5, 0.925)
    )
    dates = sorted({run["date"] for run in runs})
    versions = first["versions"]
    fig.suptitle(
        "The loss head against torch.compile (1, 1): lower is faster, left holds less memory\n"
        f"one {first['device']}, torch {versions['torch']}, triton {versions['triton']}, "
        f"CUDA {versions['cuda']}; {', '.join(dates)}",
        fontsize=13,
        y=0.995,
    )
    fig.text(0.01, 0.005, caption(data, missing), fontsize=8.5, va="bottom", ha="left")
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.2, top=0.85, hspace=0.2, wspace=0.05)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=pathlib.Path, default=REPO / "bench/results/loss_head.json")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "docs/performance.png")
    args = parser.parse_args()
    plot(load(args.data), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
