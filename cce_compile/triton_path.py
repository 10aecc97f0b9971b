"""The CUDA implementation: Triton kernels plus cuBLAS GEMMs, same interface as ``reference``.

Lean mode (``forward`` + ``backward``):
  forward   one fused kernel (``lse_forward``) -> per-row lse and target logit; nothing N x V.
  backward  for each vocabulary slab of ``width`` classes: ``logit_grad`` recomputes the slab's
            logits and writes their gradient (N x width, inputs' dtype); then cuBLAS computes
            d classifier[slab] = slab.T @ hidden (written once, one rounding) and
            d hidden += slab @ classifier[slab] into a float32 accumulator (N x D).
Fast mode (``forward(fast=True)``), for each token chunk of ``n`` rows:
  cuBLAS logits (n x V, inputs' dtype) -> ``chunk_softmax_grad`` makes them the gradient in
  place -> d hidden[chunk] = grad @ classifier (written once) and d classifier += grad.T @
  hidden[chunk] into a float32 accumulator (V x D). The backward only scales by the upstream
  gradient. Three GEMMs, the minimum; one chunk and the accumulator are the extra memory.

Everything here also runs on CPU tensors under TRITON_INTERPRET=1 (the kernel tests): there
the GEMMs run in float32 and slabs are float32, because the interpreter truncates when it
rounds to bfloat16.
"""

from __future__ import annotations

import torch

from .kernels.chunk_softmax_grad import chunk_softmax_grad
from .kernels.logit_grad import logit_grad
from .kernels.lse_forward import TileConfig, lse_forward
from .loss_math import LossSpec, finish_loss, row_coefficient_parts, row_coefficients, row_targets
from .reference import ForwardOut, Needs

# The lean backward's slab: at most this many bytes (and at least one tile of columns).
SLAB_BYTES = 48 * 2**20


def available() -> bool:
    return torch.cuda.is_available()


def _tile_config(device: torch.device) -> TileConfig:
    if device.type == "cpu":  # interpreter: small tiles, several per test shape
        return TileConfig(block_n=16, block_v=16, block_d=16, group_n=2, num_warps=4, num_stages=1)
    return TileConfig()


def _work_dtype(tensor: torch.Tensor) -> torch.dtype:
    """dtype of slabs and chunks: the inputs' on GPU, float32 in the CPU interpreter."""
    return torch.float32 if tensor.device.type == "cpu" else tensor.dtype


