"""Skipping ignored rows (compaction.py): the implementations see only the rows that count, and
every reduction and option keeps PyTorch's value and gradients, on the PyTorch path and (under
the interpreter on CPU) the Triton path."""

from __future__ import annotations

import os

import pytest
import torch
from harness import inductor_without_codegen
from oracle import GRAD_RTOL, LOSS_RTOL, assert_close, oracle
from strategies import build_case
from test_functional import run_and_compare

import cce_compile
from cce_compile import config, decide
from cce_compile.implementations import torch_path
from cce_compile.op import dispatch

# Compaction at these small sizes on a GPU too (conftest.skip_at_any_size).
pytestmark = pytest.mark.usefixtures("skip_at_any_size")

OP = torch.ops.cce.linear_cross_entropy.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1" or DEVICE == "cuda"

OPTIONS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z-loss": dict(z_loss=1e-3),
    "weights": dict(class_weights=True),
    "softcap-scale": dict(softcap=5.0, logit_scale=1.7),
    "bias": dict(bias=True),
    "everything": dict(
        bias=True,
        class_weights=True,
        label_smoothing=0.2,
        softcap=9.0,
        logit_scale=0.8,
        z_loss=1e-2,
    ),
}


def _implementations():
    yield pytest.param("torch", id="torch-path")
    yield pytest.param(
        "triton",
        id="triton-path",
        marks=pytest.mark.skipif(not INTERPRETING, reason="needs a GPU or TRITON_INTERPRET=1"),
    )


@pytest.fixture(params=list(_implementations()))
def implementation(request, monkeypatch):
    """Which implementation runs, recording the rows (positions of hidden) it is given."""
    if request.param == "triton":
        from cce_compile.implementations import triton_path as impl
    else:
        impl = torch_path
    seen = []

    class Recording:
        def __getattr__(self, name):
            target = getattr(impl, name)
            if name in ("logit_stats", "gradients", "fast_forward"):

                def record(head, *args, **kwargs):
                    result = target(head, *args, **kwargs)
                    call, shape = name, tuple(head.hidden.shape)
                    if kwargs.get("kept") is not None:
                        # A fused fast run on a GPU is given every row, the kept ones first
                        # (compaction.KeptFirst), and computes on the kept ones: its outputs'.
                        call, shape = f"{name}(kept-first)", (1, result.lse.numel(), shape[2])
                    seen.append((call, shape))
                    return result

                return record
            return target

    monkeypatch.setattr(dispatch, "implementation_for", lambda device: Recording())
    return seen


def _on_device(case):
    for name in ("hidden", "classifier", "targets", "bias", "class_weights"):
        value = getattr(case, name)
        if value is not None:
            setattr(case, name, value.to(DEVICE))
    return case


def _case(*, shift=0, reduction="mean", ignored=0.5, seed=0, options=()):
    options = dict(options)
    return _on_device(
        build_case(
            leading=(3, 11),
            dim=19,
            vocab=37,
            seed=seed,
            ignored_fraction=ignored,
            shift=shift,
            reduction=reduction,
            **options,
        )
    )


def _kept(case) -> int:
    # int64, as PyTorch compares (an int32 tensor compared with 2**32 + 5 wraps it to 5)
    return int((case.targets[:, case.shift :].long() != case.ignore_index).sum())


# (mode, reduction): fast mode needs a scalar loss.
MODES = [("lean", "mean"), ("lean", "sum"), ("lean", "none"), ("fast", "mean"), ("fast", "sum")]
MODE_IDS = [f"{mode}-{reduction}" for mode, reduction in MODES]


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize(("mode", "reduction"), MODES, ids=MODE_IDS)
@pytest.mark.parametrize("shift", [0, 1], ids=["no-shift", "shift"])
def test_every_option_with_half_the_rows_ignored(implementation, options, reduction, mode, shift):
    case = _case(shift=shift, reduction=reduction, options=options)
    run_and_compare(case, mode=mode)
    kept = _kept(case)
    assert 0 < kept < case.targets[:, shift:].numel()
    # Every implementation call saw only the kept rows, as one compact sequence.
    assert implementation and all(shape[:2] == (1, kept) for _, shape in implementation)


@pytest.mark.parametrize(("mode", "reduction"), MODES, ids=MODE_IDS)
def test_every_row_ignored(implementation, reduction, mode):
    case = _case(reduction=reduction, ignored=1.0)
    case.hidden.requires_grad_()
    case.classifier.requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, mode=mode, reduction=reduction
    )
    expected = oracle(case)  # nan for 'mean', as PyTorch
    assert torch.equal(torch.isnan(loss), torch.isnan(expected))
    assert_close("loss", loss, expected.float(), LOSS_RTOL[torch.float32])
    (loss.nan_to_num().sum()).backward()
    assert torch.count_nonzero(case.hidden.grad) == 0
    assert torch.count_nonzero(case.classifier.grad) == 0


