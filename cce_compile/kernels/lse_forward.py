"""Lean forward: per-tile log-sum-exp of the logits, never storing them.

Each program computes TILES consecutive (BLOCK_N rows x BLOCK_V classes) tiles of
``hidden @ classifier.T`` in registers (float32 accumulation on the tensor cores, operands by
TMA where aligned), applies bias / scale / softcap, keeps a running max and sum of exp per row,
and writes the log-sum-exp of its classes into ``partial_lse[vocab_group, row]``. A tiny reduction
over vocab blocks (in the caller) gives the row's lse: no locks and no atomics, so the result
is deterministic. The program whose tile holds a row's target writes that target logit (one
writer per row). With label smoothing it also writes the tile's sum_j w_j z_ij; where asked, the
entropy of its classes' softmax, its largest logit and first class, and logsumexp_j 2 z_ij (the
row metrics' sources, row_metrics.py).

Bytes: hidden and classifier are read once per tile from L2 (grouped ordering keeps GROUP_N row
blocks' hidden and one classifier tile resident); output is 4 bytes per row per vocab block.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from .common import (
    TileConfig,
    capped_logits_tile,
    cdiv,
    check_operands,
    gemm_launch_options,
    grouped_tile,
    launch_grid,
    operand_args,
    row_layout,
    targets_can_equal,
    tile_rows,
)


@triton.jit
def _lse_forward_kernel(
    hidden,
    classifier,
    bias,
    class_weights,
    targets,
    partial_lse,
    partial_wsum,
    target_logit,
    partial_entropy,
    partial_max,
    partial_argmax,
    partial_lse_2z,
    n_positions,
    seq_stride,
    rows_per_seq,
    n_rows,
    vocab,
    dim,
    shift,
    ignore_index,
    col_start,
    logit_scale,
    softcap,
    stride_pos,
    stride_cv,
    stride_tb,
    stride_tt,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NEEDS_WSUM: tl.constexpr,
    NEEDS_ENTROPY: tl.constexpr,
    NEEDS_ARGMAX: tl.constexpr,
    NEEDS_LSE_2Z: tl.constexpr,
    SKIP_IGNORED: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
    TILES: tl.constexpr,
):
    pid_n, pid_v = grouped_tile(
        tl.program_id(0), n_positions, vocab, BLOCK_N, BLOCK_V * TILES, GROUP_N
    )
    first, pos_c, row, valid, t_off = tile_rows(
        pid_n, n_positions, seq_stride, rows_per_seq, shift, stride_tb, stride_tt, BLOCK_N
    )
    tgt = tl.load(targets + t_off, mask=valid, other=ignore_index)
    # Targets are class ids of the whole vocabulary; this launch sees classes
    # [col_start, col_start + vocab) as its columns [0, vocab).
    tgt_col = tgt - col_start
    out_off = pid_v.to(tl.int64) * n_rows + row
    if SKIP_IGNORED:
        if tl.max((tgt != ignore_index).to(tl.int32), axis=0) == 0:
            # Only ignored rows: their lse is never read, the tile costs nothing.
            tl.store(
                partial_lse + out_off, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=valid
            )
            if NEEDS_WSUM:
                tl.store(partial_wsum + out_off, tl.zeros((BLOCK_N,), tl.float32), mask=valid)
            if NEEDS_ENTROPY:
                tl.store(partial_entropy + out_off, tl.zeros((BLOCK_N,), tl.float32), mask=valid)
            if NEEDS_ARGMAX:
                tl.store(
                    partial_max + out_off,
                    tl.full((BLOCK_N,), float("-inf"), tl.float32),
                    mask=valid,
                )
                tl.store(partial_argmax + out_off, tl.zeros((BLOCK_N,), tl.int32), mask=valid)
            if NEEDS_LSE_2Z:
                tl.store(
                    partial_lse_2z + out_off,
                    tl.full((BLOCK_N,), float("-inf"), tl.float32),
                    mask=valid,
                )
            return

    # The program covers TILES vocab tiles with a running max / sum per row, so the partial
    # buffer holds one value per TILES * BLOCK_V classes.
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_N,), tl.float32)
    run_wsum = tl.zeros((BLOCK_N,), tl.float32)
    # sum_j exp(z_j - run_max) (z_j - run_max), the entropy's: relative to the max, so no term
    # is of the logits' size (sum_j p_j z_j's would cancel against the lse). Unnormalised.
    run_plogp = tl.zeros((BLOCK_N,), tl.float32)
    run_arg = tl.zeros((BLOCK_N,), tl.int32)  # first column of the running max
    run_sq = tl.zeros((BLOCK_N,), tl.float32)  # sum_j exp(2 (z_j - run_max))
    for j in range(TILES):
        first_col = (pid_v * TILES + j) * BLOCK_V
        if first_col < vocab:
            cols = first_col + tl.arange(0, BLOCK_V)
            col_ok = cols < vocab
            cols_c = tl.minimum(cols, vocab - 1)
            z = capped_logits_tile(
                hidden,
                classifier,
                bias,
                first,
                first_col,
                pos_c,
                cols_c,
                dim,
                stride_pos,
                stride_cv,
                logit_scale,
                softcap,
                HAS_BIAS,
                HAS_SOFTCAP,
                BLOCK_N,
                BLOCK_V,
                BLOCK_D,
                USE_TMA,
                UPCAST_DOT,
                DOT_PRECISION,
            )
            z = tl.where(col_ok[None, :], z, float("-inf"))
            tile_max = tl.max(z, axis=1)
            new_max = tl.maximum(run_max, tile_max)
            if NEEDS_ARGMAX:
                # Strictly greater: an earlier tile keeps a tie, as torch.argmax's first index.
                tile_arg = tl.argmax(z, axis=1, tie_break_left=True).to(tl.int32)
                tile_arg += first_col + col_start
                run_arg = tl.where(tile_max > run_max, tile_arg, run_arg)
            # NaN logits make the sum NaN, so NaN propagates to the lse as in PyTorch. A row
            # that has seen only -inf (a program whose classes a -inf bias masks out) exponentiates
            # against 0, not -inf: exp(-inf - 0) = 0 where exp(-inf - -inf) would be NaN, and its
            # partial lse is -inf, as torch.logsumexp's. (A per-row guard: nothing per logit.)
            offset = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(run_max - offset)
            exp_z = tl.exp(z - offset[:, None])
            if NEEDS_ENTROPY:  # p (z - m) -> 0 as z -> -inf; a move of the max m by d <= 0
                # turns the old sum into rescale * (sum + d * run_sum) (0 while run_sum is 0)
                moved = tl.where(run_sum == 0.0, 0.0, run_max - offset)
                weighted = tl.where(z == float("-inf"), 0.0, exp_z * (z - offset[:, None]))
                run_plogp = (run_plogp + moved * run_sum) * rescale + tl.sum(weighted, axis=1)
            run_sum = run_sum * rescale + tl.sum(exp_z, axis=1)
            if NEEDS_LSE_2Z:  # exp(2 (z - m)) = exp(z - m)^2: no second exponential
                run_sq = run_sq * (rescale * rescale) + tl.sum(exp_z * exp_z, axis=1)
            run_max = new_max
            # The tile holds the row's target iff it falls in [first_col, first_col + BLOCK_V):
            # a per-row test, not a reduction over the tile, keeps the epilogue's registers
            # down.
            has_target = (
                (tgt_col >= first_col) & (tgt_col < first_col + BLOCK_V) & (tgt_col < vocab)
            )
            target_z = tl.sum(tl.where(cols[None, :] == tgt_col[:, None], z, 0.0), axis=1)
            tl.store(target_logit + row, target_z, mask=valid & has_target)
            if NEEDS_WSUM:
                if HAS_WEIGHTS:
                    w = tl.load(class_weights + cols_c).to(tl.float32)
                else:
                    w = tl.full((BLOCK_V,), 1.0, tl.float32)
                run_wsum += tl.sum(tl.where(col_ok[None, :], w[None, :] * z, 0.0), axis=1)
    tl.store(partial_lse + out_off, run_max + tl.log(run_sum), mask=valid)
    if NEEDS_WSUM:
        tl.store(partial_wsum + out_off, run_wsum, mask=valid)
    if NEEDS_ENTROPY:  # the entropy of this program's classes' softmax (NaN if no mass)
        tl.store(partial_entropy + out_off, tl.log(run_sum) - run_plogp / run_sum, mask=valid)
    if NEEDS_ARGMAX:
        tl.store(partial_max + out_off, run_max, mask=valid)
        tl.store(partial_argmax + out_off, run_arg, mask=valid)
    if NEEDS_LSE_2Z:
        tl.store(partial_lse_2z + out_off, 2.0 * run_max + tl.log(run_sq), mask=valid)


def partial_blocks(vocab: int, config: TileConfig) -> int:
    """Rows of the partial buffers for ``vocab`` classes: one per program's vocab group."""
    return cdiv(vocab, config.block_v * config.tiles_per_program)


