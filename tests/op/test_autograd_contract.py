"""Autograd's contract with fast mode's gradients, which the backward scales in place and hands
to autograd as the gradients themselves (ops._take_fast_gradients): every case in which a
tensor handed out that way could be read, kept or added into twice.

Each case runs in lean and fast mode, eagerly and compiled, with float32 weights, float32
weights under bf16 autocast (AMP) and bf16 weights, and compares every gradient with the
float64 oracle computed on the same (rounded) inputs.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from oracle import GRAD_RTOL, assert_close
from torch._inductor.utils import fresh_cache

import cce_compile

V, D, B, T = 37, 16, 2, 9
DTYPES = {"fp32": torch.float32, "amp": torch.float32, "bf16": torch.bfloat16}


def _autocast(precision: str):
    if precision == "amp":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _leaves(precision: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    dtype = DTYPES[precision]
    hidden = torch.randn(B, T, D, generator=gen).to(dtype).requires_grad_()
    classifier = (torch.randn(V, D, generator=gen) / D**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=gen)
    targets[0, :3] = -100
    return hidden, classifier, targets


def _rounded(t: torch.Tensor, precision: str) -> torch.Tensor:
    """What the head computes on: autocast rounds float32 inputs to bf16."""
    return t.to(torch.bfloat16) if precision == "amp" else t


def _oracle_loss(hidden, classifier, targets, precision):
    h = _rounded(hidden, precision).double()
    c = _rounded(classifier, precision).double()
    return F.cross_entropy(F.linear(h, c).flatten(0, 1), targets.flatten())


def _oracle_grads(hidden, classifier, targets, precision, upstream=1.0):
    h = hidden.detach().double().requires_grad_()
    c = classifier.detach().double().requires_grad_()
    loss = _oracle_loss(h, c, targets, precision)
    return torch.autograd.grad(loss * upstream, [h, c])


def _check(name, got, want, precision):
    assert got is not None, f"{name}: no gradient"
    assert got.dtype == DTYPES[precision], f"{name}: dtype {got.dtype}"
    # The head computes in bf16 under AMP: its gradients carry bf16's error, in float32.
    compute_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    assert_close(name, got, want, GRAD_RTOL[compute_dtype])


def _eager_loss(mode: str):
    op_mode = "fast" if mode == "fused" else mode

    def loss(hidden, classifier, targets):
        return cce_compile.linear_cross_entropy(hidden, classifier, targets, mode=op_mode)

    return loss


# One compiled loss per (mode, precision), shared by the tests: each compiles once (Dynamo
# guards on the mode and the autocast state tell the six apart). A test that needs its own
# compile (other settings) asks for a fresh one.
_COMPILED: dict[tuple[str, str], object] = {}


def _compiled_loss(mode: str, precision: str, fresh: bool = False):
    if fresh or (mode, precision) not in _COMPILED:
        if fresh:
            torch._dynamo.reset()
            _COMPILED.clear()
        compiled = torch.compile(_eager_loss(mode), backend="inductor", fullgraph=True)
        if fresh:
            return compiled
        _COMPILED[mode, precision] = compiled
    return _COMPILED[mode, precision]


class Loss:
    """The public function in one mode, eager or compiled, inside the precision's autocast."""

    def __init__(self, mode: str, compiled: bool, precision: str):
        self.mode, self.precision, self.compiled = mode, precision, compiled
        self.fn = _compiled_loss(mode, precision) if compiled else _eager_loss(mode)

    def fresh(self) -> Loss:
        """The same loss compiled anew (for settings that apply at compile time)."""
        if self.compiled:
            self.fn = _compiled_loss(self.mode, self.precision, fresh=True)
        return self

    def __call__(self, hidden, classifier, targets):
        with _autocast(self.precision):
            return self.fn(hidden, classifier, targets)


# "fused": fast mode on the Triton path (the interpreter on CPU) with the chunk's exponentials
# from the logits GEMM's epilogue, in the compute dtype, over chunks of 5 rows: the GPU's form.
MODES = ["lean", "fast", "fused"]
RUNS = [
    pytest.param(
        (mode, compiled, precision), id=f"{mode}-{'compiled' if compiled else 'eager'}-{precision}"
    )
    for mode in MODES
    for compiled in (False, True)
    for precision in DTYPES
]


@pytest.fixture(params=RUNS)
def run(request, monkeypatch):
    mode, compiled, precision = request.param
    chunks = _force_fused_form(monkeypatch) if mode == "fused" else None
    yield Loss(mode, compiled, precision)
    assert chunks is None or chunks, "the fused form must have run"


def _force_fused_form(monkeypatch):
    from cce_compile import policy
    from cce_compile.implementations import triton_fast, triton_path, triton_shared
    from cce_compile.op import dispatch

    monkeypatch.setattr(dispatch, "implementation_for", lambda device: triton_path)
    monkeypatch.setattr(triton_shared, "work_dtype", lambda tensor: tensor.dtype)
    monkeypatch.setattr(policy, "fast_fuses_exp", lambda problem, whole_rows: not whole_rows)
    monkeypatch.setattr(policy, "fast_run_rows", lambda *args: 5)
    chunks = []
    real = triton_fast._fused_gemm
    monkeypatch.setattr(triton_fast, "_fused_gemm", lambda *a: chunks.append(1) or real(*a))
    return chunks


def test_non_unit_upstream_gradient(run):
    hidden, classifier, targets = _leaves(run.precision)
    (run(hidden, classifier, targets) * 0.37).backward()
    want = _oracle_grads(hidden, classifier, targets, run.precision, upstream=0.37)
    _check("hidden", hidden.grad, want[0], run.precision)
    _check("classifier", classifier.grad, want[1], run.precision)


