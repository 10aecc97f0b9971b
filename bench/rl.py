"""RL and preference-training log-prob calls of a Qwen2.5-shaped head, every method in one run.

Heads shaped like Qwen2.5 1.5B (Q1: D 1536, V 151936) and 7B (Q7: D 3584, V 152064), bf16
hidden states and classifier, both trained; 8 x 2048 completion tokens sampled from the policy
at temperature 0.9, 20% of them padding (-100 at the end of each sequence, 0-40% per row).
Four calls, as trainers make them:

* ``grad``     policy log-probs with a gradient, loss -(adv * logp * mask).sum() / count
               (one random advantage per sequence: GRPO's loss at importance ratio 1);
* ``entropy``  the same minus 0.01 x the masked entropy mean, the entropy differentiated;
* ``nograd``   log-probs under no_grad (old-policy and reference log-probs), forward only;
* ``dpo``      DPO's policy call at T = 1 (TRL's DPO never scales): per-token log-probs summed
               per sequence (chosen: the batch's first half, rejected: the second), the sigmoid
               loss with beta 0.1 against fixed reference sums, and the per-token metrics TRL's
               DPO and WPO log (entropy, mean logit, log sum p^2, target is argmax), no gradient.

The methods (``--methods``) are described in bench/rl_heads.py: torch.compile and eager of TRL's
default code, cce_compile, TRL's fused head, Liger's GRPO loss and scaled cross-entropy, verl's
FusedLinearForPPO and Triton kernel. The ``CORE`` ones run first over every shape and call, then
the others, so that a run cut short by ``--budget-s`` keeps the comparisons that matter.

Per method and call: median time of CUDA events after warm-up, the first call's time (compile,
autotune), extra memory (peak minus inputs and gradients), and errors against a float64
reference of the same loss: loss, log-probs and entropy (relative, valid rows), d hidden and
d classifier (relative), DPO's metrics. Ratios are against ``compile`` in the same run.
Writes ``rl.json`` (after every measurement) and ``rl.md`` into ``--out``.

    python bench/rl.py --out $OUT/rl                   # both shapes, every method
    python bench/rl.py --quick --out $OUT/rl           # 2 x 1024 tokens, 3 reps: a smoke run
    python bench/rl.py --shapes Q7 --calls entropy,nograd --methods compile,cce,trl_fused_head

Without CUDA it runs at a tiny size on the CPU (times only; methods that need CUDA say why).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import subprocess
import sys
import time
import traceback
import zipfile

import torch

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # PYTHONPATH first
from rl_heads import (  # noqa: E402  (bench/rl_heads.py)
    CALLS,
    DPO_REF_SPREAD,
    GiB,
    NotApplicable,
    Problem,
    dpo_loss,
    entropy_bonus_loss,
    forward_of,
    grpo_loss,
    make_problem,
    method_heads,
)

SHAPES = {"Q1": (1536, 151936), "Q7": (3584, 152064)}  # name: (D, V)
CORE = ("compile", "cce", "eager", "trl_fused_head", "liger_grpo", "liger_scaled_ce")
CORE += ("liger_scaled_ce_torch", "verl_ppo")
EXTRA = ("trl_logits_triton", "verl_triton", "cce_lean", "cce_fast")
PRIORITY = ("entropy", "nograd", "grad", "dpo")  # the issue's targets are on the first two
REPO = pathlib.Path(__file__).resolve().parents[1]


# ---- the float64 reference ----------------------------------------------------------------------
def _reference_chunks(p: Problem, temperature):
    """(rows, z, lse, probs) per chunk of rows, float64, ~1 GiB of logits at a time."""
    h = p.hidden.reshape(-1, p.hidden.shape[-1]).double()
    w = p.classifier.double()
    rows = max(1, GiB // (w.shape[0] * 8))
    for s in range(0, h.shape[0], rows):
        z = (h[s : s + rows] @ w.T) / temperature
        lse = torch.logsumexp(z, -1)
        yield slice(s, s + rows), h, w, z, lse, torch.exp(z - lse[:, None])


def reference_values(p: Problem, temperature):
    """Per-token float64 log-probs, entropy and DPO's metrics, (B, S) each."""
    names = ("logp", "entropy", "log_sum_sq_probs", "mean_logits", "argmax")
    parts = {name: [] for name in names}
    targets = p.safe_targets.view(-1)
    for rows, _, _, z, lse, probs in _reference_chunks(p, temperature):
        parts["logp"].append(z.gather(-1, targets[rows, None])[:, 0] - lse)
        parts["entropy"].append(lse - (probs * z).sum(-1))
        parts["log_sum_sq_probs"].append(torch.logsumexp(2 * z, -1) - 2 * lse)
        parts["mean_logits"].append(z.mean(-1))
        parts["argmax"].append(z.argmax(-1))
    return {name: torch.cat(parts[name]).view(p.targets.shape) for name in names}


