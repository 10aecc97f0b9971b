"""The public function under every way PyTorch differentiates or casts: forward-mode AD,
functorch transforms, differentiable tensor options, autocast, grad mode, empty batches.

Each is compared with the float64 oracle under the same transform.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from harness import inductor_without_codegen
from oracle import GRAD_RTOL, LOSS_RTOL, Case, assert_close, oracle
from strategies import build_case

import cce_compile

lce = cce_compile.linear_cross_entropy
# The compiled tests here trace the public function (the route it takes under Dynamo and its
# gradients): Inductor compiles without its code generation, the rest of its compile as is.
OPTIONS = dict(label_smoothing=0.1, softcap=6.0, logit_scale=1.3, shift=1, z_loss=1e-3)


def _case(**options):
    return build_case(leading=(2, 6), dim=7, vocab=13, bias=True, seed=3, **options)


def _ours(case, hidden, classifier, **extra):
    options = {**case.options(), **extra}
    return lce(hidden, classifier, case.targets, case.bias, **options)


def _theirs(case, hidden, classifier):
    wide = dict(case.__dict__, hidden=hidden, classifier=classifier)
    return oracle(type(case)(**wide))


def test_forward_mode_ad_gives_the_oracles_tangent():
    case = _case(**OPTIONS)
    tangent_h = torch.randn_like(case.hidden)
    tangent_c = torch.randn_like(case.classifier)
    with fwAD.dual_level():
        loss = _ours(
            case,
            fwAD.make_dual(case.hidden, tangent_h),
            fwAD.make_dual(case.classifier, tangent_c),
        )
        primal, tangent = fwAD.unpack_dual(loss)
    assert tangent is not None
    _, want = torch.func.jvp(
        lambda h, c: _theirs(case, h, c),
        (case.hidden.double(), case.classifier.double()),
        (tangent_h.double(), tangent_c.double()),
    )
    assert_close("loss", primal, oracle(case), LOSS_RTOL[torch.float32])
    assert_close("tangent", tangent, want, GRAD_RTOL[torch.float32])


TRANSFORMS = {
    "func.grad": lambda f, h: torch.func.grad(f)(h),
    "func.jvp": lambda f, h: torch.func.jvp(f, (h,), (torch.ones_like(h),))[1],
    "func.vjp": lambda f, h: torch.func.vjp(f, h)[1](torch.ones((), dtype=h.dtype))[0],
    "func.jacrev": lambda f, h: torch.func.jacrev(f)(h),
    "vmap-of-grad": lambda f, h: torch.func.vmap(torch.func.grad(f))(torch.stack([h, 2 * h])),
}


def test_vmap_over_hidden_and_targets_gives_per_sample_losses():
    case = build_case(leading=(3, 5), dim=7, vocab=13, seed=4, ignored_fraction=0.2)
    per_sample = torch.func.vmap(lambda h, y: lce(h, case.classifier, y))(case.hidden, case.targets)
    for i in range(3):
        one = Case(case.hidden[i], case.classifier, case.targets[i])
        assert_close(f"sample {i}", per_sample[i], oracle(one), LOSS_RTOL[torch.float32])


@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
def test_functorch_transforms_match_the_oracle(transform):
    case = _case(**OPTIONS)
    got = transform(lambda h: _ours(case, h, case.classifier), case.hidden)
    want = transform(lambda h: _theirs(case, h, case.classifier.double()), case.hidden.double())
    assert_close("transformed", got, want, GRAD_RTOL[torch.float32])


@pytest.mark.parametrize("name", ["logit_scale", "softcap"])
def test_tensor_options_that_require_grad_are_differentiated(name):
    case = _case(label_smoothing=0.1, z_loss=1e-3, **{name: 2.5})
    value = torch.tensor(2.5, requires_grad=True)
    loss = _ours(case, case.hidden, case.classifier, **{name: value})
    (got,) = torch.autograd.grad(loss, value)
    wide = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    setattr(case, name, wide)
    (want,) = torch.autograd.grad(oracle(case), wide)
    assert_close(f"d loss / d {name}", got, want, GRAD_RTOL[torch.float32])


@pytest.mark.parametrize("requires_grad", [True, False], ids=["requires_grad", "constant"])
@pytest.mark.parametrize("name", ["logit_scale", "softcap"])
def test_tensor_options_under_fullgraph_compile(name, requires_grad):
    """Read as a number, a tensor option would be a data-dependent read in the graph: under
    torch.compile it takes the composite route (it gave Dynamo errors before)."""
    case = _case(label_smoothing=0.1, **{name: 2.5})
    value = torch.tensor(2.5, requires_grad=requires_grad)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda h, v: _ours(case, h, case.classifier, **{name: v}), fullgraph=True
    )
    hidden = case.hidden.clone().requires_grad_()
    with inductor_without_codegen():
        (got,) = torch.autograd.grad(compiled(hidden, value), hidden)
    (want,) = torch.autograd.grad(_theirs(case, hidden.double(), case.classifier.double()), hidden)
    assert_close(f"d loss / d hidden, {name} tensor", got, want, GRAD_RTOL[torch.float32])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_autograd_route_ignores_the_rows_pytorch_ignores_of_int32_targets(compiled):
    """2**32 + 5 ignores no int32 target (PyTorch compares as int64), though int32 wraps it to
    class 5, which the targets hold; the route traced by Dynamo too."""
    case = _case(ignore_index=2**32 + 5, ignored_fraction=0.4, target_dtype=torch.int32)
    assert bool((case.targets == case.ignore_index).any())
    value = torch.tensor(1.3, requires_grad=True)
    fn = lambda h, v: _ours(case, h, case.classifier, logit_scale=v)  # noqa: E731
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    hidden = case.hidden.clone().requires_grad_()
    got = fn(hidden, value)
    case.logit_scale = 1.3
    want = _theirs(case, hidden.double(), case.classifier.double())
    assert_close("loss", got, want, LOSS_RTOL[torch.float32])
    (got_grad,), (want_grad,) = (torch.autograd.grad(x, hidden) for x in (got, want))
    assert_close("d loss / d hidden", got_grad, want_grad, GRAD_RTOL[torch.float32])


def test_tensor_option_without_grad_is_a_number():
    case = _case()
    loss = _ours(case, case.hidden, case.classifier, logit_scale=torch.tensor(1.3))
    case.logit_scale = 1.3
    assert_close("loss", loss, oracle(case), LOSS_RTOL[torch.float32])


def test_the_slow_route_is_announced_once(caplog):
    from cce_compile import functional

    functional._warned.clear()
    case = _case()
    with caplog.at_level(logging.WARNING, logger="cce_compile"):
        for _ in range(2):
            torch.func.grad(lambda h: _ours(case, h, case.classifier))(case.hidden)
    assert len([r for r in caplog.records if "functorch" in r.getMessage()]) == 1


@pytest.mark.parametrize("mode", ["auto", "lean", "fast"])
def test_cpu_autocast_computes_like_f_linear_under_autocast(mode):
    """Under autocast, F.linear runs in bfloat16 and cross_entropy in float32: the op sees
    the head's inputs cast to bfloat16, and gradients flow back to the float32 leaves."""
    case = _case(**OPTIONS)
    hidden = case.hidden.clone().requires_grad_()
    classifier = case.classifier.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _ours(case, hidden, classifier, mode=mode)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    cast = dict(case.__dict__)
    cast.update(
        hidden=case.hidden.bfloat16().requires_grad_(),
        classifier=case.classifier.bfloat16().requires_grad_(),
        bias=case.bias.bfloat16().requires_grad_(),
    )
    cast_case = type(case)(**cast)
    want = oracle(cast_case)
    assert_close("loss", loss, want, LOSS_RTOL[torch.bfloat16])
    want_h, want_c = torch.autograd.grad(want, [cast_case.hidden, cast_case.classifier])
    assert_close("grad_hidden", hidden.grad, want_h, GRAD_RTOL[torch.bfloat16])
    assert_close("grad_classifier", classifier.grad, want_c, GRAD_RTOL[torch.bfloat16])


