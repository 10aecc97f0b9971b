"""End-to-end training step of a Hugging Face Llama: torch.compile against the cce pass.

The recipe users run: mixed precision (float32 weights, bf16 autocast), AdamW, and the step
that computes the loss compiled (``model(ids, labels=labels).loss``). Each variant builds the
same model from the same seed, compiles, warms up, then times ``--steps`` steps with CUDA
events and reads the peak of torch's allocator over the timed steps. Writes ``e2e.json`` and
``e2e.md`` (with GPU, torch, triton and transformers versions) into ``--out``.

    python bench/e2e_llama.py --out bench/results/e2e          # compile, cce (default), cce lean
    python bench/e2e_llama.py --layers 16 --batch 4 --labels sft50 --variants compile,cce
    python bench/e2e_llama.py --layers 16 --batch 4 --lora --variants compile,cce
    python bench/e2e_llama.py --layers 16 --cap-gib 20 --variants compile,cce   # largest batch

``--labels sft50`` masks the first half of every sequence's labels (-100), as supervised
fine-tuning masks its prompts; ``--lora`` trains LoRA adapters (peft, rank 16 on every
projection) with the base model and the head frozen, or, without peft, freezes every matrix
and the head and trains the norms; ``--cap-gib`` caps the allocator and searches, per variant,
the largest batch (in steps of 2) that trains under it, and its tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import pathlib
import statistics
import sys
import time
from unittest import mock

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

GiB = 2**30
# variant -> (torch.compile backend, cce_compile settings)
VARIANTS = {
    "compile": ("inductor", {}),
    "cce": ("cce", {}),
    "cce_lean": ("cce", {"mode": "lean"}),
    "cce_fast": ("cce", {"mode": "fast"}),
    "cce_every_row": ("cce", {"skip_ignored": False}),  # no compaction, no host sync
    "cce_count_first": ("cce", {}),  # the kept rows' count waited for first (count_first)
}


def count_first(name):
    """For ``cce_count_first``: ``bench.count_first_selection`` in place of the kept-first
    order, for the variant's run."""
    if name != "cce_count_first":
        return contextlib.nullcontext()
    from bench import count_first_selection
    from cce_compile.op import compaction

    return mock.patch.object(compaction, "_kept_first", count_first_selection)


def build_model(args):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=args.hidden // 256,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).cuda()
    if args.lora:
        model = _with_lora(model)
    model.train()
    return model


def _with_lora(model):
    """LoRA adapters on every projection, base and head frozen (peft); without peft, every
    matrix and the head frozen and the norms trained."""
    try:
        import peft
    except ImportError:
        for name, parameter in model.named_parameters():
            parameter.requires_grad_("norm" in name)
        return model
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def batch(args, step, size=None):
    gen = torch.Generator(device="cuda").manual_seed(step)
    size = size or args.batch
    ids = torch.randint(0, args.vocab, (size, args.seq), device="cuda", generator=gen)
    labels = ids.clone()
    if args.labels == "sft50":  # the prompt half of every sequence carries no loss
        labels[:, : args.seq // 2] = -100
    return ids, labels


def _training(name, args):
    """(train_step(step, batch_size) -> loss, settings) for a variant: model, optimizer and
    the compiled loss step, built from the same seed for every variant."""
    import cce_compile

    backend, settings = VARIANTS[name]
    torch._dynamo.reset()
    model = build_model(args)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)

    def loss_of(ids, labels):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=labels).loss

    # The backend object, not its name: a source tree has no entry point registering "cce".
    step_fn = torch.compile(
        loss_of,
        backend=cce_compile.backend if backend == "cce" else backend,
        # One graph for every batch size a capped search tries; --dynamic asks for it alone.
        dynamic=True if args.cap_gib or args.dynamic else None,
    )

    def train_step(i, size=None):
        ids, labels = batch(args, i, size)
        loss = step_fn(ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return train_step, settings


def _timed(train_step, first: int, steps: int, size=None) -> tuple[list[float], list[float]]:
    """(CUDA-event step times in ms, losses) of ``steps`` steps from step ``first``."""
    times, losses = [], []
    for i in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = train_step(first + i, size)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        losses.append(loss.item())
    return times, losses


def run_variant(name, args):
    import cce_compile

    train_step, settings = _training(name, args)
    with cce_compile.config.override(**settings), count_first(name):
        started = time.perf_counter()
        losses = [train_step(i).item() for i in range(args.warmup)]
        compile_s = time.perf_counter() - started
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times, timed_losses = _timed(train_step, args.warmup, args.steps)
        peak = torch.cuda.max_memory_allocated()
    rewritten = dict(torch._dynamo.utils.counters["cce_compile"])
    step_ms = statistics.median(times)
    return {
        "step_ms": step_ms,
        "step_all_ms": times,
        "tokens_per_s": args.batch * args.seq / step_ms * 1e3,
        "peak_gib": peak / GiB,
        "first_steps_s": compile_s,
        "losses": losses + timed_losses,
        "cce_counters": rewritten,
    }


def run_capped(name, args):
    """The largest batch (steps of 2) that trains under ``--cap-gib``, and the best tokens/s
    over the batches that fit."""
    import cce_compile

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
    train_step, settings = _training(name, args)
    fits: dict[int, float] = {}
    try:
        with cce_compile.config.override(**settings):
            size = 2
            while size <= args.max_batch:
                try:
                    train_step(0, size)  # warm-up (and the one compile)
                    times, _ = _timed(train_step, 1, args.cap_steps, size)
                except torch.OutOfMemoryError:
                    break
                fits[size] = size * args.seq / statistics.median(times) * 1e3
                size += 2
    finally:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)
    best = max(fits, key=fits.get) if fits else None
    return {
        "cap_gib": args.cap_gib,
        "max_batch": max(fits) if fits else 0,
        "tokens_per_s_by_batch": fits,
        "best_batch": best,
        "tokens_per_s": fits.get(best, 0.0),
    }


