"""The memory policy: how much extra memory the loss may use, and the mode and chunking that
fit in it. docs/design.md's "Memory policy" table states the same rules.

Every extra byte is counted against one budget (beyond the op's inputs, its outputs and the
gradients it returns):

* budget: ``CCE_MEMORY_BUDGET_MB`` if set; else ``CCE_MEMORY_FRACTION`` (1/5) of the logits it
  replaces, N x V x the head's dtype size (a vocabulary-parallel call:
  ``VOCAB_PARALLEL_BUDGET_SCALE`` times that fraction of each rank's share); at least
  ``MIN_BUDGET``.
* lean: forward, the rounded hidden (AMP) and one rounded classifier slab; backward, a float32
  d-hidden accumulator (N x D x 4), the rounded hidden (AMP) and slabs of ``w`` classes
  (N x w gradient, plus w x D rounded classifier under AMP, plus w x D x 4 for a
  ``cross_half_gradient``), ``w`` as large as the budget allows and at least
  ``MIN_SLAB_COLUMNS`` (so at V < 16 D, where the accumulator alone is over 1/5 of the
  logits, lean takes more than the budget).
* fast: no V x D tensor of its own (the classifier's gradient, in its own dtype, accumulates
  the chunks: it is an output, not extra), except below ``MIN_FAST_DIM``, where a 2-byte
  gradient is summed in a float32 buffer (V x D x 4, counted), as is a
  ``cross_half_gradient`` at every D (``sums_classifier_in_float32``); the rounded hidden (AMP; the
  rounded classifier is autocast's own copy, not counted: ``fast_fixed_bytes``), and chunks
  of ``n`` rows with their float32 hidden gradient (n x D x 4): float32 logits (n x V x 4;
  the bf16 gradient is written over them), or, for a bf16 / fp16 gradient where no whole
  rows are needed (``fast_fuses_exp``), the logits GEMM's scaled exponentials (n x V x 2,
  plus a few float32 values per tile of classes); ``n`` at most ``FAST_CHUNK_ROWS`` and as
  large as the budget allows (``fast_row_bytes``); without a classifier gradient (a frozen
  head) and no rounded classifier, as large as ``FROZEN_BUDGET_SHARE`` of what the fixed
  bytes leave allows.
* auto: fast when it is valid (scalar loss, gradients wanted, no gradient of the returned lse)
  and a chunk of at least ``fast_floor_rows`` rows, or all rows, fits; else lean. A fast run
  keeps at least that floor (``fast_run_rows``). A compiled graph with a symbolic row count
  plans its mode for up to ``SYMBOLIC_PLAN_ROWS`` rows (``decide.planned_rows``).
* CPU path: chunks of rows of float32 temporaries (3 x V x 4 bytes per row) within the budget.

Why a floor (``fast_floor_rows``): each fast chunk re-reads and re-writes the classifier's
gradient (2 V D x its element size) against 6 n V D FLOPs of GEMMs; at ~700 TFLOP/s and ~3.3
TB/s that is about 260 / n of the chunk's time for a float32 gradient (AMP) and 130 / n for a
bf16 one, while lean's fourth GEMM costs a third: below ~800 (float32) or ~400 (bf16) rows fast
is the slower mode. Without a classifier gradient (a frozen head: LoRA, PEFT) a chunk's two
GEMMs re-read the classifier (4 V D bytes against 4 n V D FLOPs, n FLOP per byte), which an
H100-class GPU (~300 FLOP per byte from HBM, less from L2) sustains from a few hundred rows on,
while lean pays a third GEMM: ``MIN_FROZEN_FAST_ROWS``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

log = logging.getLogger("cce_compile")

# The most rows per fast-mode chunk: beyond it more rows buy little speed (the accumulator's
# re-read is ~5% at 4096) and cost chunk memory.
FAST_CHUNK_ROWS = 4096
# The narrowest hidden size at which auto prefers fast on a GPU with whole float32 rows (below
# it their bytes cost more than lean's fourth GEMM); below it a fused fast run sums a 2-byte
# classifier gradient in float32 (``sums_classifier_in_float32``). See bench/results/policy.md.
MIN_FAST_DIM = 1024
# The fewest rows per fast-mode chunk for auto to prefer fast over lean, for a float32
# classifier gradient (AMP); half of it for a 2-byte one (module docstring).
MIN_FAST_ROWS = 1024
# The same without a classifier gradient: no V x D buffer to re-read (module docstring).
MIN_FROZEN_FAST_ROWS = 256
# The share of the budget a fast run's chunks may take without a classifier gradient (a frozen
# head: LoRA, PEFT), unless the classifier is rounded (AMP), and never under the floor where
# the whole budget holds it (``fast_chunk_rows``): with no gradient to re-read per chunk, rows
# past a few hundred buy little time. Measured: bench/results/policy.md.
FROZEN_BUDGET_SHARE = 0.5
# The fewest classes per lean backward slab (see lean_slab_columns): the accumulator's
# traffic is ~8 N D V / w bytes against 6 N V D FLOPs, ~13% of the GEMMs' time at 2048 on an
# H100-class GPU (~200 FLOP per byte), ~3% at 8192.
MIN_SLAB_COLUMNS = 2048
# The least work per lean backward slab, in multiply-adds of one of its three GEMMs (N x w x
# D): below it the GPU waits on the host's launches of each slab. Measured: bench/results/policy.md.
MIN_SLAB_MACS = 2**35
# The least work (N x V x D multiply-adds of one GEMM) for which skipping ignored rows pays on a
# GPU: below it the host synchronisation costs more than the skipped rows save (on a CPU it
# costs nothing). Measured: bench/results/policy.md.
MIN_SKIP_MACS = 2**39
# The narrowest GEMM tile (classes) that fast mode's fused GEMM takes on a GPU
# (``implementations.triton_shared.fused_tile_config``, 256 or, where it falls back to lean's
# ``tile_config``, 128): its chunks hold a few float32 values per tile and row (``fast_row_bytes``).
FUSED_TILE_MIN_CLASSES = 128
# A vocabulary-parallel call's budget, in units of the single-device fraction of its share's
# logits: loss_parallel holds ~4.1x a shard's bf16 logits where compile holds ~1.9x the whole
# vocabulary's, so twice the fraction keeps the op near the same share of its baseline's memory,
# with half the chunks, each ~0.5 ms of fixed cost at 8k tokens (bench/results/distributed.md).
VOCAB_PARALLEL_BUDGET_SCALE = 2.0
# The rows a compiled graph with a symbolic row count plans its mode for (``decide.planned_rows``):
# enough that fast's chunks fit the fractional budget wherever they fit a large call (V >= ~6 D
# under AMP), as the graph also runs the large ones; but at most SYMBOLIC_PLAN_GROWTH times
# its example's rows, around which its calls mostly are (Dynamo makes a graph dynamic at its
# second size), so that small calls do not run fast's fixed buffers far over their budget.
SYMBOLIC_PLAN_ROWS = 1 << 16
SYMBOLIC_PLAN_GROWTH = 16
# The smallest budget: tiny problems (tests, the CPU demo's first steps) still get chunks of
# useful size.
MIN_BUDGET = 1 << 20


@dataclasses.dataclass(frozen=True)
class Problem:
    """What the policy needs to know about one call."""

    rows: int  # N loss rows (positions the kernels read: at least the rows)
    vocab: int  # V
    dim: int  # D
    logit_bytes: int  # bytes of one logit in the head's compute dtype (2 for bf16)
    # Autocast's rounding (AMP), of each operand apart (``rounding``): a rounded hidden is a
    # copy (N x D); a rounded classifier is copied a slab or a chunk at a time.
    rounds_hidden: bool = False
    rounds_classifier: bool = False
    device_type: str = "cuda"  # where it runs: the GPU's rules differ from the CPU path's
    # Bytes of a rounded classifier's element, and of its gradient: 4 for AMP's float32
    # weights, 2 for bf16 weights under float16 autocast; 4 where it is not rounded (it is then
    # in the logits' dtype): read through ``classifier_gradient_bytes``.
    rounded_classifier_bytes: int = 4

    @property
    def classifier_gradient_bytes(self) -> int:
        """Bytes of one element of the classifier's gradient (its dtype's)."""
        return self.rounded_classifier_bytes if self.rounds_classifier else self.logit_bytes


def problem(
    rows: int,
    classifier_shape,
    logit_dtype,
    device: str,
    *,
    compute_dtype,
    dtypes: tuple,
) -> Problem:
    """The one constructor of a ``Problem``: a call's loss rows (or the positions its kernels
    read), the (V, D) of its classifier, the ``torch.dtype`` of its logits (the GEMMs'), where
    it runs, autocast's compute dtype (None: none) and the (hidden, classifier) dtypes, which
    set what it rounds (``rounding``) and the classifier gradient's dtype."""
    vocab, dim = classifier_shape
    rounds = rounding(compute_dtype, *dtypes)
    rounded_bytes = dtypes[1].itemsize if rounds[1] else 4
    return Problem(rows, vocab, dim, logit_dtype.itemsize, *rounds, device, rounded_bytes)


def rounding(compute_dtype, hidden_dtype, classifier_dtype) -> tuple[bool, bool]:
    """(hidden, classifier): which of them a call rounds to ``compute_dtype`` (autocast's
    rounding; None: nothing is rounded). The one rule wherever a call is planned. A bias
    rounded alone (V values) counts for nothing; an operand already in the compute dtype is
    not copied."""
    if compute_dtype is None:
        return False, False
    return hidden_dtype != compute_dtype, classifier_dtype != compute_dtype


def budget_bytes(
    problem: Problem, budget_mb: int | None, fraction: float, vocab_parallel: bool = False
) -> int:
    """The extra memory the loss may use: an absolute budget, or a fraction of the logits
    (``vocab_parallel``: of a shard's, scaled by ``VOCAB_PARALLEL_BUDGET_SCALE``)."""
    if budget_mb is not None:
        return budget_mb * 2**20
    if vocab_parallel:
        fraction *= VOCAB_PARALLEL_BUDGET_SCALE
    return max(MIN_BUDGET, int(fraction * problem.rows * problem.vocab * problem.logit_bytes))


def rounded_hidden_bytes(problem: Problem) -> int:
    """The copy of hidden in the compute dtype that a call rounding hidden (AMP) makes."""
    return problem.rows * problem.dim * problem.logit_bytes if problem.rounds_hidden else 0


def narrow_head(problem: Problem) -> bool:
    """Is this a GPU call below ``MIN_FAST_DIM``?"""
    return problem.device_type == "cuda" and problem.dim < MIN_FAST_DIM


def cross_half_gradient(problem: Problem) -> bool:
    """Is the classifier's gradient, on a GPU, a 2-byte dtype other than the GEMMs' (bf16
    weights under float16 autocast)? cuBLAS writes no float16 product into bf16: each such
    product is a float32 one first, of the output's size."""
    two_bytes = problem.classifier_gradient_bytes == 2
    return problem.device_type == "cuda" and problem.rounds_classifier and two_bytes


def sums_classifier_in_float32(problem: Problem, needs_classifier: bool, fused: bool) -> bool:
    """Does a fast run sum a 2-byte classifier gradient in a float32 buffer of its own (V x D x
    4, rounded once at the end)? Below MIN_FAST_DIM on a GPU: there the 2-byte sum over the
    chunks had 1.35-1.58x compile's error (lean: compile's), and the buffer is small (2 D / N of
    the logits' size: at G 256 MiB, ~1/3 of the default budget). And for a cross-half
    gradient at any D: its chunks' products are float32 anyway (``cross_half_gradient``), so
    the buffer, counted, replaces an uncounted V x D temporary per chunk (550 MiB against a
    300 MiB budget on an H200 before 5bd9acd)."""
    if not needs_classifier:
        return False
    if cross_half_gradient(problem):
        return True
    two_bytes = problem.classifier_gradient_bytes < 4
    return narrow_head(problem) and fused and two_bytes


def fast_fixed_bytes(problem: Problem, needs_classifier: bool = True, fused: bool = False) -> int:
    """Fast mode's memory besides its chunk: under AMP, the rounded hidden; a float32 buffer for
    the classifier gradient where one sums it (``sums_classifier_in_float32``). The classifier's
    gradient is the op's output, not extra. The classifier's rounded copy (V x D, held through
    the forward op) is not counted, by choice: it is the copy autocast makes for ``F.linear``,
    but torch.compile does not hold it beside its logits (its AMP peak at E is below its bf16
    one), so under AMP fast mode takes more than the budget (0.45-0.73x of compile's extra
    memory at B and E, bench/results/loss_head.md) for less time than lean's (E, H100: 1.14x
    against 1.31x compile's)."""
    buffer = problem.vocab * problem.dim * 4
    summed = sums_classifier_in_float32(problem, needs_classifier, fused)
    return rounded_hidden_bytes(problem) + (buffer if summed else 0)


# The RowStats extras (implementations.interface.EXTRA_STATS) fast mode's chunks compute; a
# call asking for another row metric (log sum p^2, the mean logit) runs lean.
FAST_EXTRA_STATS = frozenset({"entropy", "argmax"})


def fast_needs_whole_rows(*, softcap: bool, entropy: bool, argmax: bool) -> bool:
    """Does a fast-mode chunk need its float32 logits, not only their scaled exponentials?
    For softcap's derivative, the entropy or the argmax. (A vocabulary shard's statistics come
    from the fused GEMM's partials as a single device's do.)"""
    return softcap or entropy or argmax


def fast_fuses_exp(problem: Problem, whole_rows: bool) -> bool:
    """Does a fast-mode chunk take its scaled exponentials from the logits GEMM's epilogue
    (kernels/logits_exp.py)? On a GPU, unless it needs whole rows (``fast_needs_whole_rows``),
    where its gradient is bf16 / fp16: a float32 one gains no bytes."""
    return problem.device_type == "cuda" and problem.logit_bytes == 2 and not whole_rows


def fast_row_bytes(problem: Problem, fused: bool = False) -> int:
    """A fast-mode chunk's bytes per row: its float32 logits and float32 hidden gradient; or,
    ``fused`` (``fast_fuses_exp``), its scaled exponentials in the compute dtype (rows padded to
    8 elements) and at most 3 float32 values per tile of ``FUSED_TILE_MIN_CLASSES`` classes
    (tile maxima, partial lse and weighted sums) instead of the float32 logits."""
    if fused:
        padded = -(-problem.vocab // 8) * 8
        tiles = -(-problem.vocab // FUSED_TILE_MIN_CLASSES)
        return padded * problem.logit_bytes + tiles * 3 * 4 + problem.dim * 4
    return (problem.vocab + problem.dim) * 4


def fast_chunk_rows(
    problem: Problem, budget: int, fused: bool = False, needs_classifier: bool = True
) -> int:
    """Rows per fast-mode chunk within the budget (0 if not even one row fits), at
    ``fast_row_bytes`` a row. Without a classifier gradient, and the classifier not rounded,
    within ``FROZEN_BUDGET_SHARE`` of what the fixed bytes leave, but never under the floor
    (``fast_floor_rows``) where the whole of it holds the floor: the share saves memory, it
    must not turn auto to lean's third GEMM."""
    left = budget - fast_fixed_bytes(problem, needs_classifier, fused)
    per_row = fast_row_bytes(problem, fused)
    rows = max(0, left // per_row)
    if not needs_classifier and not problem.rounds_classifier:
        share = int(left * FROZEN_BUDGET_SHARE) // per_row
        rows = max(share, min(rows, fast_floor_rows(problem, needs_classifier, fused)))
    return max(0, min(FAST_CHUNK_ROWS, problem.rows, rows))


def skipping_pays(device_type: str, rows: int, vocab: int, dim: int) -> bool:
    """Is skipping a call's ignored rows worth its host synchronisation (MIN_SKIP_MACS)?"""
    return device_type != "cuda" or rows * vocab * dim >= MIN_SKIP_MACS


def fast_floor_rows(problem: Problem, needs_classifier: bool, fused: bool = False) -> int:
    """The fewest rows per chunk for which auto prefers fast (module docstring): the classifier
    gradient's re-read per chunk scales with the element size of what sums it (float32 under
    AMP, or in ``sums_classifier_in_float32``'s buffer)."""
    if not needs_classifier:
        return MIN_FROZEN_FAST_ROWS
    in_float32 = sums_classifier_in_float32(problem, True, fused)
    gradient_bytes = 4 if in_float32 else problem.classifier_gradient_bytes
    return MIN_FAST_ROWS * gradient_bytes // 4


def narrow_head_keeps_lean(problem: Problem, fused: bool) -> bool:
    """Below MIN_FAST_DIM on a GPU: are fast's chunks slower than lean (whole float32 rows)?"""
    return narrow_head(problem) and not fused


def fast_fits(problem: Problem, needs_classifier: bool, budget: int, fused: bool = False) -> bool:
    """Does a fast-mode chunk that auto would accept fit the budget (module docstring), where
    a narrow head does not keep lean (``narrow_head_keeps_lean``)?"""
    if narrow_head_keeps_lean(problem, fused):
        return False
    chunk = fast_chunk_rows(problem, budget, fused, needs_classifier)
    floor = fast_floor_rows(problem, needs_classifier, fused)
    return chunk > 0 and chunk >= min(floor, problem.rows)


def fast_run_rows(
    problem: Problem, needs_classifier: bool, budget: int, fused: bool = False
) -> int:
    """Rows per chunk of a fast-mode run (whole float32 rows, or ``fused``: the GEMM's scaled
    exponentials): ``fast_chunk_rows``, and at least the floor auto accepts (at most
    FAST_CHUNK_ROWS and the rows).

    The floor, not the tuned FAST_CHUNK_ROWS, is also what a run gets where not even a row
    fits: auto chose on the whole call, and the run sees less budget (compaction's copy of
    the kept rows, which can exceed the budget: V = 32000, D = 8192, 8192 rows); and fast asked
    for over the budget. Either way the run keeps as close to the budget as a useful chunk
    allows, instead of taking ~the logits' size in 4096-row chunks."""
    chunk = max(
        fast_chunk_rows(problem, budget, fused, needs_classifier),
        fast_floor_rows(problem, needs_classifier, fused),
    )
    return min(chunk, FAST_CHUNK_ROWS, max(problem.rows, 1))


def lean_slab_columns(problem: Problem, needs_hidden: bool, budget: int) -> int:
    """Classes per lean backward slab within the budget (before rounding to whole tiles), at
    least ``MIN_SLAB_COLUMNS``: every slab re-reads and re-writes the float32 d-hidden
    accumulator (8 N D bytes), which at fewer classes costs more than the budget saves; and
    at least ``MIN_SLAB_MACS`` of work, or the host's launches outlast the GPU's work (small
    problems exceed the budget for both reasons)."""
    fixed = problem.rows * problem.dim * 4 if needs_hidden else 0
    per_class = problem.rows * problem.logit_bytes
    fixed += rounded_hidden_bytes(problem)
    if problem.rounds_classifier:
        per_class += problem.dim * problem.logit_bytes
    if cross_half_gradient(problem):  # the slab's gradient, a float32 product first
        per_class += problem.dim * 4
    launch_floor = -(-MIN_SLAB_MACS // max(1, problem.rows * problem.dim))
    return max(MIN_SLAB_COLUMNS, launch_floor, (budget - fixed) // max(1, per_class))


def forward_slab_columns(problem: Problem, budget: int) -> int:
    """Classes per lean forward launch: all of them, unless the classifier must be rounded
    (AMP), which happens one slab of classes at a time within the budget."""
    if not problem.rounds_classifier:
        return problem.vocab
    left = budget - rounded_hidden_bytes(problem)
    return max(0, left // (problem.dim * problem.logit_bytes))


def cpu_chunk_rows(vocab: int, budget: int) -> int:
    """Rows per chunk of the PyTorch path: three float32 temporaries per logit (y, z, grad)."""
    return max(1, budget // (vocab * 4 * 3))


# Fast mode computes the gradients in the forward, for a unit upstream gradient, and the backward
# scales them by the real one: a float16 gradient is rounded before that scale, so a sum later
# divided by the token count overflows (a float32 sum over 65504) and a loss scaler's small
# gradients flush to zero before its 2^16 could lift them (found by adversarial tests: 4f3e6ba).
# bf16 has float32's range. Lean mode computes them in the backward, with the upstream gradient, as
# PyTorch does.
FLOAT16_FAST = (
    "mode='fast' computes float16 gradients (of a float16 hidden, classifier or bias) before the "
    "upstream gradient scales them: they overflow or underflow under loss scaling or a "
    "normalised sum. Use mode='lean' (or 'auto', which picks it), or bf16."
)


@functools.cache
def _log_float16_once() -> None:
    """Tell once that a configured fast mode runs lean for float16 gradients."""
    log.warning("CCE_MODE=fast: %s Running those calls in lean mode.", FLOAT16_FAST)


def choose_mode(
    requested: str,
    *,
    reduction: str,
    needs_grad: bool,
    needs_classifier: bool,
    outputs_have_grad: bool,
    problem: Problem,
    budget: int,
    explicit: bool = False,
    whole_rows: bool = False,
    float16_gradients: bool = False,
) -> str:
    """The concrete mode ('lean' or 'fast') for one call.

    ``explicit`` marks a mode the caller passed as an argument: asking for 'fast' where it
    cannot apply is then an error rather than a quiet fall-back to 'lean'.
    ``outputs_have_grad``: an output besides the loss (the lse, the entropy) takes a gradient,
    which fast mode's buffers do not hold (its backward recomputes that part). ``whole_rows``:
    a fast run would need whole float32 rows (``fast_needs_whole_rows``).
    ``float16_gradients``: a gradient the call returns is float16 (``FLOAT16_FAST``).
    """
    if requested == "fast" and reduction == "none":
        if explicit:
            raise ValueError("mode='fast' needs reduction 'mean' or 'sum' (got 'none')")
        log.debug("mode 'fast' needs a scalar loss; using 'lean' for reduction='none'")
        return "lean"
    if requested == "fast" and float16_gradients:
        if explicit:
            raise ValueError(FLOAT16_FAST)
        _log_float16_once()
        return "lean"
    if requested in ("lean", "fast"):
        return requested
    if not needs_grad or reduction == "none" or outputs_have_grad or float16_gradients:
        return "lean"
    fused = fast_fuses_exp(problem, whole_rows)
    return "fast" if fast_fits(problem, needs_classifier, budget, fused) else "lean"