def reference_grads(p: Problem, temperature, upstream):
    """[(d hidden, d classifier)] float64 for each (g_logp, g_entropy or None) in ``upstream``:
    dz = g_lp (onehot - p) - g_H p (log p + H), divided by T."""
    targets = p.safe_targets.view(-1)
    grads = [
        (
            torch.zeros(p.hidden.shape, dtype=torch.float64, device=p.hidden.device).view(
                -1, p.hidden.shape[-1]
            ),
            torch.zeros_like(p.classifier, dtype=torch.float64),
        )
        for _ in upstream
    ]
    for rows, h, w, z, lse, probs in _reference_chunks(p, temperature):
        index = torch.arange(z.shape[0], device=z.device)
        for (g_lp, g_h), (dh, dw) in zip(upstream, grads):
            g = g_lp.reshape(-1)[rows]
            dz = -probs * g[:, None]
            dz[index, targets[rows]] += g
            if g_h is not None:
                entropy = lse - (probs * z).sum(-1)
                dz -= g_h.reshape(-1)[rows, None] * probs * (z - lse[:, None] + entropy[:, None])
            dz /= temperature
            dh[rows] = dz @ w
            dw += dz.T @ h[rows]
    return [(dh.view(p.hidden.shape), dw) for dh, dw in grads]


def references(p: Problem, seed=1):
    """call -> float64 loss, outputs and gradients; sets ``p.ref_seq`` (DPO's reference sums:
    the policy's own float64 sums plus N(0, 5^2) noise, so that margins are O(1))."""
    refs = {}
    values = reference_values(p, p.temperature)
    logp = values["logp"].clone().requires_grad_()
    entropy = values["entropy"].clone().requires_grad_()
    loss_grad = grpo_loss({"logp": logp}, p)
    loss_entropy = entropy_bonus_loss({"logp": logp, "entropy": entropy}, p)
    (g_grad,) = torch.autograd.grad(loss_grad, logp)
    g_lp, g_h = torch.autograd.grad(loss_entropy, (logp, entropy))
    (dh_a, dw_a), (dh_b, dw_b) = reference_grads(p, p.temperature, [(g_grad, None), (g_lp, g_h)])
    refs["grad"] = dict(values, loss=loss_grad.item(), dh=dh_a, dw=dw_a)
    refs["entropy"] = dict(values, loss=loss_entropy.item(), dh=dh_b, dw=dw_b)
    refs["nograd"] = dict(values)
    values = reference_values(p, 1.0)
    gen = torch.Generator(device=p.hidden.device).manual_seed(seed)
    noise = torch.randn(p.targets.shape[0], device=p.hidden.device, generator=gen)
    p.ref_seq = ((values["logp"] * p.mask).sum(-1) + DPO_REF_SPREAD * noise).float()
    logp = values["logp"].clone().requires_grad_()
    loss_dpo = dpo_loss({"logp": logp}, p)
    (g_dpo,) = torch.autograd.grad(loss_dpo, logp)
    ((dh_d, dw_d),) = reference_grads(p, 1.0, [(g_dpo, None)])
    refs["dpo"] = dict(values, loss=loss_dpo.item(), dh=dh_d, dw=dw_d)
    return refs