def test_no_row_ignored_runs_on_every_row_in_place(implementation):
    case = _case(ignored=0.0)
    run_and_compare(case, mode="lean")
    batch, time = case.targets.shape
    assert all(shape[:2] == (batch, time) for _, shape in implementation)


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_ignored_rows_get_exact_zero_gradients(mode):
    case = _case(shift=1, ignored=0.4)
    case.hidden.requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, shift=1, mode=mode
    )
    loss.backward()
    rows = case.hidden.grad[:, :-1]
    ignored = case.targets[:, 1:] == case.ignore_index
    assert torch.count_nonzero(rows[ignored]) == 0
    assert torch.count_nonzero(case.hidden.grad[:, -1]) == 0  # no target: no gradient
    assert torch.count_nonzero(rows[~ignored].abs().sum(-1)) == int((~ignored).sum())


# ignore_index against int32 targets: PyTorch compares them as int64, so a value int32 cannot
# hold ignores no row, though an int32 tensor compared with it wraps (5 == 2**32 + 5).
INT32_IGNORE_INDEX = {"2^32+5": 2**32 + 5, "2^40": 2**40, "-2^40": -(2**40), "in-range-5": 5}


@pytest.mark.parametrize("ignore_index", INT32_IGNORE_INDEX.values(), ids=INT32_IGNORE_INDEX)
@pytest.mark.parametrize("mode", ["lean", "fast"])
@pytest.mark.parametrize("skip", [True, False], ids=["skipping", "not-skipping"])
def test_int32_targets_ignore_the_rows_pytorch_ignores(implementation, ignore_index, mode, skip):
    options = dict(ignore_index=ignore_index, target_dtype=torch.int32, class_weights=True)
    options.update(label_smoothing=0.1, z_loss=1e-3)
    case = _case(shift=1, ignored=0.4, options=options)
    assert bool((case.targets[:, 1:] == ignore_index).any())  # int32's wrap-around: the trap
    with config.override(skip_ignored=skip):
        run_and_compare(case, mode=mode)
    kept = _kept(case)
    batch, time = case.targets.shape
    # A fused fast run (GPU) gathers every row, kept first, before it knows none is ignored.
    kept_first = any(name.endswith("(kept-first)") for name, _ in implementation)
    compacted = kept < batch * (time - 1) or kept_first
    rows = (1, kept) if skip and compacted else (batch, time)
    assert implementation and all(shape[:2] == rows for _, shape in implementation)


def test_the_setting_turns_it_off(implementation):
    case = _case(ignored=0.5)
    with config.override(skip_ignored=False):
        run_and_compare(case, mode="lean")
    batch, time = case.targets.shape
    assert all(shape[:2] == (batch, time) for _, shape in implementation)


def test_the_returned_lse_of_every_row_is_computed_on_every_row(implementation):
    case = _case(ignored=0.5)
    run_and_compare(case, mode="lean", return_lse=True)
    batch, time = case.targets.shape
    assert all(shape[:2] == (batch, time) for _, shape in implementation)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_under_autocast(implementation, dtype):
    """float32 weights under bf16 autocast: the compacted copy of hidden keeps its dtype, and
    the gradients come back in the inputs' own dtypes."""
    case = _case(ignored=0.5)
    hidden = case.hidden.to(dtype).requires_grad_()
    classifier = case.classifier.requires_grad_()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        loss = cce_compile.linear_cross_entropy(hidden, classifier, case.targets, mode="lean")
    loss.backward()
    assert hidden.grad.dtype == dtype and classifier.grad.dtype == torch.float32
    ref_h = hidden.detach().bfloat16().double().requires_grad_()
    ref_c = classifier.detach().bfloat16().double().requires_grad_()
    expected = torch.nn.functional.cross_entropy(
        (ref_h @ ref_c.T).reshape(-1, ref_c.shape[0]), case.targets.reshape(-1)
    )
    expected.backward()
    assert_close("loss", loss, expected, LOSS_RTOL[torch.bfloat16])
    assert_close("grad_hidden", hidden.grad, ref_h.grad, GRAD_RTOL[torch.bfloat16])
    assert_close("grad_classifier", classifier.grad, ref_c.grad, GRAD_RTOL[torch.bfloat16])


def test_gradient_filtering_on_the_kept_rows(implementation):
    """Filtering's mask travels per kept row to the backward; beta = 0 is the exact result."""
    case = _case(ignored=0.5)
    case.hidden.requires_grad_()
    case.classifier.requires_grad_()
    exact = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, mode="lean"
    )
    exact_grads = torch.autograd.grad(exact, [case.hidden, case.classifier])
    filtered = cce_compile.linear_cross_entropy(
        case.hidden, case.classifier, case.targets, mode="lean", grad_filter=0.0
    )
    grads = torch.autograd.grad(filtered, [case.hidden, case.classifier])
    assert torch.equal(filtered, exact)
    for got, want in zip(grads, exact_grads):
        assert torch.equal(got, want)


