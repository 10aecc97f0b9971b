"""The memory policy: the budget, the mode auto picks, and the chunks and slabs that fit."""

from __future__ import annotations

import dataclasses

import pytest

import cce_compile
from cce_compile import policy
from cce_compile.policy import MIN_FAST_ROWS, MIN_FROZEN_FAST_ROWS, Problem, choose_mode

# Shape E of bench/: 8192 tokens, D 4096, V 128256, bf16.
E = Problem(rows=8192, vocab=128256, dim=4096, logit_bytes=2)
# E under AMP: float32 hidden and classifier rounded to bf16.
AMP = dataclasses.replace(E, rounds_hidden=True, rounds_classifier=True)
BIG = 10**13
ROW = (E.vocab + E.dim) * 4  # a fast chunk's bytes per row: float32 logits and d hidden
FUSED_ROW = policy.fast_row_bytes(E, fused=True)  # bf16 scaled exponentials from the GEMM


def choose(requested="auto", problem=E, budget=BIG, **overrides):
    args = dict(reduction="mean", needs_grad=True, needs_classifier=True, outputs_have_grad=False)
    args.update(overrides)
    return choose_mode(requested, problem=problem, budget=budget, **args)


def test_budget_is_a_fraction_of_the_logits_or_an_absolute_number():
    logits = E.rows * E.vocab * E.logit_bytes
    assert policy.budget_bytes(E, None, 0.125) == logits // 8
    assert policy.budget_bytes(E, 64, 0.125) == 64 * 2**20
    tiny = Problem(rows=3, vocab=5, dim=2, logit_bytes=4)
    assert policy.budget_bytes(tiny, None, 0.125) == policy.MIN_BUDGET
    # A vocabulary-parallel share: the fraction scaled, an absolute budget as it is.
    scaled = int(0.125 * policy.VOCAB_PARALLEL_BUDGET_SCALE * logits)
    assert policy.budget_bytes(E, None, 0.125, vocab_parallel=True) == scaled
    assert policy.budget_bytes(E, 64, 0.125, vocab_parallel=True) == 64 * 2**20


def test_auto_takes_fast_when_a_useful_chunk_fits():
    assert choose() == "fast"


def test_fast_counts_no_classifier_sized_buffer():
    """The classifier's gradient accumulates the chunks itself: an output, not extra memory."""
    assert policy.fast_fixed_bytes(E) == 0
    amp = AMP
    assert policy.fast_fixed_bytes(amp) == E.rows * E.dim * 2  # the rounded hidden


def test_the_floor_scales_with_the_classifier_gradients_element_size():
    """Each chunk re-reads and re-writes the classifier's gradient: a float32 one (AMP) needs
    twice the rows of a bf16 one to amortise it."""
    amp = AMP
    fp32 = Problem(rows=E.rows, vocab=E.vocab, dim=E.dim, logit_bytes=4)
    assert policy.fast_floor_rows(amp, True) == policy.fast_floor_rows(fp32, True) == MIN_FAST_ROWS
    assert policy.fast_floor_rows(E, True) == MIN_FAST_ROWS // 2
    assert policy.fast_floor_rows(E, False) == MIN_FROZEN_FAST_ROWS


@pytest.mark.parametrize(
    "override",
    [
        dict(reduction="none"),
        dict(needs_grad=False),
        dict(outputs_have_grad=True),
        dict(budget=(policy.fast_floor_rows(E, True) - 1) * FUSED_ROW),
        dict(budget=(policy.fast_floor_rows(E, True) - 1) * ROW, whole_rows=True),
    ],
    ids=["none", "no-grad", "lse-grad", "chunk-under-min-rows", "whole-rows-under-min-rows"],
)
def test_auto_takes_lean(override):
    assert choose(**override) == "lean"


