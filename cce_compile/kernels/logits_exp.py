"""Fast mode, pass 1 fused into the logits GEMM: a chunk's scaled exponentials, no float32 logits.

A persistent program walks (BLOCK_N rows x BLOCK_V classes) tiles of ``h @ classifier.T``,
each computed in registers (float32 accumulation, operands by TMA where aligned), and per tile
writes

    e = exp(z - m_t),  z = logit_scale * (y + b),  m_t = the tile's largest z per row,

rounded once to the chunk's gradient buffer (n x V, the compute dtype; by TMA where its rows
are 16-byte aligned), with m_t into ``block_max`` and m_t + log(sum e) into ``partial_lse``
(both n x tiles, float32). The tile that holds a row's target writes that float32 target
logit; with label smoothing each tile writes its sum_j w_j z_j (``partial_wsum``).
``scaled_exp_grad`` then reduces the partials to the rows' lse and turns e into the gradient.

So a logit costs the GEMM's write of two bytes, and a chunk is one launch. Accuracy: e is
rounded once (relative 2^-8 at worst), and the target's entry is recomputed in pass 2 from its
float32 logit.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import (
    TileConfig,
    capped_logits_tile,
    cdiv,
    gemm_launch_options,
    grouped_tile,
    launch_grid,
    operands_tma_ok,
    tma_ok,
)


@triton.jit
def _logits_exp_kernel(
    hidden,
    classifier,
    bias,
    class_weights,
    targets,
    exps,
    block_max,
    partial_lse,
    partial_wsum,
    target_logit,
    row_limit,
    n_rows,
    vocab,
    dim,
    stride_pos,
    stride_cv,
    stride_exps,
    stride_tiles,
    logit_scale,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NEEDS_WSUM: tl.constexpr,
    HAS_ROW_LIMIT: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    # Persistent, one program per SM walking tiles num_programs apart, the loop flattened so
    # that the compiler pipelines the next tile's loads under this tile's epilogue: faster than
    # a program per tile (bench/results/tune_fused.md). A data-dependent branch in the body
    # (skipping the target select on tiles without a target) does not compile flattened on
    # Triton 3.6.
    if HAS_ROW_LIMIT:  # rows known on the device only: the loop's bound comes from memory
        n_rows = tl.minimum(n_rows, tl.load(row_limit).to(tl.int32))
    num_tiles = tl.cdiv(n_rows, BLOCK_N) * tl.cdiv(vocab, BLOCK_V)
    for tile in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
        pid_n, pid_v = grouped_tile(tile, n_rows, vocab, BLOCK_N, BLOCK_V, GROUP_N)
        first = pid_n * BLOCK_N
        first_col = pid_v * BLOCK_V
        rows = first + tl.arange(0, BLOCK_N)
        valid = rows < n_rows
        rows_c = tl.minimum(rows, n_rows - 1)
        cols = first_col + tl.arange(0, BLOCK_V)
        col_ok = cols < vocab
        cols_c = tl.minimum(cols, vocab - 1)
        z = capped_logits_tile(
            hidden,
            classifier,
            bias,
            first,
            first_col,
            rows_c,
            cols_c,
            dim,
            stride_pos,
            stride_cv,
            logit_scale,
            1.0,
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
        # A row whose tile is all -inf (a -inf bias) stores m_t = 0, e = 0 and a partial lse
        # of log(0) = -inf; NaN logits (which the max skips) give NaN e and a NaN partial, as
        # PyTorch's loss is NaN.
        offset = tl.where(tile_max == float("-inf"), 0.0, tile_max)
        e = tl.exp(z - offset[:, None])
        if USE_TMA:  # the copy engine clips the tile's rows and columns past the ends
            exps.store([first, first_col], e.to(exps.dtype))
        else:
            row64 = rows_c.to(tl.int64)
            e_ptrs = exps + row64[:, None] * stride_exps + cols[None, :]
            tl.store(e_ptrs, e.to(exps.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])
        tile_off = rows_c.to(tl.int64) * stride_tiles + pid_v
        tl.store(block_max + tile_off, offset, mask=valid)
        tl.store(partial_lse + tile_off, offset + tl.log(tl.sum(e, axis=1)), mask=valid)
        tgt = tl.load(targets + rows_c)
        has_target = valid & (tgt >= first_col) & (tgt < first_col + BLOCK_V)
        target_z = tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        tl.store(target_logit + rows_c, target_z, mask=has_target)
        if NEEDS_WSUM:
            if HAS_WEIGHTS:
                w = tl.load(class_weights + cols_c).to(tl.float32)
            else:
                w = tl.full((BLOCK_V,), 1.0, tl.float32)
            wz = tl.sum(tl.where(col_ok[None, :], w[None, :] * z, 0.0), axis=1)
            tl.store(partial_wsum + tile_off, wz, mask=valid)


def exp_blocks(vocab: int, config: TileConfig) -> int:
    """Columns of ``block_max`` and the partial buffers for ``vocab`` classes: one per tile."""
    return cdiv(vocab, config.block_v)


def _persistent_programs(device: torch.device) -> int:
    """One program per SM (a handful in the interpreter, so tests walk several tiles each)."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:
    # Cached: the device query costs ~40 us of host time a launch, on the path to a chunk's
    # first GEMM while the GPU waits.
    return torch.cuda.get_device_properties(index).multi_processor_count


