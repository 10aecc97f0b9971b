"""The custom ops: opcheck over the option matrix, fake kernels, torch.compile behaviour."""

from __future__ import annotations

import itertools

import pytest
import torch
from oracle import LOSS_RTOL, assert_close, oracle
from strategies import build_case
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.optests.generate_tests import DEFAULT_TEST_UTILS

import cce_compile
import cce_compile.op.custom_ops
from cce_compile.op.signature import BACKWARD, FORWARD, LOSS_OPTIONS

OP = torch.ops.cce.linear_cross_entropy.default
BACKWARD_OP = torch.ops.cce.linear_cross_entropy_backward.default

# Options that change the ops' outputs, saved tensors or autograd structure.
STRUCTURAL = dict(
    reduction=["mean", "sum", "none"],
    mode=["lean", "fast"],
    bias=[False, True],
    class_weights=[False, True],
    shift=[0, 1],
    lse_all_rows=[False, True],
)
# Options that only change the arithmetic: all of them off, or all of them on.
NUMERIC = {
    "plain": dict(label_smoothing=0.0, softcap=None, logit_scale=1.0, z_loss=0.0),
    "numeric": dict(label_smoothing=0.1, softcap=7.5, logit_scale=1.7, z_loss=1e-3),
}
FACTORS = {**STRUCTURAL, "numeric": list(NUMERIC)}


def _valid(combo: dict) -> bool:
    return not (combo["mode"] == "fast" and combo["reduction"] == "none")


def _pairs(combo: dict) -> set:
    items = sorted(combo.items())
    return {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}


def _param(combo: dict):
    ident = "-".join(f"{k}={v}" for k, v in combo.items())
    options = {k: v for k, v in combo.items() if k != "numeric"}
    return pytest.param({**options, **NUMERIC[combo["numeric"]]}, id=ident)


def _full_product() -> list[dict]:
    combos = (dict(zip(FACTORS, values)) for values in itertools.product(*FACTORS.values()))
    return [c for c in combos if _valid(c)]


def _all_pairs() -> list[dict]:
    """A few combinations in which every pair of option values occurs together (greedy
    pairwise covering): opcheck's failures come from one option or the interplay of two, and
    the full product (160 cases, ~2 minutes on 2 cores) adds no pair to these."""
    combos = _full_product()
    uncovered = set().union(*map(_pairs, combos))
    chosen = []
    while uncovered:
        best = max(combos, key=lambda c: len(_pairs(c) & uncovered))
        chosen.append(best)
        uncovered -= _pairs(best)
    return chosen


def op_args(options: dict, dtype=torch.float32, leading=(2, 5), dim=7, vocab=11, seed=0):
    case = build_case(
        leading=leading,
        dim=dim,
        vocab=vocab,
        dtype=dtype,
        seed=seed,
        bias=options["bias"],
        class_weights=options["class_weights"],
    )
    case.hidden.requires_grad_()
    case.classifier.requires_grad_()
    if case.bias is not None:
        case.bias.requires_grad_()
    return FORWARD.build(
        hidden=case.hidden,
        classifier=case.classifier,
        targets=case.targets,
        bias=case.bias,
        class_weights=case.class_weights,
        ignore_index=-100,
        **{name: options[name] for name in LOSS_OPTIONS if name in options},
        lse_all_rows=options["lse_all_rows"],
        mode=options["mode"],
        grad_hidden=True,
        grad_classifier=True,
        grad_bias=case.bias is not None,
        implementation_version=cce_compile.op.custom_ops.IMPLEMENTATION_VERSION,
        **{
            k: options[k]
            for k in ("skip_ignored", "return_entropy", "return_argmax")
            if k in options
        },
    )


# Fast mode's three gradient outputs are its autograd formula's: the backward scales them in
# place and hands them to autograd as the gradients (ops._take_fast_gradients), so a caller
# that returns them from a compiled graph, as opcheck's AOT test does, would see the scaled
# values; no caller of the op keeps them. Compiled fast mode is tested without them
# (test_compiled_fast_mode_matches_eager).
_FAST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _opcheck(args) -> None:
    fast = FORWARD.bind(args).mode == "fast"
    torch.library.opcheck(OP, args, test_utils=_FAST_UTILS if fast else DEFAULT_TEST_UTILS)


@pytest.mark.parametrize("options", [_param(c) for c in _all_pairs()])
def test_opcheck(options):
    _opcheck(op_args(options))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("options", [_param(c) for c in _all_pairs() if c["mode"] == "fast"][:4])
