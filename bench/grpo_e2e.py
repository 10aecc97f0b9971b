"""TRL's GRPOTrainer end to end on one GPU: TRL 1.16's fused LM head against cce_compile's op.

A Qwen2 with random weights (Qwen2.5-1.5B's widths: hidden 1536, MLP 8960, 12 heads, 2 KV heads,
tied embeddings, V 151936), ``--layers`` deep (2: the head weighs as in a real model, the run
stays short); a word-level tokenizer of V words built in memory, random prompts, a toy reward
(the share of even-numbered words). GRPOConfig's defaults (float32 weights under bf16 autocast,
gradient checkpointing, AdamW), transformers' own generation (no vLLM), temperature 0.9, beta
0.04 (a reference model), num_iterations 2 (each generation trains two steps: the old log-probs
come from a no-grad call), entropy_coef 0.01 (the entropy is differentiated). ``--generations``
completions of exactly ``--length`` tokens (min_new_tokens) per step, from one prompt.

Variants, in this process, from the same seed and saved model (the reference loads it too):
``trl``, TRL 1.16 as installed (its fused head's ``ChunkedLogProbFunction``); ``cce``,
``cce_compile.integrations.trl.install()`` (``counts()`` says which calls the op served);
``logits``, the logits materialised as TRL's code did before its fused head: ``hidden @ W.T``
then TRL's ``selective_log_softmax(_and_entropy)`` (on a GPU its Triton kernel); and on
request ``cce_<N>mb``, cce under a memory budget of N MiB instead of 1/5 of the logits.

Per variant: step times (median of generating steps and of train-only steps, step 0 left out),
generation time, peak memory, training tokens/s (completion tokens / a train-only step), step 0's
logged loss, entropy and KL (0 when policy and reference calls give the same bits), whether step
0's old (no-grad) and new (grad) log-probs are the same bits (importance ratio exactly 1), and
the new ones against float64 (of the operands bf16 autocast gives the head) and the ``trl`` run's.
Then, the allocator capped at ``--cap-gib``, the most generations of ``--fit-length`` tokens each
variant trains a step with (doubling from ``--fit-start``, then bisecting; no probe starts after
``--budget-s``). Writes ``grpo_e2e.json`` and ``grpo_e2e.md`` into ``--out``. The variants' head
kernels are in bench/grpo_heads.py, the tables in bench/grpo_report.py.

    python bench/grpo_e2e.py --out $OUT/grpo              # planned for < 6 min on an H200
    python bench/grpo_e2e.py --quick --out $OUT/grpo      # 8 x 256 tokens, a short search
    python bench/grpo_e2e.py --variants trl,cce --no-fit --length 2048 --generations 8

Without CUDA it runs a tiny configuration on the CPU (a smoke test of the code paths).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import pathlib
import random
import statistics
import sys
import tempfile
import time
import traceback
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
# The modules beside this file, also when it is imported as bench.grpo_e2e rather than run.
sys.path.insert(1, str(pathlib.Path(__file__).resolve().parent))
from grpo_heads import head_kernel  # noqa: E402
from grpo_report import markdown  # noqa: E402

GiB = 2**30
VARIANTS = ("trl", "cce", "logits")
QWEN2_1_5B = dict(
    hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2
)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@functools.cache
def tokenizer(vocab: int):
    """Word-level: "<pad>", "<eos>", "<unk>" then w3 .. w{V-1}, one id per word. Passed to the
    trainers as an object: AutoTokenizer would load it back as the config's Qwen2 tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, vocab)]
    inner = Tokenizer(
        models.WordLevel(vocab={w: i for i, w in enumerate(names)}, unk_token="<unk>")
    )
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def save_model(path: pathlib.Path, args) -> None:
    """A Qwen2 with random weights and its tokenizer, saved where the trainers load them from
    (the reference model is loaded from the same path: identical weights at step 0)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = tokenizer(args.vocab)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=args.vocab,
        num_hidden_layers=args.layers,
        max_position_embeddings=8192 if args.device == "cuda" else 512,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        **(QWEN2_1_5B if args.device == "cuda" else TINY),
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)


def prompts(count: int, words: int, vocab: int):
    from datasets import Dataset

    rng = random.Random(0)
    rows = [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(words)) for _ in range(count)]
    return Dataset.from_dict({"prompt": rows})


def even_word_share(completions, **kwargs):
    """The toy reward: the share of a completion's words with an even number."""
    rewards = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split() if w[1:].isdigit()]
        rewards.append(sum(i % 2 == 0 for i in ids) / max(1, len(ids)))
    return rewards