def _check_row_buffer(name: str, t: torch.Tensor | None, shape: tuple) -> None:
    if t is not None and (tuple(t.shape) != shape or t.dtype != torch.float32 or t.stride(-1) != 1):
        raise ValueError(f"{name} must be float32 {shape} with a unit last stride")


def _check_head(h: torch.Tensor, classifier: torch.Tensor, bias, class_weights) -> None:
    """The operands every chunk of a call shares: the classifier, bias and class weights."""
    dim = h.shape[1]
    vocab = classifier.shape[0]
    if classifier.shape != (vocab, dim) or classifier.dtype != h.dtype:
        raise ValueError(f"classifier must be {h.dtype} ({vocab}, {dim}) like h")
    if h.stride(1) != 1 or classifier.stride(1) != 1:
        raise ValueError("h and classifier need unit column strides")
    for name, vector in (("bias", bias), ("class_weights", class_weights)):
        if vector is not None and vector.shape != (vocab,):
            raise ValueError(f"{name} must be ({vocab},)")


def _check_rows(n_rows: int, targets: torch.Tensor, target_logit: torch.Tensor) -> None:
    """The per-row vectors, indexed by the row alone in the kernel: contiguous."""
    if targets.shape != (n_rows,) or targets.dtype != torch.int64 or not targets.is_contiguous():
        raise ValueError(f"targets must be contiguous int64 ({n_rows},)")
    if not target_logit.is_contiguous():
        raise ValueError("target_logit must be contiguous")
    _check_row_buffer("target_logit", target_logit, (n_rows,))


def _check_buffers(buffers: tuple, vocab: int, tiles: int) -> None:
    """(exps, block_max, partial_lse, partial_wsum or None) of one row count."""
    exps, block_max, partial_lse, partial_wsum = buffers
    rows = exps.shape[0]
    if exps.shape != (rows, vocab) or exps.stride(1) != 1:
        raise ValueError(f"exps must be ({rows}, {vocab}) with a unit column stride")
    for name, t in (("block_max", block_max), ("partial_lse", partial_lse)):
        _check_row_buffer(name, t, (rows, tiles))
    _check_row_buffer("partial_wsum", partial_wsum, (rows, tiles))
    strides = {t.stride(0) for t in (block_max, partial_lse, partial_wsum) if t is not None}
    if len(strides) != 1:
        raise ValueError("block_max, partial_lse and partial_wsum need one row stride")