def test_compiled_fast_mode_matches_eager(options, backend):
    """The op in fast mode under AOTAutograd (what opcheck's AOT test checks, without
    returning the gradient outputs): loss, lse and every gradient equal eager's."""
    args = op_args(options)
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]

    def loss_and_lse(*values):
        loss, lse, *_ = OP(*values)
        return loss, lse

    torch._dynamo.reset()
    compiled = torch.compile(loss_and_lse, backend=backend, fullgraph=True, dynamic=True)
    results = []
    for run in (loss_and_lse, compiled):
        loss, lse = run(*args)
        upstream = (torch.tensor(0.7), torch.linspace(-1, 1, lse.numel()).view(lse.shape))
        wanted = (loss, lse) if FORWARD.bind(args).lse_all_rows else (loss,)
        grads = torch.autograd.grad(wanted, inputs, upstream[: len(wanted)])
        results.append((loss, lse, *grads))
    names = ("loss", "lse", *(f"grad {i}" for i in range(len(inputs))))
    for name, got, want in zip(names, results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("mode", "reduction"), [("lean", "mean"), ("lean", "none"), ("fast", "mean"), ("fast", "sum")]
)
def test_opcheck_skipping_ignored_rows_with_the_metrics(mode, reduction):
    """A data-dependent row_index output and the entropy / argmax outputs."""
    options = dict(
        reduction=reduction,
        mode=mode,
        bias=True,
        class_weights=False,
        shift=1,
        lse_all_rows=False,
        skip_ignored=True,
        return_entropy=True,
        return_argmax=True,
        **NUMERIC["numeric"],
    )
    _opcheck(op_args(options))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_opcheck_half_dtypes(dtype, mode):
    options = dict(
        reduction="mean",
        mode=mode,
        bias=True,
        class_weights=False,
        shift=1,
        lse_all_rows=True,
        **NUMERIC["numeric"],
    )
    _opcheck(op_args(options, dtype=dtype))


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_opcheck_float32_inputs_with_a_half_compute_dtype(mode):
    """Autocast's form: float32 weights and hidden, bf16 GEMM; gradients stay float32."""
    options = dict(reduction="sum", mode=mode, bias=True, class_weights=True, shift=1)
    args = FORWARD.bind(op_args({**options, "lse_all_rows": False, **NUMERIC["numeric"]}))
    call = FORWARD.build(**{**args.pick(FORWARD.names), "compute_dtype": torch.bfloat16})
    _opcheck(call)
    loss = OP(*call)[0]
    grads = torch.autograd.grad(loss, [args.hidden, args.classifier, args.bias])
    assert [g.dtype for g in grads] == [torch.float32] * 3


def _meta(t: torch.Tensor):
    return (tuple(t.shape), t.dtype, tuple(t.stride()) if t.numel() else None)


@pytest.mark.parametrize("options", [_param(c) for c in _full_product()])
def test_fake_kernels_mirror_real_outputs(options):
    args = op_args(options)
    real = OP(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = OP(*fake_args)
    assert [_meta(t) for t in real] == [_meta(t) for t in fake]

    grad_loss = torch.ones_like(real[0])
    forward = FORWARD.bind(args)
    backward_args = BACKWARD.build(
        grad_loss=grad_loss,
        grad_lse=real[1],
        **forward.pick(("hidden", "classifier", "targets", "bias", "class_weights")),
        lse=real[1],
        **forward.pick((*LOSS_OPTIONS, "lse_all_rows")),
        grad_hidden=True,
        grad_classifier=True,
        grad_bias=forward.bias is not None,
    )
    real_grads = BACKWARD_OP(*backward_args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake_args = [
            mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in backward_args
        ]
        fake_grads = BACKWARD_OP(*fake_args)
    assert [_meta(t) for t in real_grads] == [_meta(t) for t in fake_grads]


def _loss_fn(hidden, classifier, targets):
    return cce_compile.linear_cross_entropy(
        hidden, classifier, targets, shift=1, label_smoothing=0.1, z_loss=1e-4
    )


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_compile_fullgraph_dynamic_no_recompile(mode):
    counter = CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    with cce_compile.config.override(mode=mode):
        compiled = torch.compile(_loss_fn, backend=counter, fullgraph=True, dynamic=True)
        # Three batch sizes and sequence lengths, different numbers of ignored targets (sizes
        # >= 2: Dynamo specialises 0 and 1 by design).
        for seed, (batch, time, ignored) in enumerate([(2, 9, 0.1), (3, 6, 0.6), (4, 13, 0.0)]):
            case = build_case(
                leading=(batch, time),
                dim=12,
                vocab=29,
                seed=seed,
                ignored_fraction=ignored,
                shift=1,
                label_smoothing=0.1,
                z_loss=1e-4,
            )
            case.hidden.requires_grad_()
            case.classifier.requires_grad_()
            loss = compiled(case.hidden, case.classifier, case.targets)
            if seed == 0:
                # Dynamo may restart analysis (e.g. to specialise a float) within the first
                # compile; recompiles are compiles after it.
                first_compile = counter.frame_count
            assert_close("loss", loss, oracle(case), LOSS_RTOL[torch.float32])
            got = torch.autograd.grad(loss, [case.hidden, case.classifier])
            want = torch.autograd.grad(oracle(case), [case.hidden, case.classifier])
            for g, w in zip(got, want):
                assert_close("grad", g, w, 1e-4)
    assert counter.frame_count == first_compile, "recompiled for a new size"


def test_a_stale_graph_calling_an_op_fails_loudly():
    from cce_compile.distributed import ops as vocab_parallel_ops
    from cce_compile.op import versioning

    stale = versioning.IMPLEMENTATION_VERSION ^ 1
    with pytest.raises(RuntimeError, match="cce::linear_cross_entropy was called with"):
        versioning.check(stale)
    with pytest.raises(RuntimeError, match="cce::vocab_parallel_cross_entropy was called with"):
        vocab_parallel_ops.check_version(vocab_parallel_ops.IMPLEMENTATION_VERSION ^ 1)
    versioning.check(versioning.IMPLEMENTATION_VERSION)  # the current version passes


def test_the_version_covers_the_pass_whose_tags_the_cache_keys_do_not_see():
    # The pass tags nodes for recompute (passes/emit.save_inputs_not_views); the caches key on
    # graph's code only, so only the version argument can keep a graph of another pass out.
    import pathlib

    from cce_compile.op import versioning

    folders = {path.parent.name for path in versioning.op_sources()}
    assert {"op", "implementations", "kernels", "passes"} <= folders
    emit = next(p for p in versioning.op_sources() if p.name == "emit.py")
    assert emit.parent == pathlib.Path(versioning.__file__).parent.parent / "passes"
