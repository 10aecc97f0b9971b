"""The PyTorch path in many small tiles: row blocks and slabs of classes (the last of each
partial), and several fast-mode chunks, give the float64 oracle's loss and gradients for every
option, and the same results as one tile."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_close, oracle_logits, rel_error
from strategies import build_case
from test_functional import run_and_compare

import cce_compile
from cce_compile import filtering, policy
from cce_compile.implementations import torch_path
from cce_compile.implementations.interface import HeadInputs

LEAD, DIM, VOCAB = (3, 9), 16, 600  # 27 rows; slabs of 256: 256 + 256 + 88 classes


@pytest.fixture
def small_tiles(monkeypatch):
    """Lean tiles of 5 rows x 256 classes, fast chunks of 5 rows."""
    monkeypatch.setattr(torch_path, "ROW_TILE", 7)
    monkeypatch.setattr(torch_path, "TILE_ELEMENTS", 7 * torch_path.SLAB_ALIGN)
    monkeypatch.setattr(
        torch_path,
        "cpu_chunk_rows",
        lambda cols, budget: min(5, policy.cpu_chunk_rows(cols, budget)),
    )


def test_the_fixture_makes_many_tiles(small_tiles):
    tiles = torch_path._Tiles.of(27, VOCAB, policy.MIN_BUDGET)
    assert (tiles.rows, tiles.cols) == (5, 256)


NUMERIC = dict(label_smoothing=0.1, softcap=4.0, logit_scale=1.3, z_loss=1e-3)
OPTIONS = {
    "plain": {},
    "numeric": dict(NUMERIC, bias=True),
    "class-weights": dict(NUMERIC, class_weights=True),
    "shift": dict(shift=2, bias=True),
    "none": dict(reduction="none", label_smoothing=0.2, class_weights=True),
    "sum": dict(reduction="sum", z_loss=1e-2, softcap=3.0),
    "all-ignored": dict(ignored_fraction=1.0, reduction="sum"),
}


# Fast mode needs a scalar loss, so it is not asked for with reduction="none".
MODE_OPTIONS = [
    (mode, name)
    for name in OPTIONS
    for mode in ("lean", "fast")
    if mode == "lean" or OPTIONS[name].get("reduction") != "none"
]


@pytest.mark.parametrize("mode, name", MODE_OPTIONS, ids=lambda v: str(v))
def test_small_tiles_match_the_oracle(small_tiles, name, mode):
    options = dict(OPTIONS[name])
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=5, scale=3.0, **options)
    run_and_compare(case, mode=mode)


@pytest.mark.parametrize("grads", ["hidden", "classifier"])
def test_small_tiles_with_some_gradients_and_the_lse(small_tiles, grads):
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=6, bias=True, shift=1)
    run_and_compare(case, mode="lean", grads=grads, return_lse=True)


def test_small_tiles_with_rows_that_are_not_one_matrix(small_tiles):
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=7, shift=1)
    case.hidden = case.hidden.transpose(0, 1).contiguous().transpose(0, 1)  # strided rows
    assert not case.hidden.is_contiguous()
    run_and_compare(case, mode="lean")
    run_and_compare(case, mode="fast")


def _loss_and_grads(case, **options):
    hidden = case.hidden.detach().requires_grad_()
    classifier = case.classifier.detach().requires_grad_()
    loss = cce_compile.linear_cross_entropy(
        hidden, classifier, case.targets, mode="lean", **options
    )
    return (loss, *torch.autograd.grad(loss, [hidden, classifier]))


@pytest.mark.parametrize("beta", [0.0, 0.3])
def test_gradient_filtering_across_slabs(monkeypatch, beta):
    # Peaked rows: most blocks of classes are skipped at beta 0.3.
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=8, ignored_fraction=0.0)
    targets = case.targets.clamp(min=0)
    case.hidden = case.hidden + 4 * case.classifier[targets] * DIM**0.5
    whole = _loss_and_grads(case, grad_filter=beta)
    monkeypatch.setattr(torch_path, "ROW_TILE", 7)
    monkeypatch.setattr(torch_path, "TILE_ELEMENTS", 7 * torch_path.SLAB_ALIGN)
    tiled = _loss_and_grads(case, grad_filter=beta)
    assert filtering.report()["kept_blocks"] < (1.0 if beta else 1.1)
    # The same blocks are kept: the results differ by float32 summation order only.
    for a, b in zip(whole, tiled):
        assert rel_error(b, a) < 1e-5
    if beta == 0.0:
        for a, b in zip(_loss_and_grads(case), tiled):
            assert rel_error(b, a) < 1e-5


def test_vocabulary_split_over_slabs(small_tiles):
    # The vocabulary-parallel form: this rank holds classes [300, 600); targets elsewhere give
    # no target term. Its stats and gradients equal the same slice of one-tile results.
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=9)
    spec = cce_compile.loss_math.LossSpec()
    hidden, part = case.hidden, case.classifier[300:]
    head = HeadInputs(
        hidden, part, case.targets, None, None, spec, policy.MIN_BUDGET, col_start=300
    )
    tiled = torch_path.logit_stats(head, all_rows=True)
    logits = hidden.reshape(-1, DIM).double() @ part.double().T
    torch.testing.assert_close(tiled.lse, torch.logsumexp(logits, -1).float())
    flat = case.targets.reshape(-1)
    mine = (flat >= 300) & (flat < VOCAB)
    expected = torch.where(mine, logits.gather(1, (flat - 300).clamp(0, 299)[:, None])[:, 0], 0)
    torch.testing.assert_close(tiled.target_logit, expected.float())


@pytest.mark.parametrize("mode", ["lean", "fast"])
def test_small_tiles_entropy_and_argmax(small_tiles, mode):
    # Each row's entropy and argmax combine over the slabs (lean) and chunks (fast); classes 3
    # and 300 (slabs 0 and 1) tie for some rows' largest logit: the first class wins.
    case = build_case(leading=LEAD, dim=DIM, vocab=VOCAB, seed=10, logit_scale=1.3, bias=True)
    case.classifier[300] = case.classifier[3]
    case.bias[300] = case.bias[3]
    tied = case.classifier[3]
    case.hidden[0, :3] = tied * (10 / tied.square().sum())  # rows whose largest logits tie
    logits = oracle_logits(case.hidden, case.classifier, case.bias, case.softcap, case.logit_scale)
    assert (logits.argmax(-1) == 3).sum() >= 3
    hidden = case.hidden.detach().requires_grad_()
    _, entropy, argmax = cce_compile.linear_cross_entropy(
        hidden,
        case.classifier,
        case.targets,
        case.bias,
        mode=mode,
        return_entropy=True,
        return_argmax=True,
        **case.options(),
    )
    valid = case.targets != case.ignore_index
    want = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    want = torch.where(valid, want, 0.0)
    assert_close("entropy", entropy, want, 1e-5, want.abs().max().item())
    assert torch.equal(argmax, torch.where(valid, logits.argmax(-1), -1))