def test_auto_sizes_fast_chunks_by_the_form_they_take():
    """A bf16 chunk of scaled exponentials from the GEMM takes ~half a whole float32 row, so
    a budget too small for the floor's whole rows still admits fast, unless the call needs
    whole rows (softcap, entropy, argmax; not a vocabulary shard, whose statistics come from
    the GEMM's partials)."""
    floor = policy.fast_floor_rows(E, True)
    assert FUSED_ROW < ROW / 1.8
    budget = floor * ROW - 1
    assert choose(budget=budget) == "fast"
    assert choose(budget=budget, whole_rows=True) == "lean"
    fp32 = dataclasses.replace(E, logit_bytes=4)  # a float32 gradient: no fused form
    assert not policy.fast_fuses_exp(fp32, False) and policy.fast_fuses_exp(E, False)
    assert not policy.fast_fuses_exp(E, True)
    for reason in ("softcap", "entropy", "argmax"):
        flags = dict(dict(softcap=False, entropy=False, argmax=False), **{reason: True})
        assert policy.fast_needs_whole_rows(**flags)
    assert not policy.fast_needs_whole_rows(softcap=False, entropy=False, argmax=False)


def test_a_small_problem_takes_fast_when_all_its_rows_fit():
    small = Problem(rows=100, vocab=1000, dim=64, logit_bytes=2, device_type="cpu")
    budget = 100 * (1000 + 64) * 4
    assert choose(problem=small, budget=budget) == "fast"


def test_a_frozen_classifier_takes_fast_with_budget_sized_chunks():
    """No classifier gradient (LoRA): no V x D buffer, and chunks of a few hundred rows are
    still faster than lean's third GEMM, so the default budget picks fast (shapes E and B)."""
    for problem in (E, Problem(rows=16384, vocab=128256, dim=4096, logit_bytes=2)):
        budget = policy.budget_bytes(problem, None, 0.125)
        assert choose(problem=problem, needs_classifier=False, budget=budget) == "fast"
        rows = policy.fast_run_rows(problem, False, budget)
        assert MIN_FROZEN_FAST_ROWS <= rows and rows * (problem.vocab + problem.dim) * 4 <= budget
    under_floor = (MIN_FROZEN_FAST_ROWS - 1) * FUSED_ROW
    assert choose(needs_classifier=False, budget=under_floor) == "lean"


def test_a_frozen_heads_chunks_take_a_share_of_the_budget():
    """No classifier gradient to re-read per chunk: a frozen call's chunks take
    FROZEN_BUDGET_SHARE of what the budget leaves, so that with compaction's copy of the kept
    rows its extra memory stays under 1/8 of the logits at the default fraction (E and B)."""
    fraction = cce_compile.config.Settings().memory_fraction
    for rows in (8192, 16384):
        problem = Problem(rows=rows, vocab=128256, dim=4096, logit_bytes=2)
        logits = rows * problem.vocab * 2
        copy = rows * problem.dim * 2  # compaction's copy, were every row kept
        budget = policy.budget_bytes(problem, None, fraction) - copy
        frozen = policy.fast_run_rows(problem, False, budget, fused=True)
        trained = policy.fast_run_rows(problem, True, budget, fused=True)
        assert frozen == int(budget * policy.FROZEN_BUDGET_SHARE) // FUSED_ROW
        assert MIN_FROZEN_FAST_ROWS <= frozen < trained
        assert copy + frozen * FUSED_ROW <= logits / 8
        assert choose(problem=problem, needs_classifier=False, budget=budget) == "fast"


@pytest.mark.parametrize("rows", [1472, 2048, 2816, 3328])
def test_the_frozen_share_never_turns_auto_to_lean(rows):
    """A frozen head whose whole budget holds the floor (256 rows) but whose share does not
    (Llama-2/3-sized heads at 1-3 x 2048 tokens) still takes fast, in floor-sized chunks: the
    share saves memory, it must not cost lean's third GEMM."""
    for vocab in (32000, 128256):
        problem = Problem(rows=rows, vocab=vocab, dim=4096, logit_bytes=2)
        budget = policy.budget_bytes(problem, None, 0.2)
        if policy.fast_chunk_rows(problem, budget, True) < MIN_FROZEN_FAST_ROWS:
            continue  # the whole budget does not hold the floor either
        assert choose(problem=problem, needs_classifier=False, budget=budget) == "fast"
        run = policy.fast_run_rows(problem, False, budget, fused=True)
        assert MIN_FROZEN_FAST_ROWS <= run
        assert run * policy.fast_row_bytes(problem, fused=True) <= budget