def _matmul(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """out = a @ b (+ bias) with one rounding to out's dtype; float32 math on CPU."""
    if a.device.type == "cpu":
        result = a.float() @ b.float()
        if bias is not None:
            result += bias.float()
        return out.copy_(result)
    if bias is not None:
        return torch.addmm(bias, a, b, out=out)
    return torch.mm(a, b, out=out)


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with float32 accumulation, in place (cuBLAS beta = 1)."""
    if a.device.type == "cpu":
        acc.addmm_(a.float(), b.float())
    elif a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _row_matrix(hidden: torch.Tensor, shift: int) -> torch.Tensor:
    """The loss rows of hidden as an (N, D) matrix: a view when possible, else one copy."""
    rows = hidden[:, : hidden.shape[1] - shift]
    flat = rows.reshape(-1, hidden.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    return flat


def _scatter_rows(flat: torch.Tensor, hidden: torch.Tensor, shift: int) -> torch.Tensor:
    """(N, D) row gradients -> a (B, T, D) gradient of hidden with zeros past T - shift."""
    batch, time, dim = hidden.shape
    if shift == 0:
        return flat.view(batch, time, dim)
    out = flat.new_zeros((batch, time, dim))
    out[:, : time - shift] = flat.view(batch, time - shift, dim)
    return out


def forward(
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    spec: LossSpec,
    *,
    lse_all_rows: bool,
    fast: bool,
    needs: Needs,
    budget_bytes: int,
) -> ForwardOut:
    vocab = classifier.shape[0]
    rows = row_targets(targets, class_weights, spec, vocab)
    if fast and needs.any:
        out = _forward_fast(
            hidden, classifier, bias, class_weights, spec, rows, needs, budget_bytes
        )
        if not lse_all_rows:
            out.lse = torch.where(rows.valid, out.lse, 0.0)
        return out
    partial_lse, target_logit, partial_wsum = lse_forward(
        hidden,
        classifier,
        targets,
        bias,
        class_weights,
        shift=spec.shift,
        ignore_index=spec.ignore_index,
        logit_scale=spec.logit_scale,
        softcap=spec.softcap,
        skip_ignored=not lse_all_rows,
        needs_wsum=spec.needs_wsum,
        config=_tile_config(hidden.device),
    )
    lse = torch.logsumexp(partial_lse, dim=0)
    wsum = partial_wsum.sum(0) if partial_wsum is not None else None
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    if not lse_all_rows:
        lse = torch.where(rows.valid, lse, 0.0)
    return ForwardOut(loss, lse)


def _forward_fast(hidden, classifier, bias, class_weights, spec, rows, needs, budget_bytes):
    vocab, dim = classifier.shape
    device = hidden.device
    n_rows = rows.targets.numel()
    work_dtype = _work_dtype(hidden)
    chunk = max(1, min(n_rows, budget_bytes // (vocab * torch.finfo(work_dtype).bits // 8)))
    unit = torch.ones((), device=device)
    parts = row_coefficient_parts(unit, None, rows, spec, vocab)
    matrix = _row_matrix(hidden, spec.shift)
    logits_buf = torch.empty((chunk, vocab), dtype=work_dtype, device=device)
    grad_rows = (
        torch.empty((n_rows, dim), dtype=hidden.dtype, device=device) if needs.hidden else None
    )
    grad_classifier = (
        torch.zeros((vocab, dim), dtype=torch.float32, device=device) if needs.classifier else None
    )
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if needs.bias else None
    lse = torch.empty(n_rows, dtype=torch.float32, device=device)
    target_logit = torch.empty_like(lse)
    wsum = torch.empty_like(lse) if spec.needs_wsum else None
    classifier_t = classifier.t()
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        h = matrix[start:stop]
        logits = logits_buf[: stop - start]
        _matmul(h, classifier_t, out=logits, bias=bias)
        stats = chunk_softmax_grad(
            logits,
            rows.safe[start:stop],
            class_weights,
            parts.p_base[start:stop].contiguous(),
            None if parts.p_per_lse is None else parts.p_per_lse[start:stop].contiguous(),
            parts.coef_t[start:stop].contiguous(),
            parts.coef_w[start:stop].contiguous(),
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
        )
        lse[start:stop], target_logit[start:stop] = stats[0], stats[1]
        if wsum is not None:
            wsum[start:stop] = stats[2]
        if grad_rows is not None:
            _matmul(logits, classifier, out=grad_rows[start:stop])
        if grad_classifier is not None:
            _addmm_f32_(grad_classifier, logits.t(), h)
        if grad_bias is not None:
            grad_bias += logits.sum(0, dtype=torch.float32)
    loss = finish_loss(lse, target_logit, wsum, rows, spec, vocab)
    out = ForwardOut(loss, lse)
    if grad_rows is not None:
        out.grad_hidden = _scatter_rows(grad_rows, hidden, spec.shift)
    out.grad_classifier, out.grad_bias = grad_classifier, grad_bias
    return out


def slab_width(n_rows: int, vocab: int, elem_bytes: int, block_v: int, budget: int) -> int:
    """Columns per backward slab: within ``budget`` bytes, a multiple of the tile width."""
    width = budget // max(1, n_rows * elem_bytes)
    width = max(block_v, width // block_v * block_v)
    return min(width, vocab)


def backward(
    grad_loss: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    hidden: torch.Tensor,
    classifier: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    class_weights: torch.Tensor | None,
    lse: torch.Tensor,
    spec: LossSpec,
    *,
    lse_all_rows: bool,
    needs: Needs,
    budget_bytes: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    vocab, dim = classifier.shape
    device = hidden.device
    rows = row_targets(targets, class_weights, spec, vocab)
    n_rows = rows.targets.numel()
    if grad_lse is not None and not lse_all_rows:
        grad_lse = torch.where(rows.valid, grad_lse, 0.0)
    coefs = tuple(
        c.contiguous() for c in row_coefficients(grad_loss, grad_lse, lse, rows, spec, vocab)
    )
    lse = lse.contiguous()
    config = _tile_config(device)
    work_dtype = _work_dtype(hidden)
    width = slab_width(
        n_rows,
        vocab,
        torch.finfo(work_dtype).bits // 8,
        config.block_v,
        min(SLAB_BYTES, budget_bytes),
    )
    slab_buf = torch.empty((n_rows, width), dtype=work_dtype, device=device)
    grad_rows = (
        torch.zeros((n_rows, dim), dtype=torch.float32, device=device) if needs.hidden else None
    )
    matrix = _row_matrix(hidden, spec.shift) if needs.classifier else None
    grad_classifier = (
        torch.empty((vocab, dim), dtype=classifier.dtype, device=device)
        if needs.classifier
        else None
    )
    grad_bias = torch.empty(vocab, dtype=torch.float32, device=device) if needs.bias else None
    for start in range(0, vocab, width):
        stop = min(start + width, vocab)
        slab = slab_buf[:, : stop - start]
        logit_grad(
            hidden,
            classifier,
            targets,
            bias,
            class_weights,
            lse,
            coefs,
            slab,
            col_start=start,
            shift=spec.shift,
            logit_scale=spec.logit_scale,
            softcap=spec.softcap,
            smoothing=spec.needs_wsum,
            config=config,
        )
        if grad_rows is not None:
            _addmm_f32_(grad_rows, slab, classifier[start:stop])
        if grad_classifier is not None:
            _matmul(slab.t(), matrix, out=grad_classifier[start:stop])
        if grad_bias is not None:
            grad_bias[start:stop] = slab.sum(0, dtype=torch.float32)
    grad_hidden = None
    if grad_rows is not None:
        grad_hidden = _scatter_rows(grad_rows.to(hidden.dtype), hidden, spec.shift)
    return grad_hidden, grad_classifier, grad_bias
