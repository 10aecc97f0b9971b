"""Real models: Hugging Face causal LMs from tiny configs, and a nanoGPT-style model.

The recommended recipe compiles the training step that turns inputs into the loss, so the
logits die inside the graph: ``step = lambda ids, labels: model(ids, labels=labels).loss``.
Compiling the model itself returns the logits, which the pass must leave alone (and say why).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import check

transformers = pytest.importorskip("transformers")

VOCAB = 97


def llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def gemma2():
    config = transformers.Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=None,
    )
    return transformers.Gemma2ForCausalLM(config)


def gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, n_positions=64
    )
    model = transformers.GPT2LMHeadModel(config)
    # Without a loss_type, transformers logs a warning inside the loss: a graph break.
    model.loss_type = "ForCausalLM"
    return model


MODELS = {"llama": llama, "gemma2-softcap": gemma2, "gpt2-tied": gpt2}


def batch(seed=0, length=12):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, length), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def _training_without_dropout(model):
    """Training mode (the graphs users compile), dropout off: eager and compiled runs must
    see the same values."""
    model.train()
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model


@pytest.mark.parametrize("make", MODELS.values(), ids=MODELS.keys())
def test_hugging_face_step_is_rewritten(make):
    torch.manual_seed(0)
    model = _training_without_dropout(make())

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    outcome = check(step, batch(), parameters=model.parameters())
    assert outcome.rewritten == 1 and outcome.has_op
    # The harness compared every parameter's gradient with eager; all of them exist.
    assert outcome.gradients == len(list(model.parameters()))


def test_hugging_face_num_items_in_batch():
    torch.manual_seed(0)
    model = _training_without_dropout(llama())

    def step(ids, labels, n):
        return model(input_ids=ids, labels=labels, num_items_in_batch=n).loss

    ids, labels = batch()
    outcome = check(step, (ids, labels, torch.tensor(17)), parameters=model.parameters())
    assert outcome.rewritten == 1


def test_compiling_the_model_itself_leaves_escaping_logits_alone():
    torch.manual_seed(0)
    model = _training_without_dropout(llama())
    ids, labels = batch()
    outcome = check(
        lambda i, lab: model(input_ids=i, labels=lab),
        (ids, labels),
        backward_all=True,
        parameters=model.parameters(),
    )
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


def test_hugging_face_with_the_inductor_backend():
    torch.manual_seed(0)
    model = _training_without_dropout(gemma2())

    def step(ids, labels):
        return model(input_ids=ids, labels=labels).loss

    assert check(step, batch(), backend="cce", parameters=model.parameters()).rewritten == 1


class NanoGPT(nn.Module):
    """nanoGPT's shape: token + position embeddings, blocks, ln_f, tied lm_head, CE in forward."""

    def __init__(self, vocab=VOCAB, dim=32, layers=2, heads=4, block=64, checkpointing=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(
                dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.checkpointing = checkpointing

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        x = self.ln_f(x)

        def head_and_loss(x, targets):
            logits = self.lm_head(x)
            return F.cross_entropy(
                logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1
            )

        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(head_and_loss, x, targets, use_reentrant=False)
        return head_and_loss(x, targets)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_nanogpt_style(checkpointing):
    torch.manual_seed(0)
    model = NanoGPT(checkpointing=checkpointing)
    ids, targets = batch()
    targets = targets.clamp(min=0)
    targets[1, 5] = -1  # nanoGPT's ignore_index
    outcome = check(model, (ids, targets))
    assert outcome.rewritten == 1 and outcome.has_op
    assert math.isfinite(model(ids, targets).item())