def test_a_frozen_rounded_classifier_keeps_the_whole_budget():
    """Under AMP the classifier's uncounted rounded copy dominates a frozen call's memory:
    halving its chunks saved 8% of the memory for 13% of the time at E (H200), so the share
    applies only to a classifier that is not rounded."""
    budget = policy.budget_bytes(AMP, None, 0.2)
    frozen = policy.fast_chunk_rows(AMP, budget, True, needs_classifier=False)
    assert frozen == policy.fast_chunk_rows(AMP, budget, True) > 0
    bf16_frozen = policy.fast_chunk_rows(E, budget, True, needs_classifier=False)
    assert bf16_frozen < policy.fast_chunk_rows(E, budget, True)


def test_a_frozen_classifier_under_autocast_takes_fast_beside_autocasts_own_copy():
    """AMP rounds the float32 classifier: that V x D copy is the one autocast makes for
    F.linear, which torch.compile holds too, so it is not counted, and a frozen head (LoRA
    on a float32 model) takes fast with budget-sized chunks; the rounded hidden is counted."""
    amp = AMP
    budget = policy.budget_bytes(amp, None, 0.125)
    assert choose(problem=amp, needs_classifier=False, budget=budget) == "fast"
    rows = policy.fast_run_rows(amp, False, budget)
    assert E.rows * E.dim * 2 + rows * (E.vocab + E.dim) * 4 <= budget


def test_explicit_modes():
    assert choose("lean") == "lean"
    assert choose("fast", outputs_have_grad=True) == "fast"  # still exact, only slower
    assert choose("fast", reduction="none") == "lean"  # configured: falls back
    with pytest.raises(ValueError, match="fast"):
        choose("fast", reduction="none", explicit=True)


def test_fast_chunk_rows_bounded_by_budget_and_rows():
    assert policy.fast_chunk_rows(E, BIG) == policy.FAST_CHUNK_ROWS
    assert policy.fast_chunk_rows(E, 10 * ROW) == 10
    assert policy.fast_chunk_rows(E, 10 * ROW - 1) == 9
    assert policy.fast_chunk_rows(E, 0) == 0
    few = Problem(rows=7, vocab=10, dim=3, logit_bytes=2)
    assert policy.fast_chunk_rows(few, BIG) == 7


def test_mixed_precision_counts_the_rounded_copies():
    amp = AMP
    rounded_hidden = E.rows * E.dim * 2  # the classifier's copy is autocast's own: not counted
    assert policy.fast_fixed_bytes(amp) == policy.fast_fixed_bytes(E) + rounded_hidden
    budget = policy.budget_bytes(amp, None, 0.125)
    columns = policy.lean_slab_columns(amp, True, budget)
    used = E.rows * E.dim * (4 + 2) + columns * (E.rows + E.dim) * 2
    assert columns > policy.MIN_SLAB_COLUMNS and used <= budget
    assert policy.forward_slab_columns(amp, budget) * E.dim * 2 <= budget
    assert policy.forward_slab_columns(E, budget) == E.vocab  # nothing to round: one launch


def test_lean_slab_fills_the_budget():
    budget = policy.budget_bytes(E, None, 0.125)
    columns = policy.lean_slab_columns(E, True, budget)
    assert E.rows * E.dim * 4 + columns * E.rows * 2 <= budget
    assert E.rows * E.dim * 4 + (columns + 1) * E.rows * 2 > budget


def test_lean_slab_never_narrower_than_the_efficiency_floors():
    """Shape C (V < 16 D): the float32 d-hidden accumulator alone is over 1/8 of the logits,
    and slabs of the 2048-class floor would leave the GPU waiting on the host's launches: each
    slab gets at least MIN_SLAB_MACS of work."""
    c = Problem(rows=4096, vocab=32000, dim=2048, logit_bytes=2)
    budget = policy.budget_bytes(c, None, 0.125)
    assert c.rows * c.dim * 4 > budget
    columns = policy.lean_slab_columns(c, True, budget)
    assert columns * c.rows * c.dim >= policy.MIN_SLAB_MACS > (columns - 1) * c.rows * c.dim
    assert columns > policy.MIN_SLAB_COLUMNS
    thin = Problem(rows=1 << 20, vocab=32000, dim=4096, logit_bytes=2)  # floor: 2048 classes
    assert policy.lean_slab_columns(thin, True, 0) == policy.MIN_SLAB_COLUMNS