def rel_err(value, ref, rows=None):
    value, ref = value.double(), ref.double()
    if rows is not None:
        value, ref = value[rows], ref[rows]
    return ((value - ref).norm() / ref.norm().clamp(min=1e-300)).item()


def errors(loss, out, grads, ref, p: Problem):
    valid = p.valid
    err = {}
    if loss is not None and "logp" in out:  # (Liger's GRPO loss is PPO's surrogate, -A x ratio)
        err["loss_err"] = abs(loss.item() - ref["loss"]) / abs(ref["loss"])
    for name in ("logp", "entropy", "log_sum_sq_probs", "mean_logits"):
        if name in out:
            err[f"{name}_err"] = rel_err(out[name], ref[name], valid)
    if "is_top1" in out:
        expected = ref["argmax"] == p.safe_targets
        err["top1_mismatches"] = int((out["is_top1"].bool() != expected)[valid].sum())
    if grads is not None:
        err["dh_err"] = rel_err(grads[0], ref["dh"])
        err["dw_err"] = rel_err(grads[1], ref["dw"])
    return err


# ---- measuring ---------------------------------------------------------------------------
def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def median_ms(fn, reps, warmup, cuda):
    for _ in range(warmup):
        fn()
    _sync(cuda)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(method, call, p: Problem, ref, args):
    """One method on one call: first call's seconds, extra memory, errors, median time."""
    cuda = p.hidden.is_cuda
    trained = call != "nograd"
    h = p.hidden.detach().clone().requires_grad_(trained)
    w = p.classifier.detach().clone().requires_grad_(trained)
    forward = forward_of(method, call, p, args.verl_wheel, args.compile_backend)

    def step():
        h.grad = w.grad = None
        if not trained:
            with torch.no_grad():
                return forward(h, w)
        loss, out = forward(h, w)
        loss.backward()
        return loss, out

    t0 = time.perf_counter()
    step()
    _sync(cuda)
    first_s = time.perf_counter() - t0
    h.grad = w.grad = None
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss, out = step()
    _sync(cuda)
    record = {"first_s": round(first_s, 2)}
    if cuda:
        grad_bytes = sum(t.numel() * t.element_size() for t in (h, w)) if trained else 0
        record["extra_gib"] = (torch.cuda.max_memory_allocated() - base - grad_bytes) / GiB
    record.update(errors(loss, out, (h.grad, w.grad) if trained else None, ref, p))
    del loss, out
    record["ms"] = median_ms(step, args.reps, args.warmup, cuda)
    return record


def matmul_ms(p: Problem, args):
    h = p.hidden.view(-1, p.hidden.shape[-1])
    return median_ms(lambda: h @ p.classifier.T, args.reps, args.warmup, p.hidden.is_cuda)


def environment(args, cuda):
    from importlib.metadata import PackageNotFoundError, version

    env = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "commit": args.commit}
    for package in ("triton", "transformers", "trl", "liger-kernel"):
        try:
            env[package] = version(package)
        except PackageNotFoundError:
            env[package] = None
    env["verl"] = pathlib.Path(args.verl_wheel).name.split("-")[1] if args.verl_wheel else None
    if cuda:
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    else:
        env.update(gpu=None, cpu_threads=torch.get_num_threads())
    return env


def _cell(value, fmt):
    return "-" if value is None else format(value, fmt)