def lse_forward(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    *,
    shift: int,
    ignore_index: int,
    logit_scale: float,
    softcap: float,
    skip_ignored_tiles: bool,
    needs_wsum: bool,
    config: TileConfig | None = None,
    col_start: int = 0,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    entropy_out: torch.Tensor | None = None,
    argmax_out: tuple[torch.Tensor, torch.Tensor] | None = None,
    lse_2z_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Partial lse (vocab_blocks, N), target logit (N,) and partial sum_j w_j z_ij or None.

    ``entropy_out`` (vocab_blocks, N) float32: also the entropy of each program's classes'
    softmax, to combine with ``partial_lse`` (``row_metrics.mixture_entropy``; 0 where a tile
    was skipped, NaN where its classes have no mass: their partial lse is -inf).
    ``argmax_out`` ((vocab_blocks, N) float32, (vocab_blocks, N) int32): also each program's
    largest logit and its first class (a column of the whole vocabulary).
    ``lse_2z_out`` (vocab_blocks, N) float32: also each program's logsumexp_j 2 z_ij.

    ``hidden`` (B, T, D) and ``targets`` (B, T) may be strided; rows are (b, t < T - shift).
    ``classifier`` (and ``bias``, ``class_weights``) hold classes [col_start, col_start + V)
    of the vocabulary that ``targets`` index. Target logits of rows whose target is not among
    them (ignored, out of range, another slab) are not written: they stay as ``out`` has them
    (zeros when the launcher allocates). ``out``: buffers to write into instead, so a caller
    that launches slab by slab fills one set (partials of blocks_v rows each).
    """
    config = config or TileConfig()
    bias, class_weights, classifier = check_operands(
        hidden, classifier, targets, bias, class_weights, shift
    )
    vocab = classifier.shape[0]
    layout = row_layout(hidden, shift)
    shape = (partial_blocks(vocab, config), layout.n_rows)
    outputs = _outputs(out, shape, needs_wsum, hidden.device, entropy_out, argmax_out, lse_2z_out)
    if layout.n_rows and vocab:
        # An ignore_index that no target can equal ignores no row (loss_math.valid_rows): no
        # tile may be skipped then, whatever the kernel's comparison of targets with it gives.
        skip = skip_ignored_tiles and targets_can_equal(targets, ignore_index)
        _launch(
            layout,
            classifier,
            targets,
            bias,
            class_weights,
            outputs,
            config,
            shift=shift,
            ignore_index=ignore_index,
            col_start=col_start,
            logit_scale=logit_scale,
            softcap=softcap,
            skip_ignored_tiles=skip,
            needs_wsum=needs_wsum,
            hidden=hidden,
        )
    return outputs.partial_lse, outputs.target_logit, outputs.partial_wsum


@dataclasses.dataclass(frozen=True)
class _Outputs:
    """What one launch writes, each (vocab_blocks, N) float32 but ``target_logit`` (N,) and
    ``argmax`` int32; None: not asked for."""

    partial_lse: torch.Tensor
    target_logit: torch.Tensor
    partial_wsum: torch.Tensor | None
    entropy: torch.Tensor | None
    max: torch.Tensor | None
    argmax: torch.Tensor | None
    lse_2z: torch.Tensor | None

    def pointers(self) -> tuple[torch.Tensor, ...]:
        """The kernel's output arguments in its order. partial_lse stands in for an absent one:
        the kernel's flags (NEEDS_WSUM, NEEDS_ENTROPY, ...) keep it from touching that one."""

        def given(t: torch.Tensor | None) -> torch.Tensor:
            return self.partial_lse if t is None else t

        return (
            self.partial_lse,
            given(self.partial_wsum),
            self.target_logit,
            given(self.entropy),
            given(self.max),
            given(self.argmax),
            given(self.lse_2z),
        )


def _outputs(out, shape, needs_wsum, device, entropy_out, argmax_out, lse_2z_out) -> _Outputs:
    """``out``'s buffers (checked) or new ones, and the row metrics' (checked): each
    contiguous, of ``shape`` (vocab_blocks, N) but the target logits (N,)."""
    n_rows = shape[1]
    if out is None:
        partial_lse = torch.empty(shape, dtype=torch.float32, device=device)
        partial_wsum = (
            torch.empty(shape, dtype=torch.float32, device=device) if needs_wsum else None
        )
        target_logit = torch.zeros(n_rows, dtype=torch.float32, device=device)
    else:
        partial_lse, target_logit, partial_wsum = out
        for name, t, want in (
            ("partial_lse", partial_lse, shape),
            ("target_logit", target_logit, (n_rows,)),
            ("partial_wsum", partial_wsum, shape if needs_wsum else None),
        ):
            if want is not None and (t is None or tuple(t.shape) != want or not t.is_contiguous()):
                raise ValueError(f"out {name} must be contiguous float32 {want}")
    row_max, row_argmax = (None, None) if argmax_out is None else argmax_out
    for name, t, dtype in (
        ("entropy_out", entropy_out, torch.float32),
        ("argmax_out max", row_max, torch.float32),
        ("argmax_out index", row_argmax, torch.int32),
        ("lse_2z_out", lse_2z_out, torch.float32),
    ):
        if t is not None and (tuple(t.shape) != shape or t.dtype != dtype or not t.is_contiguous()):
            raise ValueError(f"{name} must be contiguous {dtype} {shape}")
    return _Outputs(
        partial_lse, target_logit, partial_wsum, entropy_out, row_max, row_argmax, lse_2z_out
    )


def _launch(
    layout,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    outputs: _Outputs,
    config: TileConfig,
    *,
    shift: int,
    ignore_index: int,
    col_start: int,
    logit_scale: float,
    softcap: float,
    skip_ignored_tiles: bool,
    needs_wsum: bool,
    hidden: torch.Tensor,
) -> None:
    """``_lse_forward_kernel`` on every tile of rows x classes (at least one of each), its
    flags derived from which operands and outputs are given; ``lse_forward``'s arguments."""
    vocab, dim = classifier.shape
    hidden_arg, classifier_arg, use_tma = operand_args(layout, classifier, config)
    grid = launch_grid(layout.n_positions, vocab, config, config.tiles_per_program)
    _lse_forward_kernel[grid](
        hidden_arg,
        classifier_arg,
        bias if bias is not None else classifier,
        class_weights if class_weights is not None else classifier,
        targets,
        *outputs.pointers(),
        layout.n_positions,
        layout.seq_stride,
        layout.rows_per_seq,
        layout.n_rows,
        vocab,
        dim,
        shift,
        ignore_index,
        col_start,
        float(logit_scale),
        float(softcap) if softcap else 1.0,
        layout.stride_pos,
        classifier.stride(0),
        *targets.stride(),
        HAS_WEIGHTS=class_weights is not None,
        NEEDS_WSUM=needs_wsum,
        NEEDS_ENTROPY=outputs.entropy is not None,
        NEEDS_ARGMAX=outputs.argmax is not None,
        NEEDS_LSE_2Z=outputs.lse_2z is not None,
        SKIP_IGNORED=skip_ignored_tiles,
        TILES=config.tiles_per_program,
        **gemm_launch_options(
            config, hidden, use_tma=use_tma, has_bias=bias is not None, softcap=softcap
        ),
    )