def test_a_fast_run_keeps_to_the_budget_when_auto_would_pick_fast():
    fixed = policy.fast_fixed_bytes(E)
    fits_1536 = fixed + 1536 * ROW
    assert choose(budget=fits_1536) == "fast"
    assert policy.fast_run_rows(E, True, fits_1536) == 1536  # (was the tuned 4096: over budget)
    # fast asked for where not a row fits: floor-sized chunks, as close to the budget as a
    # useful chunk allows (not the tuned 4096 rows: ~the logits' size)
    assert policy.fast_run_rows(E, True, fixed) == policy.fast_floor_rows(E, True)
    assert policy.fast_run_rows(E, True, -(10**9)) == policy.fast_floor_rows(E, True)
    few = Problem(rows=7, vocab=10, dim=3, logit_bytes=2)
    assert policy.fast_run_rows(few, True, 0) == 7


@pytest.mark.parametrize("needs_classifier", [True, False], ids=["trained", "frozen"])
def test_a_fast_run_a_little_under_the_floor_keeps_floor_sized_chunks(needs_classifier):
    """Auto chooses on the whole call; the run's budget is a little smaller (compaction's copy
    of the kept rows). A few rows short of the floor must give floor-sized chunks, not the
    tuned 4096 (measured: 3.1 GiB instead of ~0.3 at E under AMP with a frozen head)."""
    floor = policy.fast_floor_rows(E, needs_classifier)
    fixed = policy.fast_fixed_bytes(E)
    short_of_floor = fixed + (floor - 100) * ROW
    assert policy.fast_run_rows(E, needs_classifier, short_of_floor) == floor
    assert policy.fast_run_rows(E, needs_classifier, fixed + ROW) == floor


def test_skipping_ignored_rows_pays_on_a_gpu_only_for_problems_large_enough():
    """Its host sync exposes the host's launches: a loss of C's size (2^38 multiply-adds)
    runs slower with rows skipped on a GPU, E's (2^42) faster; on a CPU it always pays."""
    assert not policy.skipping_pays("cuda", 4096, 32000, 2048)  # shape C
    assert policy.skipping_pays("cuda", 8192, 128256, 4096)  # shape E
    assert policy.skipping_pays("cuda", 16384, 131072, 512)  # shape G, 2^40
    assert policy.skipping_pays("cpu", 4, 8, 2)


def test_the_default_budget_takes_fast_for_a_trained_bf16_head_at_e_and_b():
    """1/5 of the logits holds fast chunks of ~800 (E) and ~1600 (B) rows: measured on an H100
    at 1.08-1.12x and 0.99-1.09x compile's time, against lean's 1.32x and 1.27x."""
    fraction = cce_compile.config.Settings().memory_fraction
    for rows in (8192, 16384):
        problem = Problem(rows=rows, vocab=128256, dim=4096, logit_bytes=2)
        budget = policy.budget_bytes(problem, None, fraction)
        assert choose(problem=problem, budget=budget) == "fast"
        assert policy.fast_run_rows(problem, True, budget) * ROW <= budget


def test_a_narrow_head_on_a_gpu_takes_lean_for_whole_float32_rows():
    """D < MIN_FAST_DIM (shape G): fast's passes over float32 logits (a float32 compute dtype,
    or softcap / entropy / argmax / a shard) are slower than lean's extra GEMM."""
    g = Problem(rows=16384, vocab=131072, dim=512, logit_bytes=2)
    assert choose(problem=dataclasses.replace(g, logit_bytes=4)) == "lean"
    assert choose(problem=dataclasses.replace(g, rounds_classifier=True), whole_rows=True) == "lean"
    assert choose(problem=g, whole_rows=True) == "lean"
    assert choose(problem=dataclasses.replace(g, device_type="cpu")) == "fast"