def test_the_op_returns_the_rows_it_computed_on():
    case = _case(shift=1, ignored=0.5)
    from cce_compile.op.signature import FORWARD

    call = FORWARD.build(
        hidden=case.hidden,
        classifier=case.classifier,
        targets=case.targets,
        bias=None,
        class_weights=None,
        ignore_index=-100,
        reduction="mean",
        label_smoothing=0.0,
        softcap=None,
        logit_scale=1.0,
        shift=1,
        z_loss=0.0,
        lse_all_rows=False,
        mode="lean",
        grad_hidden=False,
        grad_classifier=False,
        grad_bias=False,
        implementation_version=cce_compile.op.custom_ops.IMPLEMENTATION_VERSION,
        skip_ignored=True,
    )
    row_index = OP(*call)[6]  # (loss, lse, three fast buffers, keep_blocks, row_index, ...)
    flat = case.targets[:, 1:].reshape(-1)
    assert torch.equal(row_index, (flat != -100).nonzero().squeeze(1))


def test_compiled_with_a_changing_number_of_ignored_rows_does_not_recompile():
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()

    def loss_fn(hidden, classifier, targets):
        return cce_compile.linear_cross_entropy(hidden, classifier, targets, shift=1)

    compiled = torch.compile(loss_fn, backend=counter, dynamic=False)
    for seed, ignored in enumerate([0.1, 0.6, 0.0, 0.9]):
        case = _case(shift=1, ignored=ignored, seed=seed)
        case.hidden.requires_grad_()
        loss = compiled(case.hidden, case.classifier, case.targets)
        (grad,) = torch.autograd.grad(loss, [case.hidden])
        (want,) = torch.autograd.grad(oracle(case), [case.hidden])
        assert_close("loss", loss, oracle(case).float(), LOSS_RTOL[torch.float32])
        assert_close("grad_hidden", grad, want, GRAD_RTOL[torch.float32])
    assert counter.frame_count == 1


def _layouts(hidden: torch.Tensor) -> dict:
    """The same values of hidden (B, T, D) in memory layouts a model hands the loss."""
    batch, time, dim = hidden.shape
    longer = hidden.new_zeros(batch, time + 2, dim)
    longer[:, :time] = hidden
    transposed = hidden.transpose(0, 1).contiguous().transpose(0, 1)
    return {
        "contiguous": hidden,
        "sliced-sequence": longer[:, :time],  # Hugging Face's hidden[:, :-1]
        "time-major": transposed,  # (T, B, D) memory
        "columns-strided": hidden.transpose(1, 2).contiguous().transpose(1, 2),
        "batch-broadcast": hidden[:1].expand(batch, time, dim),  # stride 0: no row view
    }


@pytest.mark.parametrize(
    "layout", ["contiguous", "sliced-sequence", "time-major", "columns-strided", "batch-broadcast"]
)
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_rows_of_any_memory_layout(implementation, layout, mode):
    case = _case(shift=1, ignored=0.5)
    if layout == "batch-broadcast":
        case.hidden = case.hidden[:1].expand_as(case.hidden).clone()
    case.hidden = _layouts(case.hidden)[layout].detach()
    run_and_compare(case, mode=mode)


@pytest.mark.parametrize(
    ("backend", "mode", "records"),
    [
        ("inductor", None, False),
        ("inductor", "reduce-overhead", True),
        ("inductor", "max-autotune", True),
        ("inductor", "max-autotune-no-cudagraphs", False),
        ("cce", "reduce-overhead", True),
        ("cce", None, False),
    ],
)
def test_a_direct_call_knows_when_it_is_compiled_into_cuda_graphs(backend, mode, records):
    """A call compiled into CUDA graphs keeps every row (no host sync can run in a recorded
    graph); the answer comes from the compile's own backend and mode."""

    def probe(x):
        return x + (1.0 if decide._compiled_into_cuda_graphs() else 0.0)

    torch._dynamo.reset()
    # The backend object: a source tree (the GPU machine's) registers no "cce" entry point.
    backend = cce_compile.backend if backend == "cce" else backend
    # The answer is read while Dynamo traces: Inductor stops before its code generation.
    with inductor_without_codegen():
        out = torch.compile(probe, backend=backend, mode=mode)(torch.zeros(3))
    assert bool(out[0] == 1.0) == records
    assert not decide._compiled_into_cuda_graphs()  # eager: never


KEPT_FIRST_ROWS = [(0, 0.0), (1, 0.0), (1, 1.0), (37, 0.5), (64, 1.0), (300, 0.3)]


@pytest.mark.parametrize("rows, kept_fraction", KEPT_FIRST_ROWS)
@pytest.mark.skipif(not INTERPRETING, reason="needs a GPU or TRITON_INTERPRET=1")
def test_a_kept_first_selection_resolves_to_the_kept_rows(rows, kept_fraction):
    """Fast mode's deferred selection: every row in the kernel's kept-first order, then, once
    the count is read, the kept rows ascending (the index the backward gathers with)."""
    from cce_compile.kernels.kept_first import kept_first
    from cce_compile.op import compaction

    valid = torch.rand(rows, generator=torch.Generator().manual_seed(rows)) < kept_fraction
    deferred = compaction._kept_first(valid.to(DEVICE), lambda v: kept_first(v, block=16))
    assert deferred.compacted and deferred.index.numel() == rows
    assert deferred.kept.count() == int(valid.sum())
    assert torch.equal(deferred.resolved().index.cpu(), valid.nonzero().squeeze(1))