def markdown(results):
    env, cfg = results["environment"], results["config"]
    lines = [
        f"Device: {env['gpu'] or 'CPU'} · torch {env['torch']} · triton {env['triton']} · "
        f"transformers {env['transformers']} · trl {env['trl']} · liger-kernel "
        f"{env['liger-kernel']} · verl {env['verl']} · {env['date']} · commit {env['commit']}",
        "",
        f"{cfg['batch']} x {cfg['seq']} completion tokens, {cfg['ignored']:.1%} padding, bf16 "
        f"head (trained), T {cfg['temperature']} (DPO: 1); median of {cfg['reps']} timings after "
        f"{cfg['warmup']} warm-ups. ms: forward+backward (nograd: forward); x compile: against "
        "torch.compile of TRL's default code in this run; extra GiB: peak minus inputs and "
        "gradients; errors relative to float64 (log-probs and entropy over valid rows); "
        "top1 miss: rows whose target-is-argmax differs from float64's.",
    ]
    for shape in results["shapes"]:
        lines += [
            "",
            f"### {shape['shape']}: D {shape['D']}, V {shape['V']}, N {shape['N']} "
            f"(bf16 matmul {shape['matmul_ms']:.2f} ms)",
        ]
        for call, methods in shape["calls"].items():
            base = methods.get("compile", {})
            lines += [
                "",
                f"**{call}**",
                "",
                "| method | ms | x compile | extra GiB | x compile mem | first s | loss err "
                "| logp err | entropy err | dE err | dC err | metrics err (lssp / mean / "
                "top1 miss) |",
                "|---|" + "---|" * 11,
            ]
            for method, r in methods.items():
                if "ms" not in r:
                    lines.append(f"| {method} | {r.get('error', r.get('skipped', ''))[:110]} |")
                    continue
                x_time = r["ms"] / base["ms"] if base.get("ms") else None
                x_mem = (
                    r["extra_gib"] / base["extra_gib"]
                    if base.get("extra_gib") and r.get("extra_gib") is not None
                    else None
                )
                metrics = " / ".join(
                    _cell(r.get(k), f)
                    for k, f in (
                        ("log_sum_sq_probs_err", ".1e"),
                        ("mean_logits_err", ".1e"),
                        ("top1_mismatches", "d"),
                    )
                )
                lines.append(
                    f"| {method} | {r['ms']:.2f} | {_cell(x_time, '.2f')} | "
                    f"{_cell(r.get('extra_gib'), '.3f')} | {_cell(x_mem, '.3f')} | "
                    f"{r['first_s']:.1f} | {_cell(r.get('loss_err'), '.1e')} | "
                    f"{_cell(r.get('logp_err'), '.1e')} | {_cell(r.get('entropy_err'), '.1e')} | "
                    f"{_cell(r.get('dh_err'), '.1e')} | {_cell(r.get('dw_err'), '.1e')} | "
                    f"{metrics if call == 'dpo' else '-'} |"
                )
    return "\n".join(lines + summary(results))


def _ratio(shape, call, key, base="compile"):
    """cce's ``key`` over ``base``'s in one call of one shape, None where either is missing."""
    records = shape["calls"].get(call, {})
    ours, theirs = records.get("cce", {}), records.get(base, {})
    if ours.get(key) is None or not theirs.get(key):
        return None
    return ours[key] / theirs[key]


def summary(results):
    """The issue's targets for cce: with an entropy bonus at most 0.9x compile's time, 1/5 of
    its extra memory and 0.8x TRL's fused head; without a gradient at most 0.5x compile's time."""
    lines = [
        "",
        "Targets (cce): entropy call time / compile <= 0.9, extra memory / compile <= "
        "0.2, time / TRL's head <= 0.8; nograd call time / compile <= 0.5.",
        "",
        "| shape | entropy: x compile | x compile mem | x TRL head | nograd: x compile |",
        "|---|---|---|---|---|",
    ]
    for shape in results["shapes"]:
        cells = (
            _ratio(shape, "entropy", "ms"),
            _ratio(shape, "entropy", "extra_gib"),
            _ratio(shape, "entropy", "ms", "trl_fused_head"),
            _ratio(shape, "nograd", "ms"),
        )
        lines.append(f"| {shape['shape']} | " + " | ".join(_cell(c, ".2f") for c in cells) + " |")
    return lines