def environment():
    import transformers
    import triton

    return {
        "gpu": torch.cuda.get_device_properties(0).name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
    }


def markdown_capped(results):
    env, args = results["environment"], results["args"]
    base = results["variants"].get("compile", {})
    lines = [
        f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · "
        f"transformers {env['transformers']}",
        "",
        f"HF Llama: {args['layers']} layers, hidden {args['hidden']}, V {args['vocab']}; "
        f"sequences of {args['seq']} tokens, labels {args['labels']}, lora {args['lora']}; "
        f"allocator capped at {args['cap_gib']} GiB; batches in steps of 2.",
        "",
        "| variant | largest batch | best batch | tokens/s there | x compile's best |",
        "|---|---|---|---|---|",
    ]
    for name, r in results["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error'][:100]} ||||")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base.get("tokens_per_s") else None
        lines.append(
            f"| {name} | {r['max_batch']} | {r['best_batch']} | {r['tokens_per_s']:,.0f} | "
            f"{'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    lines.append("")
    for name, r in results["variants"].items():
        rates = ", ".join(f"{b}: {t:,.0f}" for b, t in r.get("tokens_per_s_by_batch", {}).items())
        lines.append(f"* {name}, tokens/s by batch: {rates or '-'}")
    return "\n".join(lines)


def markdown(results):
    if results["args"]["cap_gib"]:
        return markdown_capped(results)
    env, args = results["environment"], results["args"]
    logits_gib = args["batch"] * args["seq"] * args["vocab"] * 2 / GiB
    base = results["variants"].get("compile", {})
    lines = [
        f"GPU: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · "
        f"transformers {env['transformers']}",
        "",
        f"HF Llama: {args['layers']} layers, hidden {args['hidden']}, V {args['vocab']}; "
        f"{args['batch']} x {args['seq']} tokens, labels {args['labels']}, lora {args['lora']}; "
        f"bf16 autocast, float32 weights, fused AdamW"
        f"{', compiled with dynamic=True' if args.get('dynamic') else ''}; "
        f"median of {args['steps']} steps. "
        f"bf16 logits: {logits_gib:.2f} GiB.",
        "",
        "| variant | step ms | tokens/s | x compile | peak GiB | saved vs compile | "
        "saved / bf16 logits | first steps s | rewritten |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["variants"].items():
        if "error" in r:
            lines.append(f"| {name} | {r['error'][:100]} ||||||||")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if "tokens_per_s" in base else None
        saved = base["peak_gib"] - r["peak_gib"] if "peak_gib" in base else None
        lines.append(
            f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | "
            f"{ratio:.3f} | {r['peak_gib']:.2f} | "
            f"{saved:.2f} | {saved / logits_gib:.0%} | {r['first_steps_s']:.0f} | "
            f"{r['cce_counters'].get('rewritten', 0)} |"
            if ratio is not None
            else f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | - | "
            f"{r['peak_gib']:.2f} | - | - | {r['first_steps_s']:.0f} | - |"
        )
    return "\n".join(lines)


def add_step_arguments(parser, *, variants: str, layers: int, batch: int) -> None:
    """The model and step options (``build_model``, ``batch``, ``_training``), with these
    defaults; e2e_profile.py shares them."""
    parser.add_argument("--variants", default=variants)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--labels", choices=("all", "sft50"), default="all")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument(
        "--dynamic", action="store_true", help="compile with dynamic=True (as --cap-gib does)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_step_arguments(parser, variants="compile,cce,cce_lean", layers=4, batch=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cap-gib", type=float, default=None)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--cap-steps", type=int, default=3, help="timed steps per capped batch")
    parser.add_argument("--out", default="bench/results/e2e")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(), "args": vars(args), "variants": {}}
    for name in args.variants.split(","):
        try:
            run = run_capped if args.cap_gib else run_variant
            results["variants"][name] = run(name, args)
        except Exception as exc:  # one variant failing must not lose the others
            results["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        with contextlib.suppress(Exception):
            torch._dynamo.utils.counters.clear()
        gc.collect()  # the variant's model and optimizer state go with its frame
        torch.cuda.empty_cache()
        print(name, {k: v for k, v in results["variants"][name].items() if k != "losses"})
        (out / "e2e.json").write_text(json.dumps(results, indent=1, default=str))
    table = markdown(results)
    (out / "e2e.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("e2e_llama.py needs a CUDA GPU")
    main()