def test_a_narrow_head_sums_a_bf16_classifier_gradient_in_a_float32_buffer():
    """D < MIN_FAST_DIM with a 2-byte classifier gradient (bf16 weights; or a bf16 classifier
    beside a rounded hidden): the fused chunks' gradient is summed in a float32 buffer (V x D x
    4, counted), whose re-read per chunk sets float32's floor; where the budget cannot hold the
    buffer and a floor chunk, lean. At D >= MIN_FAST_DIM the gradient sums itself."""
    fraction = cce_compile.config.Settings().memory_fraction
    buffer = 131072 * 512 * 4
    for g in (
        Problem(rows=16384, vocab=131072, dim=512, logit_bytes=2),
        Problem(16384, 131072, 512, 2, rounds_hidden=True),
        # bf16 weights under float16 autocast: rounded, but the gradient is bf16 (e8133ce)
        Problem(16384, 131072, 512, 2, True, True, rounded_classifier_bytes=2),
    ):
        assert policy.sums_classifier_in_float32(g, True, fused=True)
        assert policy.fast_fixed_bytes(g, True, fused=True) == buffer + policy.rounded_hidden_bytes(
            g
        )
        assert policy.fast_floor_rows(g, True, fused=True) == MIN_FAST_ROWS
        default = policy.budget_bytes(g, None, fraction)
        assert choose(problem=g, budget=default) == "fast"
        floor_chunk = MIN_FAST_ROWS * policy.fast_row_bytes(g, fused=True)
        short = policy.fast_fixed_bytes(g, True, fused=True) + floor_chunk - 1
        assert choose(problem=g, budget=short) == "lean"
    g = Problem(rows=16384, vocab=131072, dim=512, logit_bytes=2)
    assert not policy.sums_classifier_in_float32(g, True, fused=False)
    assert not policy.sums_classifier_in_float32(g, False, fused=True)  # frozen: no gradient
    assert not policy.sums_classifier_in_float32(dataclasses.replace(g, dim=1024), True, True)
    amp = dataclasses.replace(g, rounds_hidden=True, rounds_classifier=True)
    assert not policy.sums_classifier_in_float32(amp, True, fused=True)  # float32 already
    assert not policy.sums_classifier_in_float32(
        dataclasses.replace(g, device_type="cpu"), True, True
    )


def test_a_cross_half_gradient_is_summed_and_sliced_in_float32_and_counted():
    """bf16 weights under float16 autocast on a GPU: cuBLAS has no float16 -> bf16 product,
    so fast mode sums the gradient in a float32 buffer at every D (counted, with float32's
    floor), and lean counts each slab's float32 product (uncounted before 5bd9acd:
    550 MiB against a 300 MiB budget)."""
    e = Problem(8192, 128256, 4096, 2, True, True, rounded_classifier_bytes=2)
    assert policy.cross_half_gradient(e)
    for fused in (True, False):
        assert policy.sums_classifier_in_float32(e, True, fused)
        assert policy.fast_fixed_bytes(e, True, fused) == (
            policy.rounded_hidden_bytes(e) + 128256 * 4096 * 4
        )
        assert policy.fast_floor_rows(e, True, fused) == MIN_FAST_ROWS
    assert not policy.sums_classifier_in_float32(e, False, True)  # frozen: no gradient
    amp = dataclasses.replace(e, rounded_classifier_bytes=4)
    bf16 = dataclasses.replace(e, rounds_hidden=False, rounds_classifier=False)
    cpu = dataclasses.replace(e, device_type="cpu")
    for other in (amp, bf16, cpu):
        assert not policy.cross_half_gradient(other)
    budget = 1 << 30
    slab = policy.lean_slab_columns(e, True, budget)
    fixed = e.rows * e.dim * 4 + policy.rounded_hidden_bytes(e)
    assert slab == (budget - fixed) // (e.rows * 2 + e.dim * 2 + e.dim * 4)
    assert slab < policy.lean_slab_columns(amp, True, budget)


@pytest.mark.parametrize(
    "classifier, gradient_bytes",
    [("float32", 4), ("bfloat16", 2), ("float16", 2)],
    ids=["amp-float32", "bf16-under-fp16-autocast", "fp16-under-bf16-autocast"],
)
def test_a_rounded_classifier_has_the_gradient_of_its_own_dtype(classifier, gradient_bytes):
    """The classifier's gradient comes in its own dtype, not float32 because it is rounded."""
    import torch

    compute = torch.bfloat16 if classifier == "float16" else torch.float16
    dtype = getattr(torch, classifier)
    dtypes = (torch.float32, dtype)
    problem = policy.problem(8, (16, 4), compute, "cuda", compute_dtype=compute, dtypes=dtypes)
    assert problem.rounds_classifier and problem.classifier_gradient_bytes == gradient_bytes
    plain = policy.problem(8, (16, 4), compute, "cuda", compute_dtype=None, dtypes=(compute,) * 2)
    assert plain.classifier_gradient_bytes == 2


