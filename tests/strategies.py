"""Hypothesis strategies and builders for linear_cross_entropy inputs (small, odd shapes)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from oracle import Case

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def random_targets(shape, vocab, ignored_fraction, ignore_index, generator):
    targets = torch.randint(0, vocab, shape, generator=generator)
    ignored = torch.rand(shape, generator=generator) < ignored_fraction
    return torch.where(ignored, torch.full_like(targets, ignore_index), targets)


def build_case(
    *,
    leading,
    dim,
    vocab,
    dtype=torch.float32,
    seed=0,
    ignored_fraction=0.1,
    bias=False,
    class_weights=False,
    target_dtype=torch.int64,
    scale=1.0,
    **options,
) -> Case:
    """Fresh random inputs; hidden ~ N(0, scale^2), classifier ~ N(0, 1/D)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(*leading, dim, generator=gen) * scale).to(dtype)
    classifier = (torch.randn(vocab, dim, generator=gen) / dim**0.5).to(dtype)
    ignore_index = options.pop("ignore_index", -100)
    targets = random_targets(leading, vocab, ignored_fraction, ignore_index, gen).to(target_dtype)
    case = Case(hidden, classifier, targets, ignore_index=ignore_index, **options)
    if bias:
        case.bias = (torch.randn(vocab, generator=gen) * 0.5).to(dtype)
    if class_weights:
        case.class_weights = torch.rand(vocab, generator=gen) + 0.25
    return case


@st.composite
def cases(draw, dtypes=DTYPES, max_vocab=70, max_dim=40, max_rows=24) -> tuple[Case, dict]:
    """A Case over every option, plus flags: which inputs require grad, mode, return_lse."""
    ndim = draw(st.integers(0, 3))  # leading dims of hidden
    leading = tuple(draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim)))
    while leading and torch.Size(leading).numel() > max_rows:
        leading = leading[1:]
    reduction = draw(st.sampled_from(["mean", "sum", "none"]))
    time = leading[-1] if leading else 1
    shift = draw(st.integers(0, time - 1)) if len(leading) >= 1 and time > 1 else 0
    vocab = draw(st.integers(1, max_vocab))
    ignore_index = draw(st.sampled_from([-100, -1, 0 if vocab > 1 else -100]))
    case = build_case(
        leading=leading,
        dim=draw(st.integers(1, max_dim)),
        vocab=vocab,
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
        ignored_fraction=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
        bias=draw(st.booleans()),
        class_weights=draw(st.booleans()),
        target_dtype=draw(st.sampled_from([torch.int64, torch.int32])),
        scale=draw(st.sampled_from([1.0, 4.0])),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=draw(st.sampled_from([0.0, 0.1, 1.0])),
        softcap=draw(st.sampled_from([None, 2.5, 30.0])),
        logit_scale=draw(st.sampled_from([1.0, 0.5, 3.0])),
        shift=shift,
        z_loss=draw(st.sampled_from([0.0, 1e-2])),
    )
    modes = ["lean", "auto"] + ([] if reduction == "none" else ["fast"])
    flags = dict(
        mode=draw(st.sampled_from(modes)),
        return_lse=draw(st.booleans()),
        grads=draw(st.sampled_from(["all", "hidden", "classifier", "none"])),
    )
    return case, flags
