"""Small Triton helpers shared by the kernels, and the launchers' common host-side set-up.

Rows of hidden are addressed as *positions* of a flat (positions x D) matrix with row stride
``stride_pos``: position p is (b, t) = divmod(p, seq_stride) and is a loss row when
t < rows_per_seq (= T - shift); its loss row index is b * rows_per_seq + t. A contiguous
(B, T, D) hidden, a shifted one, rows padded in D and a single sequence of any row stride are
such matrices; the few positions past T - shift in each sequence are loaded and ignored (they
are hidden's own rows). A layout whose sequences lie further apart than their T rows (a slice
such as hidden[:, :-1], or a buffer with padded strides) is copied once: the gaps between its
sequences are not hidden's memory.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_n: int = 128
    block_v: int = 128
    block_d: int = 64
    group_n: int = 8
    num_warps: int = 8
    num_stages: int = 4
    tiles_per_program: int = 4  # lse_forward: vocab tiles per program (fewer partials)


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """How the loss rows of a (B, T, D) hidden sit in memory (see the module docstring)."""

    matrix: torch.Tensor  # a tensor whose data_ptr is position 0
    n_positions: int
    seq_stride: int  # positions per sequence in memory (>= rows_per_seq)
    rows_per_seq: int
    stride_pos: int  # elements between consecutive positions
    n_rows: int

    def positions(self) -> torch.Tensor:
        """hidden's positions as an (n_positions, D) strided view: what the GEMMs read."""
        dim = self.matrix.shape[-1]
        return self.matrix.as_strided((self.n_positions, dim), (self.stride_pos, 1))

    def row_grid(self, flat: torch.Tensor) -> torch.Tensor:
        """The (B, rows_per_seq, ...) loss rows inside a position-indexed tensor."""
        batch = self.n_rows // self.rows_per_seq if self.rows_per_seq else 0
        inner = flat.shape[1:]
        strides = (self.seq_stride * flat.stride(0), flat.stride(0), *flat.stride()[1:])
        return flat.as_strided((batch, self.rows_per_seq, *inner), strides)

    def rows_to_positions(self, rows: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """(N, ...) per-row values -> (n_positions, ...), ``fill`` at non-row positions."""
        if self.n_positions == self.n_rows:
            return rows.contiguous()
        out = rows.new_full((self.n_positions, *rows.shape[1:]), fill)
        self.row_grid(out).copy_(rows.view(-1, self.rows_per_seq, *rows.shape[1:]))
        return out

    def positions_to_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """(n_positions, ...) -> (N, ...) loss rows (a view when positions are rows)."""
        if self.n_positions == self.n_rows:
            return positions
        return self.row_grid(positions).reshape(self.n_rows, *positions.shape[1:])


def row_layout(hidden: torch.Tensor, shift: int) -> RowLayout:
    """The flat-position view of hidden's loss rows; copies only layouts that have none."""
    batch, time, dim = hidden.shape
    rows_per_seq = time - shift
    if hidden.stride(-1) != 1:
        hidden = hidden.contiguous()
    stride_b, stride_t = hidden.stride(0), hidden.stride(1)
    if batch == 1:  # positions are the sequence's rows
        seq_stride, stride_pos = max(rows_per_seq, 1), stride_t
    elif time == 1:  # positions are the batch entries
        seq_stride, stride_pos = 1, stride_b
    elif stride_t > 0 and stride_b == stride_t * time:
        seq_stride, stride_pos = time, stride_t
    else:
        # No flat matrix of hidden's own rows: a batch dimension with stride 0, or sequences
        # further apart than their rows (base[:, :T] of a longer buffer, or a padded buffer
        # Inductor allocated for a slice and never filled past T). A flat view over the latter
        # would take the gap rows between sequences as positions; they get no loss, but the
        # classifier's gradient GEMM multiplies them by their zero gradient, and 0 x NaN (or
        # x inf) in memory outside the tensor is NaN. One contiguous copy instead.
        hidden = hidden.contiguous()
        seq_stride, stride_pos = time, dim
    # No loss rows (an empty batch or sequence): no positions either.
    n_positions = (batch - 1) * seq_stride + rows_per_seq if batch * rows_per_seq else 0
    return RowLayout(
        hidden, n_positions, seq_stride, rows_per_seq, stride_pos, batch * rows_per_seq
    )


def check_operands(hidden, classifier, targets, bias, class_weights, shift):
    """Shapes shared by the GEMM kernels; returns (bias, class_weights, classifier) made
    contiguous where the kernels need unit strides (vectors, and a transposed classifier)."""
    batch, time, dim = hidden.shape
    vocab = classifier.shape[0]
    if classifier.shape != (vocab, dim):
        raise ValueError(f"classifier shape {tuple(classifier.shape)} != ({vocab}, {dim})")
    if targets.shape != (batch, time):
        raise ValueError(f"targets shape {tuple(targets.shape)} != ({batch}, {time})")
    if bias is not None and bias.shape != (vocab,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({vocab},)")
    if class_weights is not None and class_weights.shape != (vocab,):
        raise ValueError(f"class_weights shape {tuple(class_weights.shape)} != ({vocab},)")
    if shift < 0 or (shift and shift >= time):  # T = 0 (no rows) takes shift 0
        raise ValueError(f"shift {shift} outside [0, {time})")
    if classifier.stride(1) != 1:
        classifier = classifier.contiguous()
    return (
        None if bias is None else bias.contiguous(),
        None if class_weights is None else class_weights.contiguous(),
        classifier,
    )


def targets_can_equal(targets: torch.Tensor, value: int) -> bool:
    """Can an element of ``targets`` equal ``value``? Not where the value is outside the
    dtype's range: a kernel's comparison must then find no match (PyTorch compares as int64),
    whatever a narrower comparison would wrap it to."""
    info = torch.iinfo(targets.dtype)
    return info.min <= value <= info.max


def tma_ok(tensor: torch.Tensor, row_stride: int) -> bool:
    """Can a 2-D TMA descriptor with this row stride address ``tensor``'s rows?"""
    elem = tensor.element_size()
    return (
        tensor.stride(-1) == 1
        and tensor.data_ptr() % 16 == 0
        and (row_stride * elem) % 16 == 0
        and tensor.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def dot_precision(dtype: torch.dtype, device: torch.device) -> str:
    """Triton's precision for float32 dots, following torch's matmul setting.

    Without TF32 (torch's default) float32 dots use "tf32x3": three TF32 tensor-core passes,
    float32-level accuracy, instead of an FMA loop that spills (bench/sass_report.py). The
    interpreter computes in float32 either way.
    """
    if dtype != torch.float32 or device.type == "cpu":
        return "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"


def operands_tma_ok(hidden: torch.Tensor, row_stride: int, classifier: torch.Tensor) -> bool:
    """Do the GEMM kernels load these operands by TMA (``operand_args``)? A caller choosing
    tiles asks too: a tile loaded by pointers takes more shared memory."""
    return tma_ok(hidden, row_stride) and tma_ok(classifier, classifier.stride(0))


def operand_args(layout: RowLayout, classifier: torch.Tensor, config: TileConfig):
    """(hidden, classifier, USE_TMA): descriptors when both operands allow TMA, else tensors."""
    dim = classifier.shape[1]
    use_tma = operands_tma_ok(layout.matrix, layout.stride_pos, classifier)
    if not use_tma:
        return layout.matrix, classifier, False
    from triton.tools.tensor_descriptor import TensorDescriptor

    hidden_desc = TensorDescriptor(
        layout.matrix,
        [layout.n_positions, dim],
        [layout.stride_pos, 1],
        [config.block_n, config.block_d],
    )
    classifier_desc = TensorDescriptor(
        classifier,
        list(classifier.shape),
        [classifier.stride(0), 1],
        [config.block_v, config.block_d],
    )
    return hidden_desc, classifier_desc, True


@triton.jit
def tile_rows(
    pid_n, n_positions, seq_stride, rows_per_seq, shift, stride_tb, stride_tt, BLOCK_N: tl.constexpr
):
    """Positions of row block ``pid_n``: (first position, clamped positions, loss rows, valid,
    int64 offsets of their targets)."""
    first = pid_n * BLOCK_N
    pos = first + tl.arange(0, BLOCK_N)
    pos_c = tl.minimum(pos, n_positions - 1)
    b = pos_c // seq_stride
    t = pos_c - b * seq_stride
    valid = (pos < n_positions) & (t < rows_per_seq)
    t = tl.minimum(t, rows_per_seq - 1)
    row = b.to(tl.int64) * rows_per_seq + t
    t_off = b.to(tl.int64) * stride_tb + (t + shift).to(tl.int64) * stride_tt
    return first, pos_c, row, valid, t_off


@triton.jit
def tanh(x):
    # exp-based: portable to the interpreter; absolute error ~1e-7, which is what the softmax
    # sees after multiplying by the cap.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def cap_logits(y, logit_scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """z = softcap * tanh(logit_scale * y / softcap), or logit_scale * y."""
    z = y * logit_scale
    if HAS_SOFTCAP:
        z = softcap * tanh(z / softcap)
    return z


@triton.jit
def row_coefficients(row, lse, p_base, p_per_lse, coef_t, coef_w, HAS_Z_LOSS: tl.constexpr):
    """A row's (coef_p, coef_t, coef_w, active) for fast mode's gradient passes: coef_p =
    p_base + p_per_lse * lse (z-loss), and whether any is non-zero (a row with a loss)."""
    c_p = tl.load(p_base + row)
    if HAS_Z_LOSS:
        c_p += tl.load(p_per_lse + row) * lse
    c_t = tl.load(coef_t + row)
    c_w = tl.load(coef_w + row)
    return c_p, c_t, c_w, (c_p != 0.0) | (c_t != 0.0) | (c_w != 0.0)


@triton.jit
def capped_logits_tile(
    hidden,
    classifier,
    bias,
    first_pos,
    first_col,
    pos_c,
    cols_c,
    dim,
    stride_pos,
    stride_cv,
    logit_scale,
    softcap,
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """z = softcap(logit_scale * (hidden @ classifier.T + bias)) for one (BLOCK_N, BLOCK_V)
    tile of positions x classes, float32: what both the forward and the backward slab kernel
    see of the logits, computed the same way.

    With USE_TMA, ``hidden`` and ``classifier`` are TMA descriptors (out-of-bounds rows,
    columns and D are zero-filled); otherwise pointers, with ``pos_c`` / ``cols_c`` clamped to
    valid rows so that only the D tail needs a mask.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if USE_TMA:
        for k in range(0, tl.cdiv(dim, BLOCK_D)):
            h = hidden.load([first_pos, k * BLOCK_D])
            c = classifier.load([first_col, k * BLOCK_D])
            if UPCAST_DOT:
                # The CPU interpreter mis-evaluates bf16 dots; bf16 products are exact in
                # float32, so upcasting computes the same tile.
                h = h.to(tl.float32)
                c = c.to(tl.float32)
            acc = tl.dot(h, c.T, acc, input_precision=DOT_PRECISION)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        h_ptrs = hidden + pos_c.to(tl.int64)[:, None] * stride_pos + offs_d[None, :]
        c_ptrs = classifier + cols_c.to(tl.int64)[None, :] * stride_cv + offs_d[:, None]
        for k in range(0, tl.cdiv(dim, BLOCK_D)):
            remaining = dim - k * BLOCK_D
            h = tl.load(h_ptrs, mask=offs_d[None, :] < remaining, other=0.0)
            c = tl.load(c_ptrs, mask=offs_d[:, None] < remaining, other=0.0)
            if UPCAST_DOT:
                h = h.to(tl.float32)
                c = c.to(tl.float32)
            acc = tl.dot(h, c, acc, input_precision=DOT_PRECISION)
            h_ptrs += BLOCK_D
            c_ptrs += BLOCK_D
    if HAS_BIAS:
        acc += tl.load(bias + cols_c).to(tl.float32)[None, :]
    return cap_logits(acc, logit_scale, softcap, HAS_SOFTCAP)


def gemm_launch_options(
    config: TileConfig,
    hidden: torch.Tensor,
    *,
    use_tma: bool,
    has_bias: bool,
    softcap: float,
) -> dict[str, object]:
    """The keyword arguments that both GEMM kernels take the same way: tiles, load path,
    epilogue flags, and the dot precision / interpreter work-around for hidden's dtype."""
    return dict(
        HAS_BIAS=has_bias,
        HAS_SOFTCAP=bool(softcap),
        USE_TMA=use_tma,
        UPCAST_DOT=hidden.device.type == "cpu",
        DOT_PRECISION=dot_precision(hidden.dtype, hidden.device),
        BLOCK_N=config.block_n,
        BLOCK_V=config.block_v,
        BLOCK_D=config.block_d,
        GROUP_N=config.group_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


@triton.jit
def grouped_tile(
    pid, n_rows, vocab_cols, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, GROUP_N: tl.constexpr
):
    """(row block, vocab block) of program ``pid``, GROUP_N row blocks at a time so that
    programs running together share classifier tiles in L2."""
    num_pid_n = tl.cdiv(n_rows, BLOCK_N)
    num_pid_v = tl.cdiv(vocab_cols, BLOCK_V)
    per_group = GROUP_N * num_pid_v
    group = pid // per_group
    first_n = group * GROUP_N
    group_size = tl.minimum(num_pid_n - first_n, GROUP_N)
    pid_n = first_n + (pid % per_group) % group_size
    pid_v = (pid % per_group) // group_size
    return pid_n, pid_v


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host integers. The launchers' own: in Triton 3.9 ``triton.cdiv`` is a
    constexpr function, ~10 us of host time a call through its argument unwrapping."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n of a host integer (0 for 0, as ``triton.next_power_of_2``;
    see ``cdiv``)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launch_grid(n_positions: int, cols: int, config: TileConfig, tiles: int = 1) -> tuple[int]:
    blocks_v = cdiv(cols, config.block_v * tiles)
    return (cdiv(n_positions, config.block_n) * blocks_v,)