def test_backward_inside_autocast_keeps_float32_math():
    case = _case(**OPTIONS)
    hidden = case.hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = _ours(case, hidden, case.classifier.bfloat16(), mode="lean")
        loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        again = _ours(case, hidden.detach().requires_grad_(), case.classifier.bfloat16())
    torch.testing.assert_close(loss, again, rtol=0, atol=0)
    assert hidden.grad.dtype == torch.float32


EMPTY = {"B0-T5": ((0, 5), 0), "B3-T0": ((3, 0), 0), "B0-T5-shift": ((0, 5), 1)}


# Fast mode needs a scalar loss, so it is not asked for with reduction="none".
MODE_REDUCTIONS = [("lean", r) for r in ("mean", "sum", "none")] + [
    ("fast", r) for r in ("mean", "sum")
]


@pytest.mark.parametrize("mode, reduction", MODE_REDUCTIONS, ids=lambda v: str(v))
@pytest.mark.parametrize("leading, shift", EMPTY.values(), ids=EMPTY.keys())
def test_empty_batch(leading, shift, mode, reduction):
    case = build_case(leading=leading, dim=4, vocab=6, bias=True, reduction=reduction)
    case.hidden.requires_grad_()
    case.classifier.requires_grad_()
    loss = lce(
        case.hidden,
        case.classifier,
        case.targets,
        case.bias,
        reduction=reduction,
        shift=shift,
        mode=mode,
    )
    if reduction == "mean":
        assert torch.isnan(loss)  # PyTorch: 0 / 0
    elif reduction == "sum":
        assert loss.item() == 0.0
    else:
        assert loss.shape == (leading[0], leading[1] - shift)
    grads = torch.autograd.grad(loss.nan_to_num().sum(), [case.hidden, case.classifier])
    assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_compiled_functorch_grad_takes_the_same_route_as_eager():
    case = _case(**OPTIONS)
    grad = torch.func.grad(lambda h: _ours(case, h, case.classifier))
    torch._dynamo.reset()
    with inductor_without_codegen():
        compiled = torch.compile(grad, fullgraph=True)(case.hidden)
    want = torch.func.grad(lambda h: _theirs(case, h, case.classifier.double()))(
        case.hidden.double()
    )
    assert_close("compiled func.grad", compiled, want, GRAD_RTOL[torch.float32])