@pytest.mark.parametrize(
    "rounds_classifier, needs_classifier",
    [(True, True), (False, False), (True, False)],
    ids=["amp-float32-gradient", "bf16-frozen", "amp-frozen"],
)
def test_a_narrow_head_takes_fused_fast_where_no_bf16_gradient_sums_the_chunks(
    rounds_classifier, needs_classifier
):
    """Under AMP the float32 classifier gradient sums the chunks exactly, and a frozen head has
    none: fused chunks, faster than lean at G (H200, 13f080f), are auto's choice there."""
    g = Problem(16384, 131072, 512, 2, rounds_classifier, rounds_classifier)
    default = policy.budget_bytes(g, None, cce_compile.config.Settings().memory_fraction)
    assert choose(problem=g, budget=default, needs_classifier=needs_classifier) == "fast"


def test_fused_fast_chunks_hold_more_rows_within_the_same_budget():
    """The GEMM's bf16 scaled exponentials (2 bytes a logit and a few float32 values per tile)
    instead of float32 logits: ~1.8x the rows a chunk at the default budget at E, within it."""
    default = policy.budget_bytes(E, None, 0.2)
    rows = policy.fast_chunk_rows(E, default, fused=True)
    assert rows > 1.8 * policy.fast_chunk_rows(E, default)
    assert policy.fast_run_rows(E, True, default, fused=True) == rows


