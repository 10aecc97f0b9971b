"""cce_compile.integrations.trl: our op under TRL 1.16's fused LM head.

SFTTrainer runs (tiny Llama, in-memory prompt-completion data, completion-only loss, float32):
with ``install()`` the op serves every fused-head call and the logged loss, entropy, token
accuracy and grad norm equal TRL's own run; packing off and on, and ``torch_compile=True``.
Direct calls: the served outputs and gradients equal TRL's function's, the calls we do not
serve go to TRL's function unchanged, and each mismatch with the TRL we were written for
refuses to install and changes nothing.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")
if not trl.__version__.startswith("1.16."):
    pytest.skip(
        f"cce_compile.integrations.trl is written for TRL 1.16.x, trl {trl.__version__} "
        "is installed (install() refuses it)",
        allow_module_level=True,
    )
import sft_tiny  # noqa: E402
import trl.kernels.chunked_logprob as trl_kernel  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402

from cce_compile.integrations import trl as cce_trl  # noqa: E402

TRL_FUNCTION = trl_kernel.ChunkedLogProbFunction
SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")
STEPS = 3
# Logged values of our run against TRL's, both float32 (measured: <= 1.3e-7).
LOGGED_RTOL = 1e-5


@pytest.fixture(autouse=True)
def trl_restored():
    """Every test starts and ends with TRL's own function and zero counts."""
    assert trl_utils._ChunkedLogProbFunction is TRL_FUNCTION
    cce_trl.reset_counts()
    yield
    if cce_trl.installed():
        cce_trl.uninstall()
    cce_trl.reset_counts()
    assert trl_utils._ChunkedLogProbFunction is TRL_FUNCTION


def _head(rows=24, dim=16, vocab=50, *, bias=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).to(dtype).requires_grad_()
    head_bias = torch.randn(vocab, generator=gen).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, weight, head_bias, targets


def _call(function, head, temperature=1.0, softcap=None, scale=1.0, outputs=SFT_OUTPUTS):
    hidden, weight, bias, targets = head
    return function.apply(hidden, weight, bias, targets, temperature, 16, softcap, scale, outputs)


def _grads(log_probs, head):
    inputs = [t for t in head[:3] if t is not None]
    return torch.autograd.grad(log_probs.sum(), inputs)


# ------------------------------------------------------------------ install / refusals


def test_importing_cce_compile_does_not_import_trl():
    code = (
        "import sys, cce_compile, cce_compile.integrations, cce_compile.integrations.trl as t;"
        "cce_compile.linear_cross_entropy; assert not t.installed();"
        "assert 'trl' not in sys.modules, 'trl imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_install_swaps_the_global_and_uninstall_restores_it():
    cce_trl.install()
    assert trl_utils._ChunkedLogProbFunction is cce_trl.CCEChunkedLogProb
    assert cce_trl.installed()
    cce_trl.install()  # idempotent
    cce_trl.uninstall()
    assert trl_utils._ChunkedLogProbFunction is TRL_FUNCTION
    assert not cce_trl.installed()
    cce_trl.uninstall()  # nothing to do


def _other_forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, outputs):
    raise AssertionError("never called")


REFUSALS = {
    "trl-version-1.17": lambda mp: mp.setattr("trl.__version__", "1.17.0"),
    "global-replaced": lambda mp: mp.setattr(trl_utils, "_ChunkedLogProbFunction", object()),
    "forward-signature": lambda mp: mp.setattr(
        TRL_FUNCTION, "forward", staticmethod(_other_forward)
    ),
    "optional-outputs": lambda mp: mp.setattr(
        trl_kernel, "OPTIONAL_OUTPUTS", (*trl_kernel.OPTIONAL_OUTPUTS, "new")
    ),
    "self-check-disagrees": lambda mp: mp.setattr(cce_trl, "_serve", _wrapped_serve_disagreeing()),
}


def _wrapped_serve_disagreeing():
    serve = cce_trl._serve

    def disagreeing(*args):
        log_probs, *rest = serve(*args)
        return (log_probs * 1.01, *rest)

    return disagreeing