def test_plain_compile_has_no_graph_break():
    from torch._dynamo.utils import counters

    case = _case(**OPTIONS)
    hidden = case.hidden.clone().requires_grad_()
    torch._dynamo.reset()
    counters.clear()
    with inductor_without_codegen():
        torch.compile(lambda h: _ours(case, h, case.classifier), fullgraph=True)(hidden).backward()
    assert not counters["graph_break"]


def test_double_backward_is_refused_clearly():
    case = _case(**OPTIONS)
    hidden = case.hidden.clone().requires_grad_()
    loss = _ours(case, hidden, case.classifier)
    (grad_h,) = torch.autograd.grad(loss, hidden, create_graph=True)
    want = torch.autograd.grad(_theirs(case, hidden.double(), case.classifier.double()), hidden)[0]
    assert_close("first-order gradient under create_graph", grad_h, want, GRAD_RTOL[torch.float32])
    with pytest.raises(RuntimeError, match="does not support double backward"):
        grad_h.pow(2).sum().backward()


def _retained_twice(case, mode, compiled):
    """Gradients after two backwards through one graph (retain_graph=True), accumulated."""
    hidden = case.hidden.clone().requires_grad_()
    classifier = case.classifier.clone().requires_grad_()

    def loss_of(h, c):
        return _ours(case, h, c, mode=mode)

    fn = torch.compile(loss_of, fullgraph=True, backend="aot_eager") if compiled else loss_of
    # A compiled backward donates its saved buffers unless told not to: PyTorch's own error
    # for retain_graph says to set this, for any compiled graph.
    with torch._functorch.config.patch(donated_buffer=False):
        loss = fn(hidden, classifier)
        loss.backward(retain_graph=True)
        (loss * 3.0).backward()  # a different upstream gradient the second time
    return hidden.grad, classifier.grad


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_a_second_backward_through_the_same_graph_gives_exact_gradients(mode, compiled):
    """Fast mode's forward holds the gradients for a unit upstream gradient: a second backward
    (retain_graph) must scale them again, never a buffer the first backward consumed."""
    case = _case(**OPTIONS)
    grad_h, grad_c = _retained_twice(case, mode, compiled)
    hidden = case.hidden.double().requires_grad_()
    classifier = case.classifier.double().requires_grad_()
    want_h, want_c = torch.autograd.grad(
        4.0 * _theirs(case, hidden, classifier), (hidden, classifier)
    )
    assert_close("grad hidden", grad_h, want_h.float(), GRAD_RTOL[torch.float32])
    assert_close("grad classifier", grad_c, want_c.float(), GRAD_RTOL[torch.float32])
