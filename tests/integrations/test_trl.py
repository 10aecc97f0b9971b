"""cce_compile.integrations.trl: our op under TRL 1.16's fused LM head, for every trainer.

Trainer runs against TRL 1.16 itself (tiny Llama, in-memory data, float32, a few steps; one TRL
import for the whole file): SFT, DPO, WPO, KTO, GRPO and RLOO log TRL's own values with
``install()``, every fused-head call is served (none handed back), and the identities of a
first step hold bit for bit (DPO's loss log 2, KTO's 0.5, rewards 0, GRPO's and RLOO's old
log-probs equal to the new ones, KL 0). Direct calls: every trainer's request equals TRL's
function, values and gradients (the entropy's too); a row's log-prob has the same bits with and
without gradients, whatever else is asked for and wherever the row sits in the batch; what is
handed to TRL is handed whole and said once; each mismatch with the TRL we were written for
refuses to install; ``install_on_import`` installs when TRL's trainer utilities load.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
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
import trl_tiny  # noqa: E402

from cce_compile.integrations import trl as cce_trl  # noqa: E402

TRL_FUNCTION = trl_kernel.ChunkedLogProbFunction
OPTIONAL = tuple(trl_kernel.OPTIONAL_OUTPUTS)
# What each trainer's fused head asks for (its add_fused_lm_head call; GRPO and RLOO alike).
REQUESTS = {
    "sft": ("log_probs", "entropy", "is_top1"),
    "dpo": ("log_probs", "entropy", "mean_logits", "is_top1"),
    "wpo": ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
    "kto": ("log_probs", "entropy", "mean_logits"),
    "grpo-rloo": ("log_probs", "entropy"),
    "reference": ("log_probs",),
}
TRANSFORMS = {
    "plain": dict(),
    "temperature-softcap-scale-bias": dict(temperature=0.7, softcap=3.0, scale=0.5, bias=True),
}
# Ours against TRL's function, both float32: measured <= 5e-7 absolute on log-probs of -1 to
# -10 and on entropies of ~4, 1e-6 on log_sum_sq_probs; gradients <= 4e-7 relative.
RTOL, ATOL = 1e-5, 1e-6
# Logged values of our runs against TRL's, both float32: measured <= 5e-7 absolute, and <= 3e-6
# relative on the values near zero (RLOO's KL of 5e-3, KTO's mean logit of -6e-4; the rewards
# and margins are beta times differences of summed log-probs), hence the absolute part.
LOGGED_RTOL, LOGGED_ATOL = 1e-5, 1e-6
SFT_STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: this file's models are tiny (GEMMs of ~50 rows by 32), where a
    second thread only adds waits for it on a shared machine (a DPO run took 1.8 s of CPU with
    two threads, 0.9 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def trl_restored():
    """Every test starts and ends with TRL's own function, zero counts and nothing said."""
    assert trl_utils._ChunkedLogProbFunction is TRL_FUNCTION
    cce_trl.reset_counts()
    cce_trl._logged.clear()
    yield
    if cce_trl.installed():
        cce_trl.uninstall()
    cce_trl.reset_counts()
    cce_trl._logged.clear()
    assert trl_utils._ChunkedLogProbFunction is TRL_FUNCTION


def _head(rows=24, dim=16, vocab=50, *, bias=False, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=gen) / math.sqrt(dim)).to(dtype).requires_grad_()
    head_bias = torch.randn(vocab, generator=gen).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    return hidden, weight, head_bias, targets


def _call(function, head, temperature=1.0, softcap=None, scale=1.0, outputs=REQUESTS["sft"]):
    hidden, weight, bias, targets = head
    return function.apply(hidden, weight, bias, targets, temperature, 16, softcap, scale, outputs)


def _objective(out, weights):
    """A GRPO-like objective: the log-probs plus a weighted entropy bonus where asked for."""
    total = out[0].sum()
    return total if out[1] is None else total + (weights * out[1]).sum()


# ------------------------------------------------------------------ install / refusals


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


def _wrapped_serve_disagreeing():
    serve = cce_trl._serve

    def disagreeing(*args):
        log_probs, entropy, *rest = serve(*args)
        return (log_probs, entropy * 1.01, *rest)

    return disagreeing


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
    if mismatch == "self-check-disagrees":
        assert "'entropy': False" in message
    else:
        assert "trl==1.16.*" in message
        assert f"installed trl {sys.modules['trl'].__version__}" in message