def test_accumulation_into_existing_grad_over_micro_batches(run):
    hidden, classifier, targets = _leaves(run.precision)
    second = _leaves(run.precision, seed=1)[2]
    for micro_targets in (targets, second):
        (run(hidden, classifier, micro_targets) / 2).backward()
    wants = [_oracle_grads(hidden, classifier, t, run.precision, 0.5) for t in (targets, second)]
    _check("hidden", hidden.grad, wants[0][0] + wants[1][0], run.precision)
    _check("classifier", classifier.grad, wants[0][1] + wants[1][1], run.precision)


def test_autograd_grad_leaves_grad_alone(run):
    hidden, classifier, targets = _leaves(run.precision)
    classifier.grad = torch.full_like(classifier, 3.0)
    got = torch.autograd.grad(run(hidden, classifier, targets), [hidden, classifier])
    want = _oracle_grads(hidden, classifier, targets, run.precision)
    assert torch.equal(classifier.grad, torch.full_like(classifier, 3.0))
    assert hidden.grad is None
    _check("hidden", got[0], want[0], run.precision)
    _check("classifier", got[1], want[1], run.precision)


def test_one_classifier_in_two_losses(run):
    hidden, classifier, targets = _leaves(run.precision)
    other_hidden, _, other_targets = _leaves(run.precision, seed=2)
    total = run(hidden, classifier, targets) + 0.5 * run(other_hidden, classifier, other_targets)
    total.backward()
    want = _oracle_grads(hidden, classifier, targets, run.precision)[1]
    want = want + _oracle_grads(other_hidden, classifier, other_targets, run.precision, 0.5)[1]
    _check("classifier", classifier.grad, want, run.precision)


def test_tied_embeddings(run):
    """The classifier is also the input embedding: its gradient sums both uses."""
    _, classifier, targets = _leaves(run.precision)
    tokens = targets.clamp(min=0)
    hidden = F.embedding(tokens, classifier) * 2.0
    run(hidden, classifier, targets).backward()
    c = classifier.detach().double().requires_grad_()
    h = F.embedding(tokens, c) * 2.0
    want = torch.autograd.grad(_oracle_loss(h, c, targets, run.precision), c)[0]
    _check("classifier", classifier.grad, want, run.precision)


def test_hook_on_the_classifier_sees_and_replaces_the_gradient(run):
    hidden, classifier, targets = _leaves(run.precision)
    seen = []

    def hook(grad):
        seen.append(grad.detach().clone())
        return grad * 2

    classifier.register_hook(hook)
    run(hidden, classifier, targets).backward()
    want = _oracle_grads(hidden, classifier, targets, run.precision)[1]
    assert len(seen) == 1
    _check("seen by the hook", seen[0], want, run.precision)
    _check("classifier", classifier.grad, 2 * want, run.precision)


def test_retained_second_backward(run):
    # Last of the tests of ``run``: its fresh compiles empty the shared ones.
    hidden, classifier, targets = _leaves(run.precision)
    # A compiled graph may donate its saved buffers to the backward; PyTorch's own error for
    # retain_graph asks to turn that off, as any compiled graph needs. Its own cache must be
    # fresh: Inductor's FX graph cache does not key on the donation (torch 2.11-2.13), so a
    # backward compiled with donation (the other tests here) would be served to this graph
    # and overwrite the saved buffer that the second backward reads.
    donation = contextlib.ExitStack()
    if run.compiled:
        donation.enter_context(torch._functorch.config.patch(donated_buffer=False))
        donation.enter_context(fresh_cache())
    with donation:
        loss = run.fresh()(hidden, classifier, targets)
        first = torch.autograd.grad(loss, [hidden, classifier], retain_graph=True)
        second = torch.autograd.grad(loss * 2.0, [hidden, classifier])
    want = _oracle_grads(hidden, classifier, targets, run.precision)
    for name, got, w in zip(("hidden", "classifier"), first, want):
        _check(f"first {name}", got, w, run.precision)
    for name, got, w in zip(("hidden", "classifier"), second, want):
        _check(f"second {name}", got, 2 * w, run.precision)
    # The first backward's gradients are not the second's buffers: still the first values.
    _check("first classifier after the second", first[1], want[1], run.precision)


@pytest.mark.parametrize(
    "compiled",
    [
        False,
        pytest.param(
            True,
            marks=pytest.mark.xfail(
                strict=True,
                reason="compiled fast mode: the backward reads only the forward's gradient "
                "buffers, so AOTAutograd saves neither hidden nor the classifier and no version "
                "counter is checked; an in-place write between forward and backward is not "
                "refused (PyTorch's compiled linear + cross_entropy refuses it)",
            ),
        ),
    ],
    ids=["eager", "compiled"],
)
@pytest.mark.parametrize("written", ["hidden", "classifier"])
def test_fast_mode_refuses_an_in_place_write_before_backward(compiled, written):
    """As PyTorch: an input changed in place after the loss and before its backward is a
    version-counter error, never the gradient of values the loss no longer had."""
    hidden, classifier, targets = _leaves("fp32")
    fn = _eager_loss("fast")
    if compiled:
        torch._dynamo.reset()
        _COMPILED.clear()
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True)
    h, c = hidden * 1.0, classifier * 1.0  # non-leaves: writable in place
    loss = fn(h, c, targets)
    with torch.no_grad():
        (h if written == "hidden" else c).mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