@pytest.mark.parametrize("mismatch", list(REFUSALS))
def test_install_refuses_a_trl_it_was_not_written_for(monkeypatch, mismatch):
    REFUSALS[mismatch](monkeypatch)
    before = trl_utils._ChunkedLogProbFunction
    with pytest.raises(cce_trl.TRLIntegrationError) as error:
        cce_trl.install()
    assert trl_utils._ChunkedLogProbFunction is before  # nothing changed
    assert not cce_trl.installed()
    message = str(error.value)
    assert "Nothing was changed" in message
    if mismatch != "self-check-disagrees":
        assert "trl==1.16.*" in message
        assert f"installed trl {sys.modules['trl'].__version__}" in message


def test_uninstall_refuses_to_remove_a_later_replacement(monkeypatch):
    cce_trl.install()
    later = object()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", later)
    with pytest.raises(cce_trl.TRLIntegrationError, match="replaced"):
        cce_trl.uninstall()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", cce_trl.CCEChunkedLogProb)


# ------------------------------------------------------------------ served calls


SERVED = {
    "plain": dict(),
    "temperature-softcap-scale-bias": dict(temperature=0.7, softcap=3.0, scale=0.5, bias=True),
    "reference-model-logprobs-only": dict(outputs=("log_probs",)),
}