def grpo_config(out: str, args, generations: int, length: int, steps: int):
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=generations,
        num_generations=generations,
        max_completion_length=length,
        temperature=0.9,
        beta=0.04,
        num_iterations=2,
        entropy_coef=0.01,
        learning_rate=1e-6,
        generation_kwargs={"min_new_tokens": length},
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=args.device == "cpu",
        bf16=args.device == "cuda",
        log_completions=False,
    )


class StepTimes:
    """Wall time of each optimizer step (after a device sync) and of its generation."""

    def __init__(self, trainer):
        from transformers import TrainerCallback

        self.steps, self.generation, self.trainer = [], {}, trainer
        timer = self

        class Callback(TrainerCallback):
            def on_step_begin(self, *a, **k):
                _sync()
                timer.start = time.perf_counter()

            def on_step_end(self, *a, **k):
                _sync()
                timer.steps.append(time.perf_counter() - timer.start)

        trainer.add_callback(Callback())
        generate = trainer._generate_single_turn

        def timed_generate(*a, **k):
            _sync()
            t0 = time.perf_counter()
            result = generate(*a, **k)
            _sync()
            step = len(self.steps)
            self.generation[step] = self.generation.get(step, 0.0) + time.perf_counter() - t0
            return result

        trainer._generate_single_turn = timed_generate


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_trainer(model_path, args, generations, length, steps, out):
    from transformers import PrinterCallback
    from trl import GRPOTrainer

    trainer = GRPOTrainer(
        model=str(model_path),
        reward_funcs=even_word_share,
        processing_class=tokenizer(args.vocab),
        args=grpo_config(out, args, generations, length, steps),
        train_dataset=prompts(64, args.prompt_words, args.vocab),
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log lines: the tables hold them
    return trainer


def _median(values):
    return statistics.median(values) if values else None


def run_variant(variant: str, model_path, args):
    """Train ``args.steps`` steps; (the variant's figures, the recorded first head calls)."""
    _free()
    with tempfile.TemporaryDirectory() as out, head_kernel(variant) as recorder:
        trainer = build_trainer(model_path, args, args.generations, args.length, args.steps, out)
        times = StepTimes(trainer)
        _sync()
        if args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            loaded = torch.cuda.memory_allocated()
        trainer.train()
        counts = None
        if variant.startswith("cce"):
            from cce_compile.integrations import trl as cce_trl

            counts = cce_trl.counts()
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        del trainer
    later = range(1, len(times.steps))  # step 0 compiles, autotunes and warms the allocator
    generating = [times.steps[i] for i in later if i in times.generation]
    training = [times.steps[i] for i in later if i not in times.generation]
    tokens = args.generations * args.length
    result = {
        "step_s_generating": _median(generating),
        "step_s_training": _median(training),
        "generate_s": _median([times.generation[i] for i in later if i in times.generation]),
        "step_s_first": times.steps[0] if times.steps else None,
        "completion_tokens_per_step": tokens,
        "train_tokens_per_s": tokens / _median(training) if training else None,
        "e2e_tokens_per_s": tokens * len(later) / sum(times.steps[1:]) if len(later) else None,
        "step0": {key: logs[0].get(key) for key in STEP0_LOGGED} if logs else {},
        "counts": counts,
    }
    if args.device == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        result["models_gib"] = loaded / GiB
    _free()
    return result, recorder.calls


STEP0_LOGGED = ("loss", "entropy", "kl", "clip_ratio/region_mean", "grad_norm", "reward")
STEP0_LOGGED += ("completions/mean_length",)


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sorted_equal(a, b):
    return a.shape == b.shape and torch.equal(a.sort().values, b.sort().values)


def float64_log_probs(call, device):
    """The recorded call's log-probs in float64 of the operands the head computes from: rounded
    to bf16 where the trainer runs under bf16 autocast (on the GPU)."""
    hidden, weight = call["hidden"].to(device), call["weight"].to(device)
    if device == "cuda":
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
    hidden, weight, targets = hidden.double(), weight.double(), call["targets"].to(device)
    rows = max(1, GiB // (weight.shape[0] * 8))
    parts = []
    for s in range(0, hidden.shape[0], rows):
        z = hidden[s : s + rows] @ weight.T / call["temperature"]
        parts.append(z.gather(-1, targets[s : s + rows, None])[:, 0] - torch.logsumexp(z, -1))
    return torch.cat(parts).cpu()


def step0_checks(calls: dict, device: str):
    """Per variant: old (no-grad) vs new (grad) and reference vs new log-probs of step 0 as
    sorted bits (the rows are shuffled between the calls), the new ones against float64 and
    against the ``trl`` run's (when both runs scored the same completions)."""
    checks, base = {}, None
    for variant, recorded in calls.items():
        new = next((c for c in recorded if c["grad"]), None)
        old = next((c for c in recorded if not c["grad"] and "entropy" in c["outputs"]), None)
        ref = next((c for c in recorded if not c["grad"] and c["outputs"] == ("log_probs",)), None)
        if new is None or not recorded or recorded[0]["weight"] is None:
            checks[variant] = {"error": "no grad call recorded at step 0"}
            continue
        new["weight"] = recorded[0]["weight"]
        exact = float64_log_probs(new, device)
        err = new["logp"].double() - exact
        check = {
            "rows": new["logp"].numel(),
            "old_equals_new_bits": None if old is None else _sorted_equal(old["logp"], new["logp"]),
            "ref_equals_new_bits": None if ref is None else _sorted_equal(ref["logp"], new["logp"]),
            "logp_rel_err_f64": (err.norm() / exact.norm()).item(),
            "logp_max_abs_err_f64": err.abs().max().item(),
        }
        if base is not None:
            same = torch.equal(base["targets"], new["targets"]) and torch.equal(
                base["hidden"], new["hidden"]
            )
            check["same_inputs_as_trl"] = same
            if same:
                check["logp_max_abs_diff_vs_trl"] = (new["logp"] - base["logp"]).abs().max().item()
        elif variant == "trl":
            base = new
        checks[variant] = check
    return checks


def fits(variant, model_path, args, generations):
    """(fits, peak GiB or None, GiB resident before): whether one step (generation, old and
    reference log-probs, the policy's step) of ``generations`` x ``--fit-length`` tokens trains
    under the cap or runs out of memory."""
    _free()
    torch.cuda.reset_peak_memory_stats()
    resident = torch.cuda.memory_allocated() / GiB  # what earlier runs left (0 unless a leak)
    try:
        with tempfile.TemporaryDirectory() as out, head_kernel(variant) as recorder:
            recorder.keep = 0
            trainer = build_trainer(model_path, args, generations, args.fit_length, 1, out)
            try:
                trainer.train()
            finally:
                del trainer
        return True, torch.cuda.max_memory_allocated() / GiB, resident
    except torch.OutOfMemoryError:
        return False, None, resident
    finally:
        _free()


def largest_fit(variant, model_path, args, deadline):
    """Doubling from --fit-start until a step runs out of memory, then --fit-bisections
    bisections (even sizes): the largest number of generations that trained, the smallest that
    did not, and every probe."""
    probes, ok, bad, size = [], 0, None, args.fit_start

    def probe(n):
        t0 = time.perf_counter()
        fit, peak, resident = fits(variant, model_path, args, n)
        seconds = round(time.perf_counter() - t0, 1)
        probes.append(
            dict(generations=n, fits=fit, peak_gib=peak, resident_gib=resident, s=seconds)
        )
        print(f"  fit {variant} {n} x {args.fit_length}: {probes[-1]}", flush=True)
        return fit

    while bad is None and size <= args.fit_max and time.perf_counter() < deadline:
        if probe(size):
            ok, size = size, size * 2
        else:
            bad = size
    for _ in range(args.fit_bisections):
        mid = (ok + bad) // 4 * 2 if bad is not None else None
        if mid is None or mid in (ok, bad) or mid < 2 or time.perf_counter() >= deadline:
            break
        ok, bad = (mid, bad) if probe(mid) else (ok, mid)
    return {
        "largest": ok,
        "smallest_failed": bad,
        "tokens": ok * args.fit_length,
        "probes": probes,
        "cut_by_budget": time.perf_counter() >= deadline,
    }


def environment(args):
    from importlib.metadata import version

    import triton

    env = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": version("transformers"),
        "trl": version("trl"),
        "date": time.strftime("%Y-%m-%d"),
        "commit": args.commit,
    }
    env["gpu"] = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    return env


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/grpo_run")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="8 x 256 tokens, a short search")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--generations", type=int, default=16, help="completions per step")
    parser.add_argument("--length", type=int, default=1024, help="tokens per completion")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="generation reused: half generate")
    parser.add_argument("--no-fit", dest="fit", action="store_false", help="skip the search")
    parser.add_argument("--cap-gib", type=float, default=24.0)
    parser.add_argument("--fit-length", type=int, default=512)
    parser.add_argument("--fit-start", type=int, default=32)
    parser.add_argument("--fit-max", type=int, default=1024)
    parser.add_argument("--fit-bisections", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=330, help="no new search probe after")
    parser.add_argument("--commit", default=None, help="default: git rev-parse --short HEAD")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.generations, args.length, args.steps = 8, 256, 4
        args.fit_length, args.fit_start, args.fit_bisections = 256, 64, 1
    if args.device == "cpu":  # the smoke size; no allocator cap on the CPU
        args.vocab, args.generations, args.length = min(args.vocab, 512), 4, 8
        args.steps, args.prompt_words, args.fit = 4, 6, False
    if args.commit is None:
        from rl import _commit  # bench/rl.py

        args.commit = _commit()
    return args


