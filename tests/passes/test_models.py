"""Real models: Hugging Face causal LMs from tiny configs, and a nanoGPT-style model.

The recommended recipe compiles the training step that turns inputs into the loss, so the
logits die inside the graph: ``step = lambda ids, labels: model(ids, labels=labels).loss``.
Compiling the model itself returns the logits: the default CCE_ESCAPING_LOGITS=drop fuses the
training loss and returns a placeholder for them; =keep leaves the site alone (and says why).
``hf_zoo.ZOO`` lists the families run in both recipes, one per graph form, and what each adds.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness import check, inductor_without_codegen

from cce_compile import config

transformers = pytest.importorskip("transformers")
import hf_zoo  # noqa: E402  (needs transformers)

VOCAB = hf_zoo.VOCAB


def batch(seed=0, length=12):
    return hf_zoo.batch(seed, length)


@pytest.mark.parametrize("model_type", hf_zoo.ZOO)
def test_hugging_face_step_is_rewritten(model_type):
    """The recommended recipe: compile the step that returns the loss."""
    model = hf_zoo.tiny(model_type)
    outcome = check(hf_zoo.step(model), batch(), parameters=model.parameters())
    assert outcome.rewritten == 1 and outcome.has_op
    # The harness compared every parameter's gradient with eager; all of them exist.
    assert outcome.gradients == len(list(model.parameters()))


@pytest.mark.parametrize("model_type", hf_zoo.ZOO)
def test_hugging_face_whole_model_with_dropped_logits(model_type):
    """torch.compile(model) returns the logits: by default (CCE_ESCAPING_LOGITS=drop) the
    loss is fused and the logits come back as a LogitsNotComputed placeholder without data."""
    model = hf_zoo.tiny(model_type)
    outcome = check(
        hf_zoo.whole(model), batch(), parameters=model.parameters(), dropped_logits=True
    )
    assert outcome.rewritten == 1 and outcome.has_op
    assert outcome.gradients == len(list(model.parameters()))


def test_hugging_face_num_items_in_batch():
    model = hf_zoo.tiny("llama")

    def step(ids, labels, n):
        return model(input_ids=ids, labels=labels, num_items_in_batch=n).loss

    ids, labels = batch()
    outcome = check(step, (ids, labels, torch.tensor(17)), parameters=model.parameters())
    assert outcome.rewritten == 1


def test_compiling_the_model_itself_under_keep_leaves_escaping_logits_alone():
    model = hf_zoo.tiny("llama")
    with config.override(escaping_logits="keep"):
        outcome = check(
            hf_zoo.whole(model), batch(), backward_all=True, parameters=model.parameters()
        )
    assert outcome.rewritten == 0 and outcome.skipped == {"logits_escape": 1}


def _gpt2_without_loss_type():
    model = hf_zoo.tiny("gpt2")
    assert model.loss_type is None  # transformers warns inside the loss: a logging call
    return model


def _llama_with_gradient_checkpointing():
    model = hf_zoo.tiny("llama")
    # use_cache=True: a warning inside the forward. transformers 5 renamed the call
    # (gradient_checkpointing_enable is its deprecated alias, with a FutureWarning).
    enable = getattr(model, "activation_checkpointing_enable", None)
    (enable or model.gradient_checkpointing_enable)()
    return model


LOGGING_BREAKS = {
    "gpt2-loss-type-warning": _gpt2_without_loss_type,
    "llama-gradient-checkpointing": _llama_with_gradient_checkpointing,
}


@pytest.mark.parametrize("make", LOGGING_BREAKS.values(), ids=LOGGING_BREAKS.keys())
@pytest.mark.parametrize("backend", ["cce", "hook"])
def test_transformers_logging_does_not_cut_the_graph(make, backend):
    """transformers logs a warning between lm_head and the loss; with the cce backend or
    enable() Dynamo leaves the call out, so head and loss stay in one graph."""
    import transformers.utils.logging as hf_logging

    hf_logging.warning_once.cache_clear()  # the warning fires again in this test
    model = make()
    with inductor_without_codegen():  # the graphs are under test, not Inductor's code
        outcome = check(hf_zoo.step(model), batch(), backend=backend, parameters=model.parameters())
    assert outcome.rewritten == 1 and len(outcome.graphs) == 1


def test_transformers_imported_after_the_backend_and_a_reset():
    """The import hook covers a transformers imported after cce_compile even when
    torch._dynamo.reset() has cleared the start-of-compile callback (a fresh process: this
    one has imported transformers already)."""
    script = (
        "import torch, cce_compile\n"
        "cce_compile.backend\n"
        "import transformers.utils.logging as hf\n"
        "torch._dynamo.reset()\n"
        "import logging\n"
        "print(logging.Logger.warning_once in torch._dynamo.config.ignore_logging_functions)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert done.stdout.strip().splitlines()[-1] == "True", done.stderr[-2000:]


@pytest.mark.parametrize("metrics", ["compilation", "runtime"])
def test_metrics_records_of_the_ignore_set_are_dropped(metrics):
    """torch 2.11's metrics records fail on a set of functions (a TypeError, logged with a
    traceback on every compile and run): both records are dropped, and nothing else is."""
    import logging

    from cce_compile.passes import tracing

    noise = tracing._MetricsSerialisationNoise()

    def record(message, error):
        exc_info = (type(error), error, None) if error else None
        return logging.LogRecord(
            "torch._dynamo.metrics_context", logging.ERROR, __file__, 1, message, None, exc_info
        )

    sort_error = TypeError("'<' not supported between instances of 'function' and 'function'")
    assert not noise.filter(record(f"Unexpected exception logging {metrics} metrics", sort_error))
    json_error = TypeError("Object of type function is not JSON serializable")  # one function
    assert not noise.filter(record(f"Unexpected exception logging {metrics} metrics", json_error))
    assert noise.filter(record(f"Unexpected exception logging {metrics} metrics", KeyError("k")))
    other_type_error = TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'")
    assert noise.filter(record(f"Unexpected exception logging {metrics} metrics", other_type_error))
    assert noise.filter(record("another record", sort_error))


def test_hugging_face_with_the_inductor_backend():
    """Inductor's code for a Hugging Face model's fused step (the other HF tests stop before
    code generation). OPT: a tied head, whose weight is also the embedding's (an untied head
    with a bias and a softcap under Inductor is test_backend.py's loss); gemma2, tied with a
    softcap, took 6-11 s more to compile cold than Llama, OPT ~2 s less. No decoder layer:
    embeddings, final norm, head and HF's loss are what Inductor compiles around the op, and a
    layer (attention, MLP, under test in the other HF tests) added 11 C++ kernels to its 5
    (cold: ~40 s of CPU with g++'s, 17 s without)."""
    model = hf_zoo.tiny("opt", layers=0)
    step = hf_zoo.step(model)
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


def test_explain_points_at_the_users_line_not_transformers_loss_helpers():
    import cce_compile

    model = hf_zoo.tiny("llama")
    report = cce_compile.explain(lambda i, lab: model(input_ids=i, labels=lab).loss, *batch())
    (site,) = report.sites
    assert site.rewritten and "test_models.py" in site.location
    ids, labels = batch()
    whole = cce_compile.explain(model, input_ids=ids, labels=labels)  # no user frame in it:
    assert "modeling_llama.py" in whole.sites[0].location  # the model's forward, not loss_utils
