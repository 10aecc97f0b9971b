"""Lean backward: recompute a vocabulary slab of logits and write their gradient.

For a slab of the classifier (``width`` classes, the vocabulary's classes [v0, v0 + width)
where v0 is ``target_offset``) each program recomputes one (BLOCK_N x BLOCK_V) tile of logits
exactly as the forward did, and writes

    d loss / d y = ((coef_p + coef_e * log p) * p - coef_t * onehot - coef_w * w) * dz/dy

into ``slab`` (N x width, the inputs' dtype) — the slab is the only N x V-sized memory, and the
caller bounds its width. The per-row coefficients come from ``loss_math.row_coefficients``.
Two GEMMs on cuBLAS then turn the slab into d hidden (accumulated) and d classifier (written
once per slab). Tiles whose rows all have zero coefficients (ignored rows) skip the GEMM and
write zeros. (p: the softmax; coef_e: an entropy gradient's term, loss_math.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..loss_math import LOG_P_FLOOR
from .common import (
    TileConfig,
    capped_logits_tile,
    check_operands,
    gemm_launch_options,
    grouped_tile,
    launch_grid,
    operand_args,
    row_layout,
    tile_rows,
    tma_ok,
)


@triton.jit
def _logit_grad_kernel(
    hidden,
    classifier,
    bias,
    class_weights,
    targets,
    lse,
    coef_p,
    coef_t,
    coef_w,
    coef_e,
    keep,
    slab,
    n_positions,
    seq_stride,
    rows_per_seq,
    width,
    dim,
    shift,
    target_offset,
    logit_scale,
    softcap,
    stride_pos,
    stride_cv,
    stride_tb,
    stride_tt,
    stride_sn,
    n_blocks,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    LOG_P_FLOOR: tl.constexpr,
    HAS_FILTER: tl.constexpr,
    FILTER_BLOCK: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP_N: tl.constexpr,
):
    pid_n, pid_v = grouped_tile(tl.program_id(0), n_positions, width, BLOCK_N, BLOCK_V, GROUP_N)
    first, pos_c, _, _, t_off = tile_rows(
        pid_n, n_positions, seq_stride, rows_per_seq, shift, stride_tb, stride_tt, BLOCK_N
    )
    pos = first + tl.arange(0, BLOCK_N)
    in_range = pos < n_positions
    first_col = pid_v * BLOCK_V
    cols = first_col + tl.arange(0, BLOCK_V)
    col_ok = cols < width

    # Per-position coefficients: 0 at positions that are no loss row (past T - shift).
    c_p = tl.load(coef_p + pos_c)
    c_t = tl.load(coef_t + pos_c)
    c_w = tl.load(coef_w + pos_c)
    # NaN coefficients (out-of-range targets) count as active and poison their row.
    active = in_range & ((c_p != 0.0) | (c_t != 0.0) | (c_w != 0.0))
    if HAS_ENTROPY:
        c_e = tl.load(coef_e + pos_c)
        active = active | (in_range & (c_e != 0.0))
    cols_c = tl.minimum(cols, width - 1)
    if HAS_FILTER:
        # Gradient filtering (filtering.py): rows that skip this tile's block of classes drop
        # its softmax term; a tile no active row keeps needs no recompute. The tile lies in
        # one block: slabs start on block boundaries and FILTER_BLOCK % BLOCK_V == 0.
        block = (target_offset + first_col) // FILTER_BLOCK
        kept = tl.load(keep + pos_c.to(tl.int64) * n_blocks + block) != 0
        computed = active & kept
    else:
        computed = active
    if tl.max(computed.to(tl.int32), axis=0) == 0:
        grad = tl.zeros((BLOCK_N, BLOCK_V), tl.float32)
        if HAS_FILTER and HAS_SMOOTHING:  # the uniform term is exact without the logits
            if HAS_WEIGHTS:
                w = tl.load(class_weights + cols_c).to(tl.float32)
                grad -= c_w[:, None] * w[None, :]
            else:
                grad -= c_w[:, None]
            grad = tl.where(active[:, None], grad * logit_scale, 0.0)
    else:
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
        # A skipped row's softmax term goes through its coefficient, not a select on the
        # product: the exact kernel's multiply-subtract then compiles to the same FMAs, and
        # grad_filter=0 stays bit for bit the exact result.
        row_coef = tl.where(kept, c_p, 0.0) if HAS_FILTER else c_p
        log_p = z - tl.load(lse + pos_c)[:, None]
        if HAS_ENTROPY:  # the entropy's term, (coef_p + coef_e * log p) * p; log p clamped
            # (loss_math.LOG_P_FLOOR): at a -inf logit 0 * -inf would be NaN
            row_e = tl.where(kept, c_e, 0.0) if HAS_FILTER else c_e
            factor = row_coef[:, None] + row_e[:, None] * tl.maximum(log_p, LOG_P_FLOOR)
            grad = factor * tl.exp(log_p)
        else:
            grad = row_coef[:, None] * tl.exp(log_p)
        tgt = tl.load(targets + t_off) - target_offset  # as a column of this slab
        grad -= tl.where(cols[None, :] == tgt[:, None], c_t[:, None], 0.0)
        if HAS_SMOOTHING:
            if HAS_WEIGHTS:
                w = tl.load(class_weights + cols_c).to(tl.float32)
                grad -= c_w[:, None] * w[None, :]
            else:
                grad -= c_w[:, None]
        if HAS_SOFTCAP:
            u = z / softcap
            grad = grad * (1.0 - u * u)
        grad = grad * logit_scale
        # where(), not a product: an ignored row's placeholder lse may overflow exp().
        grad = tl.where(active[:, None], grad, 0.0)
    if USE_TMA:
        # Out-of-bounds rows and columns of the tile are clipped by the copy engine.
        slab.store([first, first_col], grad.to(slab.dtype))
    else:
        # Pointers built after the main loop, so they hold no registers during it.
        out_ptrs = slab + pos.to(tl.int64)[:, None] * stride_sn + cols[None, :]
        tl.store(out_ptrs, grad.to(slab.dtype.element_ty), mask=in_range[:, None] & col_ok[None, :])


class LogitGradLaunch:
    """``logit_grad`` over the vocabulary slabs of one call: what every slab shares (the row
    layout, the checked per-position vectors and mask, hidden's descriptor, the slab buffer's
    views) built once. Lean's backward launches it once a slab (8 at shape C), where the GPU
    waits for the host (issue 41).

    ``slab_buffer`` (n_positions, at least the widest slab's width), unit column stride: each
    slab's gradient is written to its first columns. The other arguments are ``logit_grad``'s,
    less the slab's own (classifier rows, bias, class weights, first class: ``launch``)."""

    def __init__(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        lse: torch.Tensor,
        coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        slab_buffer: torch.Tensor,
        *,
        shift: int,
        logit_scale: float,
        softcap: float,
        smoothing: bool,
        config: TileConfig | None = None,
        keep: torch.Tensor | None = None,
        filter_block: int = 256,
        entropy_coef: torch.Tensor | None = None,
    ):
        self.config = config = config or TileConfig()
        self.layout = layout = row_layout(hidden, shift)
        n_positions = layout.n_positions
        if slab_buffer.dim() != 2 or slab_buffer.shape[0] != n_positions:
            raise ValueError(f"slab must be ({n_positions}, width) with unit column stride")
        if slab_buffer.stride(1) != 1:
            raise ValueError(f"slab must be ({n_positions}, width) with unit column stride")
        _check_vectors(n_positions, (lse, *coefs, entropy_coef))
        if keep is not None:
            if keep.dtype != torch.uint8 or keep.dim() != 2 or keep.shape[0] != n_positions:
                raise ValueError(f"keep must be uint8 ({n_positions}, blocks)")
            if filter_block % config.block_v:
                raise ValueError("filtered slabs start on a block and tiles divide the block")
            keep = keep.contiguous()
        self.hidden, self.targets, self.slab_buffer = hidden, targets, slab_buffer
        self.shift, self.filter_block = shift, filter_block
        self.vectors = (
            lse,
            *coefs,
            entropy_coef if entropy_coef is not None else lse,
            keep if keep is not None else lse,
        )
        self.scalars = (float(logit_scale), float(softcap) if softcap else 1.0)
        self.softcap = softcap
        self.flags = dict(
            HAS_SMOOTHING=smoothing,
            HAS_ENTROPY=entropy_coef is not None,
            LOG_P_FLOOR=LOG_P_FLOOR,
            HAS_FILTER=keep is not None,
            FILTER_BLOCK=filter_block,
        )
        self.keep_blocks = keep.shape[1] if keep is not None else 1
        self.filtered = keep is not None
        # Whether the slab's store takes TMA: the same for every slab (their views share the
        # buffer's first element and row stride); the operands' loads: per slab (operand_args).
        self.slab_tma = tma_ok(slab_buffer, slab_buffer.stride(0))
        self._slabs: dict[int, tuple] = {}  # width: (view, its descriptor or None)
        self._options: dict[tuple, dict] = {}  # (use_tma, has_bias): gemm_launch_options

    def launch(
        self,
        classifier: torch.Tensor,
        bias: torch.Tensor | None,
        class_weights: torch.Tensor | None,
        *,
        target_offset: int,
    ) -> torch.Tensor:
        """The slab of ``classifier``'s classes (the vocabulary's from ``target_offset``):
        its gradient in the buffer's first columns, which it returns."""
        bias, class_weights, classifier = check_operands(
            self.hidden, classifier, self.targets, bias, class_weights, self.shift
        )
        width, dim = classifier.shape
        layout, config = self.layout, self.config
        if width > self.slab_buffer.shape[1]:
            raise ValueError(f"slab must be ({layout.n_positions}, {width}): it is narrower")
        if self.filtered and target_offset % self.filter_block:
            raise ValueError("filtered slabs start on a block and tiles divide the block")
        slab, slab_desc = self._slab(width)
        if layout.n_positions == 0 or width == 0:
            return slab
        hidden_arg, classifier_arg, use_tma = operand_args(layout, classifier, config)
        slab_arg = slab
        if use_tma and slab_desc is not None:
            slab_arg = slab_desc
        else:
            use_tma = False
            hidden_arg, classifier_arg = layout.matrix, classifier
        _logit_grad_kernel[launch_grid(layout.n_positions, width, config)](
            hidden_arg,
            classifier_arg,
            bias if bias is not None else classifier,
            class_weights if class_weights is not None else classifier,
            self.targets,
            *self.vectors,
            slab_arg,
            layout.n_positions,
            layout.seq_stride,
            layout.rows_per_seq,
            width,
            dim,
            self.shift,
            target_offset,
            *self.scalars,
            layout.stride_pos,
            classifier.stride(0),
            *self.targets.stride(),
            slab.stride(0),
            self.keep_blocks,
            HAS_WEIGHTS=class_weights is not None,
            **self.flags,
            **self._launch_options(use_tma, bias is not None),
        )
        return slab

    def _slab(self, width: int) -> tuple:
        """The buffer's first ``width`` columns, and their descriptor where stored by TMA."""
        entry = self._slabs.get(width)
        if entry is None:
            slab, desc = self.slab_buffer[:, :width], None
            if self.slab_tma and width and self.layout.n_positions:
                block = [self.config.block_n, self.config.block_v]
                desc = TensorDescriptor(slab, list(slab.shape), [slab.stride(0), 1], block)
            entry = self._slabs[width] = (slab, desc)
        return entry

    def _launch_options(self, use_tma: bool, has_bias: bool) -> dict:
        options = self._options.get((use_tma, has_bias))
        if options is None:
            options = self._options[use_tma, has_bias] = gemm_launch_options(
                self.config, self.hidden, use_tma=use_tma, has_bias=has_bias, softcap=self.softcap
            )
        return options


def _check_vectors(n_positions: int, vectors: tuple) -> None:
    names = ("lse", "coef_p", "coef_t", "coef_w", "entropy_coef")
    for name, t in zip(names, vectors):
        if t is None and name == "entropy_coef":
            continue
        if t.shape != (n_positions,) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous float32 ({n_positions},)")


def logit_grad(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    lse: torch.Tensor,
    coefs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    slab: torch.Tensor,
    *,
    target_offset: int,
    shift: int,
    logit_scale: float,
    softcap: float,
    smoothing: bool,
    config: TileConfig | None = None,
    keep: torch.Tensor | None = None,
    filter_block: int = 256,
    entropy_coef: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fill ``slab`` (positions x width, unit column stride) with the gradient of the loss
    w.r.t. the pre-activation logits of ``classifier``'s classes (width = its rows): a slab
    of the vocabulary starting at class ``target_offset``, which ``targets`` index.

    Everything is indexed by *position* of ``row_layout(hidden, shift)``: ``lse`` and the
    coefficient vectors are (n_positions,) float32 (coefficients 0 at positions that are no
    loss row), and so are the slab's rows — the layout that the cuBLAS GEMMs consuming the slab
    read without copies.

    ``entropy_coef`` (n_positions,) float32: the entropy gradient's coefficient of
    p * log p per position (loss_math), or None without one.

    ``keep`` (n_positions, blocks) uint8: gradient filtering's mask (filtering.py), 1 where
    the position computes the softmax term of a block of ``filter_block`` classes; the slab
    must then start on a block boundary (``target_offset``)."""
    launch = LogitGradLaunch(
        hidden,
        targets,
        lse,
        coefs,
        slab,
        shift=shift,
        logit_scale=logit_scale,
        softcap=softcap,
        smoothing=smoothing,
        config=config,
        keep=keep,
        filter_block=filter_block,
        entropy_coef=entropy_coef,
    )
    if slab.shape[1] != classifier.shape[0]:
        n_positions = launch.layout.n_positions
        raise ValueError(f"slab must be ({n_positions}, {classifier.shape[0]}) like classifier")
    launch.launch(classifier, bias, class_weights, target_offset=target_offset)
    return slab
