"""bench/grpo_e2e.py's report: the markdown tables of the variants' runs and step-0 checks,
and of the largest number of generations each trains under the allocator's cap."""

from __future__ import annotations


def _probe_text(probe):
    peak = "" if probe["peak_gib"] is None else f" {probe['peak_gib']:.1f}"
    return f"{probe['generations']}: {'yes' if probe['fits'] else 'no'}{peak}"


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def markdown(results):
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Device: {env['gpu'] or 'CPU'} · torch {env['torch']} · triton {env['triton']} · "
        f"transformers {env['transformers']} · trl {env['trl']} · {env['date']} · "
        f"commit {env['commit']}",
        "",
        f"Qwen2 with random weights: {cfg['layers']} layers, hidden {cfg['hidden']}, V "
        f"{cfg['vocab']}; GRPO with transformers' generation, {cfg['generations']} completions "
        f"of {cfg['length']} tokens per step, T 0.9, beta 0.04, num_iterations 2, entropy_coef "
        f"0.01, {cfg['precision']}, gradient checkpointing; {cfg['steps']} steps, the first left "
        "out. Times in s; train tokens/s: completion tokens over a step that only trains; "
        "old/ref = new bits: step 0's no-grad policy and reference log-probs equal the grad "
        "call's (sorted); head calls: served by cce's op / handed to TRL's kernel.",
        "",
        "| variant | step s (generating) | step s (training only) | generate s | train tokens/s "
        "| x trl | e2e tokens/s | peak GiB | step-0 loss | entropy | kl | old = new bits | "
        "ref = new bits | logp err vs f64 | max diff vs trl | head calls |",
        "|---|" + "---|" * 15,
    ]
    base = results["variants"].get("trl", {}).get("train_tokens_per_s")
    for variant, r in results["variants"].items():
        if "error" in r:
            lines.append(f"| {variant} | {r['error'][:200]} |")
            continue
        s0, check = r.get("step0", {}), results["step0"].get(variant, {})
        counts = r.get("counts")
        calls = f"{counts['served']} served / {counts['handed_to_trl']} to TRL" if counts else "-"
        ratio = r["train_tokens_per_s"] / base if base and r.get("train_tokens_per_s") else None
        lines.append(
            f"| {variant} | {_fmt(r['step_s_generating'], '.2f')} | "
            f"{_fmt(r['step_s_training'], '.3f')} | {_fmt(r['generate_s'], '.2f')} | "
            f"{_fmt(r['train_tokens_per_s'], ',.0f')} | {_fmt(ratio, '.3f')} | "
            f"{_fmt(r['e2e_tokens_per_s'], ',.0f')} | {_fmt(r.get('peak_gib'), '.2f')} | "
            f"{_fmt(s0.get('loss'), '.6f')} | {_fmt(s0.get('entropy'), '.4f')} | "
            f"{_fmt(s0.get('kl'), '.2e')} | {check.get('old_equals_new_bits', '-')} | "
            f"{check.get('ref_equals_new_bits', '-')} | "
            f"{_fmt(check.get('logp_rel_err_f64'), '.1e')} | "
            f"{_fmt(check.get('logp_max_abs_diff_vs_trl'), '.1e')} | {calls} |"
        )
    if results["fit"]:
        lines += [
            "",
            f"Largest number of generations of {cfg['fit_length']} tokens that trains "
            f"one step with the allocator capped at {cfg['cap_gib']} GiB:",
            "",
            "| variant | fits | fails at | completion tokens | x trl | probes (n: fits, "
            "peak GiB) |",
            "|---|---|---|---|---|---|",
        ]
        base = results["fit"].get("trl", {}).get("largest")
        for variant, f in results["fit"].items():
            probes = ", ".join(map(_probe_text, f["probes"]))
            ratio = f["largest"] / base if base else None
            lines.append(
                f"| {variant} | {f['largest']} | {_fmt(f['smallest_failed'], 'd')} | "
                f"{f['tokens']:,} | {_fmt(ratio, '.2f')} | {probes} |"
            )
    return "\n".join(lines)