class LogitsExpLaunch:
    """``logits_exp`` over the chunks of one call: the operands checked, and what every chunk
    shares (the classifier's descriptor, contiguous bias and class weights, strides, launch
    options) built, once. Fast mode launches it once a chunk; rebuilding all of it per launch
    was ~67 us of host time a launch at shape C, where the GPU waits for the host (issue 41).

    ``positions`` (n, D), ``targets`` and ``target_logit`` (n,): the call's rows, of which a
    chunk takes [start, stop). ``buffers`` = (exps, block_max, partial_lse, partial_wsum or
    None) as ``logits_exp`` takes them, for any chunk's rows from their first row on (at least
    the longest chunk's). The other arguments are ``logits_exp``'s."""

    def __init__(
        self,
        positions: torch.Tensor,
        classifier: torch.Tensor,
        targets: torch.Tensor,
        target_logit: torch.Tensor,
        buffers: tuple,
        *,
        logit_scale: float,
        bias: torch.Tensor | None = None,
        class_weights: torch.Tensor | None = None,
        config: TileConfig,
        programs: int | None = None,
    ):
        n_rows, dim = positions.shape
        vocab = classifier.shape[0]
        _check_head(positions, classifier, bias, class_weights)
        _check_rows(n_rows, targets, target_logit)
        _check_buffers(buffers, vocab, exp_blocks(vocab, config))
        exps, block_max, partial_lse, partial_wsum = buffers
        self.positions, self.classifier, self.config = positions, classifier, config
        self.targets, self.target_logit, self.buffers = targets, target_logit, buffers
        self.n_rows, self.rows, self.vocab, self.dim = n_rows, exps.shape[0], vocab, dim
        self.programs = programs or _persistent_programs(positions.device)
        self.bias = bias.contiguous() if bias is not None else classifier
        self.class_weights = class_weights.contiguous() if class_weights is not None else classifier
        self.strides = (positions.stride(0), classifier.stride(0), exps.stride(0))
        self.tile_stride = block_max.stride(0)
        self.logit_scale = float(logit_scale)
        # Whether the operands allow TMA does not depend on the chunk: a chunk starts a whole
        # number of 16-byte rows after the positions' first (tma_ok checks the row stride).
        self.use_tma = operands_tma_ok(positions, positions.stride(0), classifier) and tma_ok(
            exps, exps.stride(0)
        )
        self.flags = dict(
            HAS_WEIGHTS=class_weights is not None,
            NEEDS_WSUM=partial_wsum is not None,
            **gemm_launch_options(
                config, positions, use_tma=self.use_tma, has_bias=bias is not None, softcap=0.0
            ),
        )
        self._classifier_desc = None
        self._chunk_buffers: dict[int, tuple] = {}  # by row count: at most two a call

    def launch(self, start: int, stop: int, row_limit: torch.Tensor | None = None) -> None:
        """The chunk of rows [start, stop), written to the buffers' first stop - start rows;
        ``row_limit``: as ``logits_exp``'s (the rows before it alone are computed)."""
        n = stop - start
        if not 0 <= start <= stop <= self.n_rows or n > self.rows:
            raise ValueError(f"chunk [{start}, {stop}) outside {self.n_rows} rows or its buffers")
        if row_limit is not None and (
            row_limit.numel() != 1
            or row_limit.dtype != torch.int64
            or row_limit.device != self.positions.device
        ):
            raise ValueError(f"row_limit must be one int64 on {self.positions.device}")
        if n == 0 or self.vocab == 0:
            return
        h, targets = self.positions[start:stop], self.targets[start:stop]
        exps_arg, block_max, partial_lse, partial_wsum = self._buffers(n)
        hidden_arg, classifier_arg = h, self.classifier
        if self.use_tma:
            config = self.config
            hidden_arg = TensorDescriptor(
                h, [n, self.dim], [self.strides[0], 1], [config.block_n, config.block_d]
            )
            classifier_arg = self._classifier_descriptor()
        tile_count = launch_grid(n, self.vocab, self.config)[0]
        _logits_exp_kernel[(min(tile_count, self.programs),)](
            hidden_arg,
            classifier_arg,
            self.bias,
            self.class_weights,
            targets,
            exps_arg,
            block_max,
            partial_lse,
            partial_wsum if partial_wsum is not None else partial_lse,
            self.target_logit[start:stop],
            row_limit if row_limit is not None else targets,
            n,
            self.vocab,
            self.dim,
            *self.strides,
            self.tile_stride,
            self.logit_scale,
            HAS_ROW_LIMIT=row_limit is not None,
            **self.flags,
        )

    def _buffers(self, n: int) -> tuple:
        """The buffers' first ``n`` rows (exps as its descriptor where stored by TMA)."""
        parts = self._chunk_buffers.get(n)
        if parts is None:
            exps, *partials = (None if t is None else t[:n] for t in self.buffers)
            if self.use_tma:
                block = [self.config.block_n, self.config.block_v]
                exps = TensorDescriptor(exps, [n, self.vocab], [exps.stride(0), 1], block)
            parts = self._chunk_buffers[n] = (exps, *partials)
        return parts

    def _classifier_descriptor(self) -> TensorDescriptor:
        if self._classifier_desc is None:  # (built at the first launch with rows and classes)
            block = [self.config.block_v, self.config.block_d]
            self._classifier_desc = TensorDescriptor(
                self.classifier, [self.vocab, self.dim], [self.strides[1], 1], block
            )
        return self._classifier_desc


def logits_exp(
    h: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    exps: torch.Tensor,
    block_max: torch.Tensor,
    partial_lse: torch.Tensor,
    target_logit: torch.Tensor,
    partial_wsum: torch.Tensor | None = None,
    *,
    logit_scale: float,
    bias: torch.Tensor | None = None,
    class_weights: torch.Tensor | None = None,
    config: TileConfig,
    programs: int | None = None,
    row_limit: torch.Tensor | None = None,
) -> None:
    """Pass 1 of a chunk of n rows, fused into its logits GEMM.

    ``h`` (n, D) and ``classifier`` (V, D), one dtype, unit column strides. ``targets`` (n,)
    int64 contiguous, each row's target class in [0, V) (a row without a loss may take any).
    Writes ``exps`` (n, V), any float dtype with a unit column stride; ``block_max`` (n,
    ``exp_blocks``) float32; ``partial_lse`` and, with label smoothing, ``partial_wsum`` (n,
    ``exp_blocks``) float32; ``target_logit`` (n,) float32 contiguous. (``exps`` rows 16-byte
    aligned take the copy engine's tile store: pad its row stride to a multiple of 8.) ``bias`` and
    ``class_weights``: (V,). ``programs``: persistent programs (default: one per SM).
    ``row_limit``: a one-element int64 tensor on h's device, read by the kernel: only the rows
    before it are computed, for a count that has not reached the host (compaction's
    kept-first rows). The per-row outputs of the rest are left as they were, and so are their
    ``exps`` rows past the row tile the count ends in (a tile is stored whole)."""
    n_rows = h.shape[0]
    if exps.shape[0] != n_rows:
        raise ValueError(f"exps must have h's {n_rows} rows")
    LogitsExpLaunch(
        h,
        classifier,
        targets,
        target_logit,
        (exps, block_max, partial_lse, partial_wsum),
        logit_scale=logit_scale,
        bias=bias,
        class_weights=class_weights,
        config=config,
        programs=programs,
    ).launch(0, n_rows, row_limit)