@pytest.mark.parametrize("case", list(SERVED))
def test_served_call_equals_trls_function(case):
    options = dict(SERVED[case])
    head = _head(bias=options.pop("bias", False))
    want = _call(TRL_FUNCTION, head, **options)
    got = _call(cce_trl.CCEChunkedLogProb, head, **options)
    assert cce_trl.counts()["served"] == 1 and cce_trl.counts()["handed_to_trl"] == 0
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for field in (1, 4):  # entropy, is_top1
        if want[field] is None:
            assert got[field] is None
        else:
            torch.testing.assert_close(got[field], want[field].detach(), rtol=1e-5, atol=1e-6)
            assert not got[field].requires_grad  # served without gradient
    assert got[2] is None and got[3] is None
    for ours, theirs in zip(_grads(got[0], head), _grads(want[0], head)):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_ours_is_closer_to_float64_than_trls():
    """The documented numerics difference: TRL rounds each logits tile to bf16, the op keeps
    float32 logits of the bf16-rounded operands."""
    hidden, weight, bias, targets = _head(rows=64, dim=64, vocab=300, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _call(cce_trl.CCEChunkedLogProb, (hidden, weight, bias, targets))
        trls = _call(TRL_FUNCTION, (hidden, weight, bias, targets))
    logits = hidden.detach().bfloat16().double() @ weight.detach().bfloat16().double().T
    exact = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    error_ours = (ours[0].double() - exact).abs().max().item()
    error_trl = (trls[0].double() - exact).abs().max().item()
    assert error_ours < 1e-5 < error_trl
    assert torch.equal(ours[4], logits.argmax(-1) == targets)


# ------------------------------------------------------------------ handed to TRL


HANDED_OVER = {
    "dpo-kto-mean_logits": dict(outputs=("log_probs", "entropy", "mean_logits", "is_top1")),
    "wpo-log_sum_sq_probs": dict(outputs=("log_probs", "log_sum_sq_probs")),
    "grpo-rloo-policy-entropy": dict(outputs=("log_probs", "entropy")),
    "float64": dict(dtype=torch.float64),
    "softcap-zero": dict(softcap=0.0),
}


@pytest.mark.parametrize("case", list(HANDED_OVER))
def test_unserved_call_goes_to_trls_function_unchanged(case):
    options = dict(HANDED_OVER[case])
    head = _head(dtype=options.pop("dtype", torch.float32))
    want = _call(TRL_FUNCTION, head, **options)
    got = _call(cce_trl.CCEChunkedLogProb, head, **options)
    counts = cce_trl.counts()
    assert counts["served"] == 0 and counts["handed_to_trl"] == 1, counts
    for ours, theirs in zip(got, want):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert torch.equal(ours, theirs)
    if "entropy" in options.get("outputs", ()):
        assert got[1].requires_grad  # TRL's differentiable entropy


# ------------------------------------------------------------------ SFTTrainer


@pytest.fixture(scope="module")
def trl_runs():
    """TRL's own SFT runs, one per setting, shared by the tests that compare with them."""
    cache = {}

    def run(**setting):
        key = tuple(sorted(setting.items()))
        if key not in cache:
            assert not cce_trl.installed()
            cache[key] = sft_tiny.train(**setting)
        return cache[key]

    return run


@pytest.fixture
def op_forwards(monkeypatch):
    """Counts the op's forward runs (compiled code calls the op too, so it counts them)."""
    from cce_compile.op import dispatch

    calls = []
    forward = dispatch.forward

    def counting(args):
        calls.append(args)
        return forward(args)

    monkeypatch.setattr(dispatch, "forward", counting)
    return calls


def _assert_same_logs(ours, trls):
    assert len(ours) == len(trls) == STEPS
    for step, (got, want) in enumerate(zip(ours, trls), 1):
        for key in sft_tiny.LOGGED:
            assert got[key] == pytest.approx(want[key], rel=LOGGED_RTOL, abs=1e-7), (
                f"step {step} {key}: ours {got[key]} TRL {want[key]}"
            )


@pytest.mark.parametrize("packing", [False, True], ids=["packing-off", "packing-on"])
def test_sft_trainer_logs_trls_values_with_our_op(trl_runs, op_forwards, packing):
    trls = trl_runs(packing=packing)
    cce_trl.install()
    op_forwards.clear()  # (install's self-check)
    ours = sft_tiny.train(packing=packing)
    counts = cce_trl.counts()
    assert counts["served"] == STEPS and counts["handed_to_trl"] == 0, counts
    assert len(op_forwards) == STEPS
    _assert_same_logs(ours, trls)


def test_sft_trainer_with_a_model_compiled_by_the_pass_needs_no_setting(trl_runs, caplog):
    """Without install(): TRL 1.16's SFTTrainer takes its loss and its metrics (entropy, token
    accuracy) from its fused LM head, which builds no logits, so the compiled graph holds no
    cross-entropy. The default CCE_ESCAPING_LOGITS=drop has nothing to drop and nothing is
    said at WARNING; the logged values are TRL's own."""
    import logging

    from torch._dynamo.backends.debugging import aot_eager

    import cce_compile
    from cce_compile.passes.graph_pass import run_on_module

    def cce_eager(gm, example_inputs):
        run_on_module(gm)
        return aot_eager(gm, example_inputs)

    trls = trl_runs(packing=False)
    torch._dynamo.reset()
    with cce_compile.watch() as report, caplog.at_level(logging.WARNING, logger="cce_compile"):
        ours = sft_tiny.train(packing=False, model_backend=cce_eager)
    torch._dynamo.reset()
    assert report.graphs >= 1 and report.sites == [], str(report)
    assert not [r for r in caplog.records if r.name.startswith("cce_compile")]
    assert len(ours) == len(trls) == STEPS
    for got, want in zip(ours, trls):
        for key in sft_tiny.LOGGED:  # AOTAutograd's decompositions round a little differently
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (key, got, want)


@pytest.mark.slow
def test_sft_trainer_torch_compile_logs_trls_values_with_our_op(trl_runs, op_forwards):
    """Packed batches change length every step: compiled with dynamic shapes from the first
    step (Dynamo's default compiles twice, static then dynamic), the op adds no guard on the
    row count, so one graph serves every step, with no graph break. aot_eager: Dynamo and
    AOTAutograd trace the op through its fake kernel as Inductor's compile would, in a quarter
    of the time: Inductor's code generation for this Llama costs ~35-45 s cold on 2 shared CPU
    cores (compile_backend="inductor" passes too, checked by hand). Against TRL's eager run
    (shared with the test above)."""
    from torch._dynamo.utils import counters

    trls = trl_runs(packing=True)
    torch._dynamo.reset()
    try:
        counters.clear()
        cce_trl.install()
        op_forwards.clear()
        with torch._dynamo.config.patch(assume_static_by_default=False):
            ours = sft_tiny.train(packing=True, torch_compile=True, compile_backend="aot_eager")
        frames, breaks = dict(counters["frames"]), dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    counts = cce_trl.counts()
    # counts() tallies compiled code per trace (Dynamo may trace a frame more than once)
    assert counts["served"] >= 1 and counts["handed_to_trl"] == 0, counts
    assert len(op_forwards) == STEPS  # the compiled code ran the op at every step
    assert graphs == 1 and breaks == {}, (graphs, breaks)
    assert frames["total"] == frames["ok"] == 1, frames
    _assert_same_logs(ours, trls)