def _commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            text=True,
            capture_output=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/rl_run")
    parser.add_argument("--shapes", default="Q1,Q7")
    parser.add_argument("--calls", default=",".join(CALLS))
    parser.add_argument("--methods", default=",".join(CORE + EXTRA))
    parser.add_argument("--quick", action="store_true", help="2 x 1024 tokens, 3 reps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=None, help="override the shapes' D")
    parser.add_argument("--vocab", type=int, default=None, help="override the shapes' V")
    parser.add_argument("--pad", type=float, default=0.2, help="share of padding tokens")
    parser.add_argument("--temperature", type=float, default=0.9)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=280, help="start nothing after it")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--verl-wheel", default=None, help="default: .whl/**/verl-*.whl if any")
    parser.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.reps, args.warmup = 2, 1024, 3, 1
    if not torch.cuda.is_available():  # the CPU smoke size
        args.batch, args.seq = min(args.batch, 2), min(args.seq, 64)
        args.dim, args.vocab = args.dim or 64, args.vocab or 2000
        args.reps, args.warmup = min(args.reps, 2), min(args.warmup, 1)
    if args.verl_wheel is None:
        # (in a folder of its own: the device's `pip install .whl/*.whl` need not install it)
        found = sorted(map(str, (REPO / ".whl").glob("**/verl-*.whl")))
        args.verl_wheel = found[-1] if found else None
    if args.verl_wheel and not zipfile.is_zipfile(args.verl_wheel):
        parser.error(f"--verl-wheel {args.verl_wheel} is not a wheel")
    args.commit = args.commit or _commit()
    return args


def _skip_reason(method, cuda, heads):
    if method not in heads:
        return f"unknown method (known: {', '.join(heads)})"
    if heads[method][1] and not cuda:
        return "needs CUDA"
    return None


def main(argv=None):
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    heads = method_heads(args.verl_wheel)
    asked = args.methods.split(",")
    tiers = [[m for m in asked if m in CORE], [m for m in asked if m not in CORE]]
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results = {"environment": environment(args, cuda), "config": {}, "shapes": []}
    problems, refs = {}, {}
    for name in args.shapes.split(","):
        dim, vocab = args.dim or SHAPES[name][0], args.vocab or SHAPES[name][1]
        p = make_problem(args.batch, args.seq, dim, vocab, args.temperature, args.pad, device)
        refs[name] = references(p)
        problems[name] = p
        results["shapes"].append(
            {
                "shape": name,
                "D": dim,
                "V": vocab,
                "N": p.targets.numel(),
                "matmul_ms": matmul_ms(p, args),
                "calls": {c: {} for c in args.calls.split(",")},
            }
        )
        print(
            f"[{time.perf_counter() - start:6.1f}s] {name}: inputs and float64 references",
            flush=True,
        )
    results["config"] = dict(
        batch=args.batch,
        seq=args.seq,
        temperature=args.temperature,
        ignored=1 - p.count / p.targets.numel(),
        reps=args.reps,
        warmup=args.warmup,
        budget_s=args.budget_s,
    )
    for tier in tiers:  # call-major in PRIORITY order: a run cut short keeps the targets' calls
        for call in sorted(args.calls.split(","), key=PRIORITY.index):
            for shape in results["shapes"]:
                p, ref, records = (
                    problems[shape["shape"]],
                    refs[shape["shape"]],
                    shape["calls"][call],
                )
                for method in tier:
                    records[method] = _one(method, call, p, ref[call], args, heads, start, cuda)
                    print(
                        f"[{time.perf_counter() - start:6.1f}s] {shape['shape']} {call} "
                        f"{method}: {records[method]}",
                        flush=True,
                    )
                    (out_dir / "rl.json").write_text(json.dumps(results, indent=1))
    table = markdown(results)
    (out_dir / "rl.md").write_text(table + "\n")
    print(table)
    print(f"total {time.perf_counter() - start:.0f} s")
    return results


def _one(method, call, p, ref, args, heads, start, cuda):
    """One measurement, or why there is none: a method failing must not stop the run."""
    reason = _skip_reason(method, cuda, heads)
    if reason is None and time.perf_counter() - start > args.budget_s:
        reason = f"time budget ({args.budget_s:.0f} s) spent"
    if reason:
        return {"skipped": reason}
    torch._dynamo.reset()
    try:
        return measure(method, call, p, ref, args)
    except NotApplicable as exc:
        return {"skipped": str(exc)}
    except Exception as exc:  # a peer failing must not stop the run
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