def main(argv=None):
    args = parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" at every trainer
    start = time.perf_counter()
    variants = sorted(args.variants.split(","), key=lambda v: v != "trl")  # trl first: the base
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    hidden = (QWEN2_1_5B if args.device == "cuda" else TINY)["hidden_size"]
    config = {
        k: getattr(args, k)
        for k in ("layers", "vocab", "generations", "length", "steps", "cap_gib", "fit_length")
    }
    precision = "float32 weights, bf16 autocast" if args.device == "cuda" else "float32"
    results = {
        "environment": environment(args),
        "config": dict(config, hidden=hidden, precision=precision),
        "variants": {},
        "step0": {},
        "fit": {},
    }

    def save():
        (out_dir / "grpo_e2e.json").write_text(json.dumps(results, indent=1))

    def say(text):
        print(f"[{time.perf_counter() - start:6.1f}s] {text}", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        model_path = pathlib.Path(tmp) / "model"
        save_model(model_path, args)
        say(f"model saved ({args.layers} layers, V {args.vocab})")
        calls = {}
        for variant in variants:
            try:
                results["variants"][variant], calls[variant] = run_variant(
                    variant, model_path, args
                )
            except Exception as exc:  # one variant failing must not stop the others
                traceback.print_exc()
                results["variants"][variant] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            say(f"{variant}: {results['variants'][variant]}")
            save()
        results["step0"] = step0_checks(calls, args.device)
        _free()
        say(f"step 0: {results['step0']}")
        del calls
        save()
        if args.fit:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * GiB / total))
            deadline = start + args.budget_s
            try:
                for variant in variants:
                    results["fit"][variant] = largest_fit(variant, model_path, args, deadline)
                    say(f"fit {variant}: largest {results['fit'][variant]['largest']}")
                    save()
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
    table = markdown(results)
    (out_dir / "grpo_e2e.md").write_text(table + "\n")
    print(table)
    say("done")
    return results


if __name__ == "__main__":
    main()