def test_uninstall_refuses_to_remove_a_later_replacement(monkeypatch):
    cce_trl.install()
    later = object()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", later)
    with pytest.raises(cce_trl.TRLIntegrationError, match="replaced"):
        cce_trl.uninstall()
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", cce_trl.CCEChunkedLogProb)


# ------------------------------------------------------------------ install on import


def test_the_start_up_hook_installs_when_trls_trainer_utilities_load():
    """CCE_COMPILE=1 in a fresh process (the start-up hook calls ``install_on_import``): the
    hook imports neither torch nor TRL; ``import trl`` alone loads no trainer; the first import
    of TRL's trainer utilities installs the op under them, with no edit to the script."""
    code = (
        "import sys\n"
        "assert 'cce_compile.integrations.trl' in sys.modules, 'the hook did not run'\n"
        "assert 'torch' not in sys.modules and 'trl' not in sys.modules, 'imported too soon'\n"
        "import trl\n"
        "assert 'trl.trainer.utils' not in sys.modules, 'import trl loaded the trainers'\n"
        "import trl.trainer.utils as u\n"
        "import cce_compile.integrations.trl as t\n"
        "assert t.installed() and u._ChunkedLogProbFunction is t.CCEChunkedLogProb\n"
    )
    environ = {key: value for key, value in os.environ.items() if not key.startswith("CCE_")}
    environ["CCE_COMPILE"] = "1"
    subprocess.run([sys.executable, "-c", code], check=True, env=environ)


def test_install_on_import_installs_at_once_when_trl_is_loaded():
    cce_trl.install_on_import()
    assert cce_trl.installed()


def test_install_on_import_leaves_trl_with_one_warning_when_it_refuses(monkeypatch, caplog):
    monkeypatch.setattr("trl.__version__", "1.17.0")
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        cce_trl.install_on_import()  # does not raise: the user's import goes on
    assert not cce_trl.installed()
    (record,) = [r for r in caplog.records if r.name == "cce_compile"]
    assert "TRL's own kernel" in record.getMessage() and "1.17.0" in record.getMessage()


def test_install_on_import_stops_on_a_bad_setting(monkeypatch):
    """As the start-up hook's first torch.compile does: a run asked to fuse never trains
    unfused because of a mistyped CCE_* value."""
    from cce_compile import config

    def bad_setting(**kwargs):
        raise config.SettingsError("CCE_MODE='turbo' is not one of ('auto', 'lean', 'fast')")

    monkeypatch.setattr(cce_trl, "install", bad_setting)
    with pytest.raises(SystemExit, match="CCE_MODE='turbo'.*stops here"):
        cce_trl.install_on_import()


