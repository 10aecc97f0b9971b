"""The tables of ``bench/multi_gpu.py``'s results (``multi_gpu.json``), as markdown::

    python bench/multi_gpu_report.py multi_gpu.json > multi_gpu.md

"Saved vs the float32 logits" is the unfused run's peak memory minus the fused run's, on each
rank, over the float32 logits the unfused loss makes on that rank (tokens x V / tp x 4 bytes).
"""

from __future__ import annotations

import json
import pathlib
import sys

GiB = 2**30


def _fmt(values, pattern="{:.2f}") -> str:
    return " / ".join(pattern.format(v) for v in values) if values else "-"


def header(results: dict) -> list[str]:
    env = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return [
        f"# Multi-GPU runs (issue 40), {env['date']}, commit {env['commit']}",
        "",
        f"* Device: {results['gpus']} x {env['gpus'][0] if env['gpus'] else '?'}; {versions}; "
        f"Python {env['python']}.",
        f"* Command: `{env['command']}` ({results.get('elapsed_s', '?')} s of a "
        f"{results['budget_s']:.0f} s budget).",
        *[f"* Skipped: {name} ({why})." for name, why in results.get("skipped", {}).items()],
        "",
    ]


def titan(part: dict) -> list[str]:
    lines = ["## torchtitan's trainer (bench/multi_gpu_titan.py)", ""]
    if "ranks" not in part:
        return lines + [f"Did not finish: {part}", ""]
    flavor = part["flavor"]
    tokens = part["local_batch"] * part["seq_len"]
    lines += [
        f"torchtitan {part['torchtitan']}, torch {part['torch']}; debug Llama dim "
        f"{flavor['dim']}, {flavor['layers']} layers, V {flavor['vocab']}; {part['steps']} steps "
        f"of {part['local_batch']} x {part['seq_len']} tokens a rank (a data-parallel rank's "
        "own batch; TP ranks share one). Medians after 5 steps; per rank: rank 0 / rank 1 / ...",
        "",
        "| layout | run | fused (log line) | tokens/s per rank | vs unfused | peak GiB per rank | "
        "saved vs the float32 logits |",
        "|---|---|---|---|---|---|---|",
    ]
    by_run: dict = {}
    for rank in part["ranks"]:
        for run in rank["runs"]:
            by_run.setdefault((run["layout"], run["variant"]), []).append(run)
    for (layout, variant), runs in by_run.items():
        base = by_run.get((layout, "unfused"))
        speed = [r["tokens_per_s"] for r in runs]
        peaks = [r["peak_gib"] for r in runs]
        ratio = saved = "-"
        if base and variant != "unfused":
            ratio = _fmt(
                [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, base)], "{:.3f}x"
            )
            tp = 2 if "tp2" in layout else 1
            logits = tokens * -(-flavor["vocab"] // tp) * 4 / GiB
            saved = _fmt(
                [(b["peak_gib"] - r["peak_gib"]) / logits for r, b in zip(runs, base)], "{:.0%}"
            )
        logged = "yes" if all(r["fused_logged"] for r in runs) else "no"
        lines.append(
            f"| {layout} | {variant} | {logged} | {_fmt(speed, '{:,.0f}')} | {ratio} | "
            f"{_fmt(peaks)} | {saved} |"
        )
    lines += [
        "",
        "Loss curves against the unfused run's (|difference| over the steps; the one-ulp run is "
        "torchtitan against itself, the yardstick):",
        "",
        "| layout | fused: max / mean | one ulp: max / mean | fused within the yardstick |",
        "|---|---|---|---|",
    ]
    for layout, pair in part.get("agreement", {}).items():
        fused, ulp = pair.get("fused"), pair.get("unfused_ulp")
        within = "-" if not (fused and ulp) else ("yes" if fused["max"] <= ulp["max"] else "no")
        cells = [
            "-" if d is None else f"{d['max']:.2e} / {d['mean']:.2e} ({d['steps']} steps)"
            for d in (fused, ulp)
        ]
        lines.append(f"| {layout} | {cells[0]} | {cells[1]} | {within} |")
    failures = {k: v for rank in part["ranks"] for k, v in rank["failures"].items()}
    lines += [f"* failed: {k}: `{v[-300:]}`" for k, v in failures.items()]
    return lines + [""]


def trainer(part: dict) -> list[str]:
    lines = [
        "## HF Trainer under accelerate launch (bench/multi_gpu_trainer.py)",
        "",
        "`torch_compile=True` in every run, bf16 mixed precision; `fused`: with `CCE_COMPILE=1` "
        "(the script imports nothing of cce_compile). `rewritten`: "
        "`torch._dynamo.utils.counters['cce_compile']['rewritten']` printed by each rank. Loss "
        "vs unfused: the largest relative difference of the logged losses over the steps.",
        "",
        "| run | rewritten per rank | tokens/s per rank | vs unfused | peak GiB per rank | "
        "saved vs the float32 logits | loss vs unfused | steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in part.items():
        ranks = [r for r in run.get("ranks", []) if "losses" in r]
        if not ranks:
            lines.append(f"| {name} | {run.get('skipped') or run.get('status')} | | | | | | |")
            continue
        base_runs = part.get(name.replace("-fused", "-unfused"), {}).get("ranks", [])
        base = [r for r in base_runs if "losses" in r] if name.endswith("-fused") else []
        ratio = saved = diff = "-"
        if base:
            ratio = _fmt(
                [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(ranks, base)], "{:.3f}x"
            )
            model = ranks[0]["model"]
            logits = model["batch"] * model["seq_len"] * model["vocab"] * 4 / GiB
            saved = _fmt(
                [(b["peak_gib"] - r["peak_gib"]) / logits for r, b in zip(ranks, base)], "{:.0%}"
            )
            pairs = list(zip(ranks[0]["losses"], base[0]["losses"]))
            diff = f"{max(abs(a - b) / abs(b) for a, b in pairs):.1e}" if pairs else "-"
        rewritten = " / ".join(str(r["cce_compile"].get("rewritten", 0)) for r in ranks)
        lines.append(
            f"| {name} ({ranks[0]['wrapped']}) | {rewritten} | "
            f"{_fmt([r['tokens_per_s'] for r in ranks], '{:,.0f}')} | {ratio} | "
            f"{_fmt([r['peak_gib'] for r in ranks])} | {saved} | {diff} | "
            f"{len(ranks[0]['losses'])} |"
        )
    return lines + [""]


def ddp(part: dict) -> list[str]:
    lines = ["## DDP under torch.compile (bench/multi_gpu_ddp.py)", ""]
    if "ranks" not in part:
        return lines + [f"Did not finish: {part}", ""]
    shape = part["shape"]
    lines += [
        f"float32, dim {shape['dim']}, V {shape['vocab']}, auxiliary head {shape['aux']} x dim, "
        f"{shape['rows']} tokens a rank, 2 SGD steps against eager DDP; "
        f"`optimize_ddp` = {part['optimize_ddp']}. `pieces`: graphs DDPOptimizer cut the frame "
        "into; `op in piece`: which of them holds the fused op.",
        "",
        "| case | rewritten per rank | pieces | op in piece | worst error / tolerance | ok |",
        "|---|---|---|---|---|---|",
    ]
    by_case: dict = {}
    for rank in part["ranks"]:
        for row in rank["rows"]:
            by_case.setdefault(row["case"], []).append(row)
    for case, rows in by_case.items():
        worst = max(r["worst_error"] for r in rows)
        lines.append(
            f"| {case} | {' / '.join(str(r['rewritten']) for r in rows)} | "
            f"{rows[0]['pieces'] if rows[0]['pieces'] is not None else '-'} | "
            f"{rows[0]['op_in_piece'] if rows[0]['op_in_piece'] is not None else '-'} | "
            f"{worst:.1e} / {rows[0]['tolerance']:.0e} | "
            f"{'yes' if all(r['ok'] for r in rows) else '**no**'} |"
        )
    failures = {k: v for rank in part["ranks"] for k, v in rank["failures"].items()}
    lines += [f"* failed: {k}: `{v[-300:]}`" for k, v in failures.items()]
    return lines + [""]


def vp(part: dict) -> list[str]:
    lines = ["## Vocabulary-parallel loss against loss_parallel (bench/distributed.py)", ""]
    text = part.get("markdown")
    if not text:
        return lines + [f"Did not finish: { {k: v for k, v in part.items()} }", ""]
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    return lines + [body.replace("\n## ", "\n### ")]


def markdown(results: dict) -> str:
    lines = header(results)
    if "titan03" in results:
        probe = results["titan03"]
        lines += [
            "## torchtitan 0.3.0 beside this torch",
            "",
            "```",
            str(probe.get("output") or probe).strip()[-1500:],
            "```",
            "",
        ]
    for name, render in (("titan", titan), ("trainer", trainer), ("ddp", ddp), ("vp", vp)):
        if name in results:
            lines += render(results[name])
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(json.loads(pathlib.Path(sys.argv[1]).read_text())), end="")