@pytest.mark.parametrize("dim", [512, 2048, 2304, 4096])
@pytest.mark.parametrize("heavy", [False, True], ids=["plain", "heavy"])
def test_fused_row_bytes_cover_what_a_fused_chunk_allocates(dim, heavy):
    """``fast_row_bytes(fused=True)`` against the buffers ``triton_fast._FastBuffers`` makes per
    row on a GPU: the padded bf16 row, tile maxima, partial lse and (label smoothing) partial
    weighted sums per ``logits_exp`` tile of the GPU's tile configuration, and d hidden."""
    import torch

    from cce_compile.implementations.triton_shared import fused_tile_config
    from cce_compile.kernels.logits_exp import exp_blocks

    config = fused_tile_config(torch.device("cuda"), heavy, dim=dim, tma=True)
    assert config.block_v >= policy.FUSED_TILE_MIN_CLASSES
    for vocab in (1, 7, 127, 128, 129, 32000, 50257, 128256, 256000):
        problem = Problem(rows=64, vocab=vocab, dim=dim, logit_bytes=2)
        allocated = -(-vocab // 8) * 8 * 2 + exp_blocks(vocab, config) * 4 * 3 + dim * 4
        assert allocated <= policy.fast_row_bytes(problem, fused=True), vocab


def test_rounding_is_counted_per_operand_alike_where_a_call_is_planned():
    """Under autocast each operand is rounded apart: a rounded hidden is a copy, a rounded
    (float32) classifier has a float32 gradient, a float32 bias rounded alone is neither. The
    mode choice (``decide.problem_of``) and the Triton path's plan (``triton_shared.problem``)
    disagreed on a bias rounded alone (a hidden copy and AMP's chunk floor counted that are not
    there: found by a review, b84c7fa), and both counted a copy of a bf16 hidden beside a float32
    classifier, and a float32 gradient beside a float32 hidden, that are not there either."""
    import torch

    from cce_compile import decide
    from cce_compile.implementations import triton_shared
    from cce_compile.implementations.interface import HeadInputs
    from cce_compile.kernels.common import row_layout

    bf16, f32 = torch.bfloat16, torch.float32
    assert policy.rounding(None, f32, f32) == (False, False)
    targets = torch.zeros(2, 3, dtype=torch.int64)
    for hidden_dtype, classifier_dtype in ((bf16, bf16), (f32, f32), (f32, bf16), (bf16, f32)):
        hidden = torch.zeros(2, 3, 8, dtype=hidden_dtype)
        classifier = torch.zeros(16, 8, dtype=classifier_dtype)
        spec = decide.loss_spec(hidden, -100, "mean", 0.0, None, 1.0, 0, 0.0)
        bias = torch.zeros(16)  # float32: rounded under autocast, counted for nothing
        head = HeadInputs(hidden, classifier, targets, bias, None, spec, 1 << 20, bf16)
        planned = triton_shared.problem(row_layout(hidden, 0), head, hidden.to(bf16))
        chosen = decide.problem_of(hidden, classifier, 0, bf16)
        expected = (hidden_dtype != bf16, classifier_dtype != bf16)
        assert (planned.rounds_hidden, planned.rounds_classifier) == expected
        assert (chosen.rounds_hidden, chosen.rounds_classifier) == expected


def test_a_rounded_operand_costs_only_what_it_makes():
    """A bf16 hidden beside a float32 classifier: no copy of hidden; a float32 hidden beside a
    bf16 classifier: a bf16 classifier gradient, re-read at bf16's floor (512 rows, not
    1024). At N 8192, V 32000, D 2048 both fit fast chunks, which counting both operands as
    rounded refused (found by a review, b84c7fa)."""
    shape = dict(rows=8192, vocab=32000, dim=2048, logit_bytes=2)
    classifier_only = Problem(**shape, rounds_classifier=True)
    hidden_only = Problem(**shape, rounds_hidden=True)
    both = Problem(**shape, rounds_hidden=True, rounds_classifier=True)
    assert policy.fast_fixed_bytes(classifier_only) == 0
    assert policy.fast_fixed_bytes(hidden_only) == 8192 * 2048 * 2
    assert policy.fast_floor_rows(hidden_only, True) == MIN_FAST_ROWS // 2
    assert policy.fast_floor_rows(classifier_only, True) == MIN_FAST_ROWS
    budget = policy.budget_bytes(both, None, 0.2)
    assert choose(problem=both, budget=budget) == "lean"
    assert choose(problem=classifier_only, budget=budget) == "fast"
    assert choose(problem=hidden_only, budget=budget) == "fast"


def test_float16_gradients_keep_lean_and_refuse_an_explicit_fast(caplog):
    """Fast mode rounds its gradients for a unit upstream gradient, before the real one scales
    them: float16 ones overflow (a sum later divided) or flush to zero (a loss scaler's small
    gradients) where PyTorch's do not (found in 4f3e6ba). Auto takes lean; an explicit
    'fast' is an error naming the mode; a configured one runs lean and says so once."""
    with pytest.raises(ValueError, match="mode='fast' computes float16 gradients"):
        choose("fast", explicit=True, float16_gradients=True)
    assert choose(float16_gradients=True) == "lean"
    policy._log_float16_once.cache_clear()
    with caplog.at_level("WARNING", logger="cce_compile"):
        assert choose("fast", float16_gradients=True) == "lean"
        assert choose("fast", float16_gradients=True) == "lean"
    told = [r for r in caplog.records if "float16" in r.getMessage()]
    assert len(told) == 1 and "CCE_MODE=fast" in told[0].getMessage()
    assert choose() == "fast"


@pytest.mark.parametrize(
    "dtypes, needs, float16",
    [
        (("float16", "float16", None), (True, True, False), True),
        (("float32", "float16", None), (True, True, False), True),
        (("float32", "float32", "float16"), (True, True, True), True),
        (("float32", "float32", "float16"), (True, True, False), False),
        (("float16", "float32", None), (False, True, False), False),
        (("float32", "float32", None), (True, True, False), False),
        (("bfloat16", "bfloat16", "bfloat16"), (True, True, True), False),
    ],
    ids=[
        "fp16",
        "fp16-classifier",
        "fp16-bias",
        "fp16-bias-frozen",
        "frozen-fp16-hidden",
        "float32-under-fp16-autocast",
        "bf16",
    ],
)
def test_float16_gradients_are_those_asked_of_float16_inputs(dtypes, needs, float16):
    """A gradient comes in its input's dtype, whatever the compute dtype: float16 where a
    float16 hidden, classifier or bias needs one (f7d0bc0's cases: a float16 bias under a loss
    scaler flushed to zero; frozen float16 features refused fast for a float32 gradient)."""
    import torch

    from cce_compile import decide

    problem = E
    flags = dict(zip(("grad_hidden", "grad_classifier", "grad_bias"), needs))
    dtypes = tuple(None if d is None else getattr(torch, d) for d in dtypes)
    with cce_compile.config.override(mode="auto", memory_budget_mb=4096):
        chosen = decide.mode(None, problem, flags, dtypes=dtypes, reduction="mean")
    assert chosen == ("lean" if float16 else "fast")