# ------------------------------------------------------------------ served calls


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("request_name", list(REQUESTS))
def test_every_trainers_request_equals_trls_function(request_name, transform):
    """Values of every output, which of them carry a gradient, and the gradients of the
    log-probs plus an entropy bonus (the entropy's gradient included)."""
    options = dict(TRANSFORMS[transform], outputs=REQUESTS[request_name])
    head = _head(bias=options.pop("bias", False))
    want = _call(TRL_FUNCTION, head, **options)
    got = _call(cce_trl.CCEChunkedLogProb, head, **options)
    assert cce_trl.counts()["served"] == 1 and cce_trl.counts()["handed_to_trl"] == 0
    for name, ours, theirs in zip(("log_probs", *OPTIONAL), got, want):
        assert (ours is None) == (theirs is None), name
        if ours is None:
            continue
        assert ours.dtype == theirs.dtype and ours.requires_grad == theirs.requires_grad, name
        if name == "is_top1":
            assert torch.equal(ours, theirs)
        else:
            torch.testing.assert_close(ours, theirs.detach(), rtol=RTOL, atol=ATOL, msg=name)
    weights = torch.rand(head[3].shape, generator=torch.Generator().manual_seed(1))
    inputs = [t for t in head[:3] if t is not None]
    ours = torch.autograd.grad(_objective(got, weights), inputs)
    theirs = torch.autograd.grad(_objective(want, weights), inputs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_entropy_bonus_alone_takes_trls_gradient():
    """An objective of the entropy only (the log-probs unused: no gradient flows into them)."""
    head = _head(bias=True)
    options = dict(temperature=0.7, softcap=3.0, scale=0.5, outputs=REQUESTS["grpo-rloo"])
    inputs = [t for t in head[:3] if t is not None]
    ours = torch.autograd.grad(_call(cce_trl.CCEChunkedLogProb, head, **options)[1].sum(), inputs)
    theirs = torch.autograd.grad(_call(TRL_FUNCTION, head, **options)[1].sum(), inputs)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_a_rows_outputs_have_the_same_bits_whatever_the_call():
    """The importance ratio is exactly 1 at a first step only if the no-grad call (old or
    reference log-probs, with fewer outputs) gives the grad call's bits: every subset of the
    optional outputs, with and without gradients, and rows permuted (GRPO shuffles its
    generation batch between the two calls)."""
    hidden, weight, bias, targets = _head(rows=300, dim=32, vocab=1000, bias=True)
    options = (0.7, 4096, 3.0, 0.5)  # temperature, chunk size, softcap, logit scale
    seen: dict[str, torch.Tensor] = {}
    for count in range(len(OPTIONAL) + 1):
        for subset in itertools.combinations(OPTIONAL, count):
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    out = cce_trl.CCEChunkedLogProb.apply(
                        hidden, weight, bias, targets, *options, ("log_probs", *subset)
                    )
                for name, value in zip(("log_probs", *OPTIONAL), out):
                    if value is not None:
                        first = seen.setdefault(name, value.detach())
                        assert torch.equal(value.detach(), first), (name, subset, grad)
    order = torch.randperm(hidden.shape[0], generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        permuted = cce_trl.CCEChunkedLogProb.apply(
            hidden[order], weight, bias, targets[order], *options, ("log_probs",)
        )
    assert torch.equal(permuted[0], seen["log_probs"][order])


def test_a_microbatch_without_valid_labels_keeps_its_gradient_path():
    """On Triton devices TRL passes only the labelled rows, possibly none: the outputs are
    empty, and TRL's masked_scatter of them must still backpropagate."""
    head = _head(rows=0)
    out = _call(cce_trl.CCEChunkedLogProb, head, outputs=REQUESTS["wpo"])
    assert [None if x is None else x.shape for x in out] == [(0,)] * 5
    scattered = out[0].new_zeros(2, 3).masked_scatter(torch.zeros(2, 3, dtype=torch.bool), out[0])
    scattered.sum().backward()
    assert head[1].grad is not None and not head[1].grad.any()


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
    "float64": (dict(dtype=torch.float64), "float64"),
    "softcap-zero": (dict(softcap=0.0), "softcap <= 0"),
    "deepspeed-zero3": (dict(zero3=True), "ZeRO-3"),
    "unknown-output": (dict(outputs=("log_probs", "new_metric")), "unknown"),
}


@pytest.mark.parametrize("case", list(HANDED_OVER))
def test_handed_over_calls_get_trls_outputs_and_are_said_once(monkeypatch, caplog, case):
    """A reason to hand over holds for a model's grad and no-grad calls alike: both go to
    TRL's function, unchanged, and the reason is said once at the default (WARNING) level."""
    options, reason = dict(HANDED_OVER[case][0]), HANDED_OVER[case][1]
    if options.pop("zero3", False):
        monkeypatch.setattr(cce_trl, "_zero3", lambda: True)
    head = _head(dtype=options.pop("dtype", torch.float32))
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                want = _call(TRL_FUNCTION, head, **options)
                got = _call(cce_trl.CCEChunkedLogProb, head, **options)
            for ours, theirs in zip(got, want):
                assert (ours is None) == (theirs is None)
                assert ours is None or torch.equal(ours, theirs)
    counts = cce_trl.counts()
    assert counts["served"] == 0 and counts["handed_to_trl"] == 2, counts
    said = [r.getMessage() for r in caplog.records if r.name == "cce_compile"]
    assert len(said) == 1 and reason in said[0] and "handed to TRL" in said[0], said


# ------------------------------------------------------------------ SFTTrainer


@pytest.fixture(scope="module")
def sft_runs():
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


def _assert_same_sft_logs(ours, trls, rel=LOGGED_RTOL, tolerance=1e-7):
    assert len(ours) == len(trls) == SFT_STEPS
    for step, (got, want) in enumerate(zip(ours, trls), 1):
        for key in sft_tiny.LOGGED:
            assert got[key] == pytest.approx(want[key], rel=rel, abs=tolerance), (
                f"step {step} {key}: ours {got[key]} TRL {want[key]}"
            )


def test_sft_trainer_logs_trls_values_with_our_op(sft_runs, op_forwards):
    trls = sft_runs(packing=False)
    cce_trl.install()
    op_forwards.clear()  # (install's self-check)
    ours = sft_tiny.train(packing=False, steps=SFT_STEPS)
    counts = cce_trl.counts()
    assert counts["served"] == SFT_STEPS and counts["handed_to_trl"] == 0, counts
    assert len(op_forwards) == SFT_STEPS
    _assert_same_sft_logs(ours, trls)


def _pass_then_aot_eager(gm, example_inputs):
    """The graph pass (what backend='cce' and CCE_COMPILE=1 run), then Dynamo's aot_eager:
    Dynamo and AOTAutograd trace the op through its fake kernel as Inductor's compile would,
    in a fraction of the time (Inductor's code generation for this Llama costs ~35-45 s cold
    on 2 shared CPU cores)."""
    from torch._dynamo.backends.debugging import aot_eager

    from cce_compile.passes.graph_pass import run_on_module

    run_on_module(gm)
    return aot_eager(gm, example_inputs)


@pytest.mark.slow
def test_sft_trainer_on_a_model_compiled_with_the_pass_runs_our_op_in_one_graph(
    sft_runs, op_forwards, caplog
):
    """A model compiled with the pass as its backend, under install(): what a CCE_COMPILE=1
    run of a TRL script gets. The fused head builds no logits, so the pass finds nothing to
    rewrite and says nothing at WARNING; the op traces without a graph break, and batches of
    changing length need one graph once shapes are dynamic (Dynamo's default compiles twice,
    static then dynamic). Python floats stay constants, as under Dynamo's default (none of them
    changes): dynamic ones were specialised by AOTAutograd's tensorify pass, which restarted the
    whole trace (~13 s of CPU again). Logged values: TRL's eager run's (shared with the test
    above)."""
    from torch._dynamo.utils import counters

    import cce_compile

    trls = sft_runs(packing=False)
    torch._dynamo.reset()
    try:
        counters.clear()
        cce_trl.install()
        op_forwards.clear()
        with (
            torch._dynamo.config.patch(assume_static_by_default=False, specialize_float=True),
            cce_compile.watch() as report,
            caplog.at_level(logging.WARNING, logger="cce_compile"),
        ):
            ours = sft_tiny.train(packing=False, model_backend=_pass_then_aot_eager)
        frames, breaks = dict(counters["frames"]), dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    counts = cce_trl.counts()
    # counts() tallies compiled code per trace (Dynamo may trace a frame more than once)
    assert counts["served"] >= 1 and counts["handed_to_trl"] == 0, counts
    assert len(op_forwards) == SFT_STEPS  # the compiled code ran the op at every step
    assert graphs == 1 and breaks == {}, (graphs, breaks)
    assert frames["total"] == frames["ok"] == 1, frames
    assert report.graphs >= 1 and report.sites == [], str(report)
    assert not [r for r in caplog.records if r.name.startswith("cce_compile")]
    # AOTAutograd's decompositions of the backbone round a little differently from eager
    _assert_same_sft_logs(ours, trls, rel=1e-4, tolerance=1e-6)


# ------------------------------------------------------------------ DPO, WPO, KTO, GRPO, RLOO


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """Each trainer's run with TRL's kernel ('trl') and with ours ('cce'), with the counts of
    ours; cached for the module (one saved model: the trainers load policy and reference from
    it)."""
    model_path = trl_tiny.saved_model(str(tmp_path_factory.mktemp("tiny-llama")))
    out = str(tmp_path_factory.mktemp("trainer-out"))
    cache = {}

    def run(name: str, kernel: str):
        if (name, kernel) not in cache:
            assert not cce_trl.installed()
            if kernel == "cce":
                cce_trl.install()
                cce_trl.reset_counts()
            try:
                cache[name, kernel] = (trl_tiny.train(name, model_path, out), cce_trl.counts())
            finally:
                if kernel == "cce":
                    cce_trl.uninstall()
        return cache[name, kernel]

    return run


@pytest.mark.parametrize("name", trl_tiny.TRAINERS)
def test_trainer_logs_trls_values_with_our_op_serving_every_call(trainer_runs, name):
    """Every fused-head call served (none handed back); the same calls as TRL's run, with the
    same outputs and gradients asked for and their values within rounding; every logged value
    (loss, grad norm, entropy, rewards, KL, clipping, mean logits, accuracy) TRL's. GRPO's grad
    norm takes its entropy bonus's gradient."""
    (ours, counts), (trls, _) = trainer_runs(name, "cce"), trainer_runs(name, "trl")
    assert counts["served"] == len(ours.calls) > 0 and counts["handed_to_trl"] == 0, counts
    assert [(c.grad, c.outputs, c.entropy_has_grad) for c in ours.calls] == [
        (c.grad, c.outputs, c.entropy_has_grad) for c in trls.calls
    ]
    for index, (got, want) in enumerate(zip(ours.calls, trls.calls)):
        # (RLOO samples again at step 2: from weights that differ by rounding, the same tokens)
        assert torch.equal(got.targets, want.targets), f"call {index}: other completions"
        for field, value, expected in zip(("log_probs", *OPTIONAL), got.returned, want.returned):
            assert (value is None) == (expected is None), f"call {index} {field}"
            if field == "is_top1" and value is not None:
                assert torch.equal(value, expected), f"call {index}"
            elif value is not None:
                torch.testing.assert_close(value, expected, rtol=RTOL, atol=ATOL)
    assert len(ours.logs) == len(trls.logs) == trl_tiny.STEPS
    for step, (got, want) in enumerate(zip(ours.logs, trls.logs), 1):
        assert got.keys() == want.keys()
        for key in want.keys() - {"step_time"}:  # (wall-clock time)
            assert got[key] == pytest.approx(want[key], rel=LOGGED_RTOL, abs=LOGGED_ATOL), (
                f"{name} step {step} {key}: ours {got[key]} TRL {want[key]}"
            )


def _rows_matched(first: trl_tiny.Recorded, second: trl_tiny.Recorded, batch: int):
    """``second``'s sequences in ``first``'s order, matched by their hidden states (GRPO and
    RLOO shuffle the generation batch between the old and the new log-probs): the two calls'
    log-probs, (batch, positions)."""
    hidden_a = first.hidden.view(batch, -1, first.hidden.shape[-1])
    hidden_b = second.hidden.view(batch, -1, second.hidden.shape[-1])
    order = []
    for sequence in hidden_a:
        matches = [j for j in range(batch) if torch.equal(hidden_b[j], sequence)]
        assert matches, "a sequence of the first call is not in the second"
        order.append(matches[0])
    return first.returned[0].view(batch, -1), second.returned[0].view(batch, -1)[order]


# Per trainer: pairs of its first step's calls whose log-probs are equal bit for bit (policy
# and reference, or old and new, at the same weights on the same rows), and the first step's
# logged values that are then exact.
FLOAT32_LOG2 = float(torch.tensor(math.log(2.0), dtype=torch.float32))
FIRST_STEP = {
    # calls: policy (grad), reference
    "dpo": ([(0, 1)], {"loss": FLOAT32_LOG2, "rewards/chosen": 0.0, "rewards/margins": 0.0}),
    "wpo": ([(0, 1)], {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/margins": 0.0}),
    # calls: policy on the KL batch (no grad), policy (grad), reference KL, reference
    "kto": (
        [(0, 2), (1, 3)],
        {"loss": 0.5, "kl": 0.0, "rewards/chosen": 0.0, "rewards/rejected": 0.0},
    ),
    # calls: old (no grad), reference, new (grad)
    "grpo": ([(0, 2), (1, 2)], {"kl": 0.0, "clip_ratio/region_mean": 0.0}),
    "rloo": ([(0, 2), (1, 2)], {"kl": 0.0, "clip_ratio/region_mean": 0.0}),
}


@pytest.mark.parametrize("kernel", ["cce", "trl"])
@pytest.mark.parametrize("name", trl_tiny.TRAINERS)
def test_first_step_identities_hold_bit_for_bit(trainer_runs, name, kernel):
    """With one kernel for every call the first step's identities are exact: DPO's loss is
    log 2 and its rewards 0, KTO's loss 0.5 and KL 0, GRPO's and RLOO's importance ratio 1
    (old log-probs == new) and KL 0 (reference == policy). TRL's own kernel keeps them too
    ('trl'); the integration that handed the policy's calls to TRL and served the reference's
    broke them by up to 4.8e-7."""
    run, _ = trainer_runs(name, kernel)
    pairs, exact = FIRST_STEP[name]
    if name in ("grpo", "rloo"):  # old and reference without gradients, then the new
        assert [call.grad for call in run.calls[:3]] == [False, False, True]
    for a, b in pairs:
        first, second = run.calls[a], run.calls[b]
        if name in ("grpo", "rloo"):
            batch = trl_tiny.COMMON["per_device_train_batch_size"]
            mine, theirs = _rows_matched(first, second, batch)
        else:
            mine, theirs = first.returned[0], second.returned[0]
        assert torch.equal(mine, theirs), (name, a, b, (mine - theirs).abs().max().item())
    for key, value in exact.items():
        assert run.logs[0][key] == value, (key, run.logs[0][key])
