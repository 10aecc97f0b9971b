"""Tiny Hugging Face causal LMs, and a survey of every one transformers has.

``tiny(name)`` builds ``AutoModelForCausalLM`` for a model type (``"llama"``, ``"gpt2"`` ...)
from one small set of sizes (configs map their own names onto ``hidden_size`` etc.), with a few
per-family extras, in training mode with dropout off. ``ZOO`` is what the tests run.

    python tests/passes/hf_zoo.py [--out docs/hf_zoo.md] [TYPE ...]

compiles the training step of every causal LM type in the installed transformers (or the given
ones) in two recipes, the step that returns the loss (with CCE_ESCAPING_LOGITS=keep, as the
survey in docs/hf_zoo.md was made) and the whole model with CCE_ESCAPING_LOGITS=drop (the
default), checks loss and gradients against eager and writes the table.
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import signal
import sys
import time

import torch
import torch.nn as nn

VOCAB = 97
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
EXTRAS = {  # what a family needs on top of SIZES to build small
    "gemma2": dict(final_logit_softcapping=30.0),
    "opt": dict(ffn_dim=64, word_embed_proj_dim=32),
    "gpt_neox": dict(rotary_pct=0.25),
    "falcon": dict(new_decoder_architecture=False, multi_query=True),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}

DROPOUTS = (
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "layerdrop",
    "classifier_dropout",
    "ffn_dropout",
)

# The families the tests run in both recipes: one per graph form the pass meets between the
# head and the loss in transformers' causal LMs, as Dynamo traces them (the loss's input chain,
# the head's input, a tied head, the outputs of a whole-model compile). The other causal LMs
# with a tiny config (mistral, qwen2/3, gemma, gemma3_text, phi3, gpt_neox, olmo/olmo2, stablelm,
# falcon, bloom, starcoder2, smollm3, glm) repeat one of these forms exactly; the survey
# (`python tests/passes/hf_zoo.py`, docs/hf_zoo.md) compiles every type.
ZOO = {
    "llama": "untied head; the plain chain: .float(), .view(-1, V)",
    "gemma2": "tied head, a type_as cast on its input (gemma), the softcap (/ c, tanh, * c) in "
    "the chain; a sliding-window cache among the whole model's outputs (mistral, gemma3_text)",
    "gpt2": "tied head fed by a view (Conv1D layers); no loss_type (a warning in the loss)",
    "opt": "tied head, a .contiguous() in the chain",
    "cohere": "a scale (* logit_scale) in the chain; a float32 cast on the head's input (olmo)",
    "granite": "a division (/ logits_scaling) in the chain, untied head",
    "qwen3_moe": "a mixture-of-experts body (routing, expert gather) before the head",
}


def tiny(model_type: str, seed: int = 0, *, layers: int | None = None) -> nn.Module:
    """A tiny causal LM of ``model_type``, training mode, dropout off. ``layers``: decoder
    layers instead of SIZES' one (0: embeddings, final norm, head and loss)."""
    import transformers

    config_class = transformers.CONFIG_MAPPING[model_type]
    depth = {} if layers is None else {"num_hidden_layers": layers}
    sizes = {  # a config that derives a size (Falcon's head_dim) takes no value for it
        k: v
        for k, v in {**SIZES, **EXTRAS.get(model_type, {}), **depth}.items()
        if not isinstance(getattr(config_class, k, None), property)
    }
    config = config_class(**sizes)
    for name in DROPOUTS:  # modules copy these floats when they are built
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


def batch(seed: int = 0, length: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def step(model):
    """The recommended recipe: compile the step that returns the loss."""
    return lambda ids, labels: model(input_ids=ids, labels=labels).loss


def whole(model):
    """Whole-model compile: the model's own output (loss and logits)."""
    return lambda ids, labels: model(input_ids=ids, labels=labels)


# --- survey ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _deadline(seconds: int):
    def expire(*_):
        raise TimeoutError(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _recipe(model_type: str, recipe: str, disable: bool = False) -> str:
    from harness import check

    from cce_compile import config

    model = tiny(model_type)
    fn = step(model) if recipe == "step" else whole(model)
    policy = "keep" if recipe == "step" else "drop"
    with config.override(escaping_logits=policy, disable=disable):
        outcome = check(
            fn,
            batch(),
            parameters=model.parameters(),
            fullgraph=False,
            dropped_logits=recipe != "step" and not disable,
        )
    if outcome.rewritten:
        return f"rewritten ({outcome.gradients} gradients match)"
    return "left alone: " + ", ".join(f"{k} x{v}" for k, v in outcome.skipped.items())


def _eager(model_type: str) -> str | None:
    """Why the tiny model cannot run a training step eagerly, or None if it can."""
    try:
        with _deadline(60):
            model = tiny(model_type)
            model(*batch()[:1], labels=batch()[1]).loss.backward()
    except Exception as error:
        text = str(error).strip().splitlines()
        return f"{type(error).__name__}: {text[0][:120] if text else ''}"
    return None


def survey(types: list[str]) -> list[tuple[str, str, str]]:
    rows = []
    for model_type in types:
        broken = _eager(model_type)
        if broken is not None:
            print(f"{model_type:28s} no tiny eager model: {broken}")
            rows.append((model_type, f"not surveyed (tiny config fails eagerly: {broken})", ""))
            continue
        results = []
        for recipe in ("step", "whole"):
            start = time.perf_counter()
            try:
                with _deadline(90):
                    results.append(_recipe(model_type, recipe))
            except Exception as error:  # the survey records, it does not stop
                text = str(error).strip().splitlines()
                message = f"{type(error).__name__}: {text[0][:160] if text else ''}"
                try:  # the same compile without the rewrite: whose failure is it?
                    with _deadline(120):
                        _recipe(model_type, recipe, disable=True)
                    results.append(f"error: {message}")
                except Exception:
                    results.append(f"fails without the pass too (torch.compile): {message}")
            print(f"{model_type:28s} {recipe:5s} {time.perf_counter() - start:5.1f}s {results[-1]}")
            sys.stdout.flush()
        rows.append((model_type, *results))
    return rows


def main(argv=None) -> int:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="*")
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    rows = survey(args.types or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    if args.out:
        lines = [
            "| model type | step returning the loss | whole model, CCE_ESCAPING_LOGITS=drop |",
            "|---|---|---|",
            *(f"| {t} | {a} | {b} |" for t, a, b in rows),
        ]
        header = (
            f"Survey of `AutoModelForCausalLM` types in transformers {transformers.__version__}, "
            f"torch {torch.__version__} (CPU), `python tests/passes/hf_zoo.py --out ...`\n\n"
        )
        args.out.write_text(header + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.exit(main())
