"""Gradient filtering on a trained model's head: real softmax sparsity, not random inputs.

Random inputs have a flat softmax, so nothing can be skipped; this benchmark trains the demo's
GPT on real text (the Python standard library), takes the hidden states of held-out text and
the trained (tied) classifier, and compares, on those tensors, torch.compile, cce lean, lean
with filtering at the default beta (and a looser one), fast, and Apple's CCE (default filter,
and ``cce_kahan_full_c``). Two heads: "pretraining" (the model trained on slice A, evaluated on
its held-out end) and "fine-tuning" (then trained on slice B, a different part of the corpus,
and evaluated there). Vocabulary sorting is measured on the same head: the classifier's rows
(and the targets) permuted by token frequency, so that the frequent, non-negligible classes
share blocks.

Reports, per head and method: forward+backward and backward time (CUDA events, medians), the
kept block / tile fractions (``filtering.report()``), and gradient errors against a float32
reference next to eager bf16's. Writes ``filtering.json`` and ``filtering.md`` into ``--out``.

    python bench/grad_filter_bench.py --out bench/results/filtering
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import bench  # noqa: E402  (bench/bench.py: timing, reference, peers)
import cce_compile  # noqa: E402
from cce_compile import filtering  # noqa: E402
from cce_compile.demo import corpus  # noqa: E402
from cce_compile.demo.models import ModelConfig, build  # noqa: E402
from cce_compile.demo.train import batches  # noqa: E402

DEFAULT_BETA = 2.0**-12
METHODS = [
    "torch_compile",
    "cce_lean",
    "cce_lean_filter",
    "cce_lean_filter_loose",
    "cce_fast",
    "apple_cce",
    "apple_cce_kahan_full_c",
]


def filtered(beta):
    return lambda h, c, t: cce_compile.linear_cross_entropy(h, c, t, mode="lean", grad_filter=beta)


def factories():
    methods = bench.method_factories()
    methods["cce_lean_filter"] = lambda: filtered(DEFAULT_BETA)
    methods["cce_lean_filter_loose"] = lambda: filtered(2.0**-8)

    def apple_kahan():
        from cut_cross_entropy import linear_cross_entropy

        return lambda h, c, t: linear_cross_entropy(h, c, t, impl="cce_kahan_full_c")

    methods["apple_cce_kahan_full_c"] = apple_kahan
    return methods


def train(model, ids, steps, args, seed):
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = torch.compile(model.forward, backend=cce_compile.backend)
    data = batches(ids, args.batch, args.context, seed, "cuda")
    for i in range(steps):
        x, y = next(data)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = step(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i % 100 == 0 or i == steps - 1:
            print(f"  step {i} loss {loss.item():.3f}", flush=True)
    return loss.item()


@torch.no_grad()
def head(model, ids, args, seed):
    """(hidden (N, D) bf16, classifier (V, D) bf16, targets (N,)) of held-out text."""
    x, y = next(batches(ids, args.batch, args.context, seed, "cuda"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model.hidden(x)
    return (
        hidden.reshape(-1, hidden.shape[-1]).bfloat16().contiguous(),
        model.lm_head.weight.detach().bfloat16().contiguous(),
        y.reshape(-1).contiguous(),
    )


def frequency_order(ids, vocab):
    """Class ids, most frequent first."""
    counts = torch.bincount(ids.long(), minlength=vocab)
    return torch.argsort(counts, descending=True)


def run_methods(name, tensors, args, out):
    hidden, classifier, targets = tensors
    ref = bench.reference_grads(hidden, classifier, targets)
    results = {}
    for method in METHODS:
        factory = factories().get(method)
        torch._dynamo.reset()
        try:
            r = bench.bench_method(
                factory(), hidden, classifier, targets, args.reps, args.warmup, ref
            )
            r["bwd_ms"] = r["fwd_bwd_ms"] - r["fwd_ms"]
            if "filter" in method:
                r["filter"] = filtering.report()
        except Exception as exc:  # a peer failing must not stop the run
            r = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        results[method] = r
        print(f"[{name}] {method}: {r}", flush=True)
    out[name] = {
        "N": hidden.shape[0],
        "D": hidden.shape[1],
        "V": classifier.shape[0],
        "loss_ref": ref[0],
        "methods": results,
    }


def markdown(results):
    env = results["environment"]
    lines = [
        f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · "
        f"cut-cross-entropy {env.get('cut_cross_entropy', '-')}",
        "",
        f"Heads of the demo GPT trained on the stdlib corpus ({results['args']['steps']} steps "
        f"+ {results['args']['finetune_steps']} fine-tuning steps). Default beta = 2^-12, "
        "loose = 2^-8. Times: medians (ms); errors: ||g - g_fp32|| / ||g_fp32||.",
        "",
    ]
    for name, head_results in results["heads"].items():
        methods = head_results["methods"]
        compile_ms = methods.get("torch_compile", {}).get("fwd_bwd_ms")
        lean_bwd = methods.get("cce_lean", {}).get("bwd_ms")
        lines += [
            f"### {name}: N={head_results['N']} D={head_results['D']} V={head_results['V']}, "
            f"reference loss {head_results['loss_ref']:.3f}",
            "",
            "| method | fwd+bwd ms | x compile | bwd ms | bwd speed-up vs lean | kept blocks | "
            "kept tiles | extra GiB | dE err | dC err |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, r in methods.items():
            if "error" in r:
                lines.append(f"| {method} | {r['error'][:90]} |||||||||")
                continue
            stats = r.get("filter") or {}
            lines.append(
                f"| {method} | {r['fwd_bwd_ms']:.2f} | {r['fwd_bwd_ms'] / compile_ms:.2f} | "
                f"{r['bwd_ms']:.2f} | {lean_bwd / r['bwd_ms']:.2f} | "
                f"{stats.get('kept_blocks', float('nan')):.4f} | "
                f"{stats.get('kept_tiles', float('nan')):.4f} | {r['extra_memory_gb']:.3f} | "
                f"{r['grad_hidden_err']:.2e} | {r['grad_classifier_err']:.2e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--finetune-steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-bytes", type=int, default=None)
    parser.add_argument("--out", default="bench/results/filtering")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _, ids = corpus.load(args.vocab, pathlib.Path("/tmp/cce_corpus"), args.max_bytes)
    split = int(0.8 * ids.numel())
    slice_a, slice_b = ids[:split], ids[split:]
    cfg = ModelConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, context=args.context)
    torch.manual_seed(0)
    model = build("gpt", cfg).cuda()
    print(f"corpus {ids.numel()} tokens in {time.time() - started:.0f} s; training", flush=True)
    results = {"environment": bench.environment(), "args": vars(args), "heads": {}}
    results["pretrain_loss"] = train(model, slice_a, args.steps, args, seed=0)
    pretrain = head(model, slice_a[-(args.batch * (args.context + 1) * 4) :], args, seed=1)
    run_methods("pretraining", pretrain, args, results["heads"])
    order = frequency_order(slice_a, args.vocab)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    hidden, classifier, targets = pretrain
    sorted_head = (hidden, classifier[order.cuda()].contiguous(), rank.cuda()[targets])
    run_methods("pretraining, vocabulary sorted by frequency", sorted_head, args, results["heads"])
    results["finetune_loss"] = train(model, slice_b, args.finetune_steps, args, seed=2)
    run_methods("fine-tuning", head(model, slice_b, args, seed=3), args, results["heads"])
    (out / "filtering.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / "filtering.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("filtering.py needs a CUDA GPU")
    main()
