"""Can a GEMM round AMP's float32 classifier itself? The wall behind fast mode's AMP memory.

Under AMP fast mode holds autocast's bf16 copy of the float32 classifier (V x D x 2 bytes)
through its chunks, because cuBLAS takes no mixed operands. Dropping that copy needs the two
GEMMs that read the classifier to load float32 tiles and round them to bf16 themselves:
fast mode's logits GEMM (h @ W.T) and its d hidden GEMM (dZ @ W). This probe times bare
persistent Triton GEMMs of both forms with a float32 (rounded as loaded) or a bf16 classifier,
against cuBLAS's bf16 GEMM of the same chunk, in three load forms:

* ``tma``: both operands by TMA, the classifier the wgmma B operand (shared memory);
* ``tma-swap``: the transposed product, so that the rounded classifier is the A operand
  (which wgmma may read from registers);
* ``ptr``: the classifier by pointer loads (the logits GEMM only).

It also times the classifier gradient's per-chunk accumulation (dZ.T @ h added into a float32
gradient, AMP's, against a bf16 one): the other AMP cost that every chunk pays.
Shapes: one fast chunk at E (D = 4096, V = 128256), ``--rows`` rows per chunk.

    python bench/mixed_operand_probe.py --rows 1230,2460
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path += [str(pathlib.Path(__file__).resolve().parents[i]) for i in (0, 1)]
from bench import cuda_time_ms  # noqa: E402
from cce_compile.kernels.common import grouped_tile  # noqa: E402

VOCAB, DIM = 128256, 4096
# (block_m, block_n, block_k, stages, warps); 128 x 256 x 64 in three stages is fast mode's
# bf16 tile, which a float32 operand's stages no longer fit (out of shared memory)
TILES = [
    (128, 256, 64, 2, 8),
    (128, 256, 32, 4, 8),
    (128, 256, 32, 3, 8),
    (128, 128, 64, 3, 8),
    (128, 128, 64, 4, 4),
    (128, 256, 64, 3, 8),
]


@triton.jit
def _gemm_kernel(
    a,  # (m, k) bf16 descriptor
    w,  # the classifier: descriptor, or a pointer where W_PTR
    out,  # (m, n) descriptor
    m,
    n,
    k,
    stride_w,
    LOGITS: tl.constexpr,  # out = a @ w.T, w (n, k); else out = a @ w, w (k, n)
    SWAP: tl.constexpr,  # the transposed product: the rounded classifier as the A operand
    W_PTR: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    tiles = tl.cdiv(m, BM) * tl.cdiv(n, BN)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        pm, pn = grouped_tile(tile, m, n, BM, BN, 8)  # fast mode's tile order
        cols = tl.minimum(pn * BN + tl.arange(0, BN), n - 1).to(tl.int64)
        offs_k = tl.arange(0, BK)
        acc = tl.zeros((BN, BM) if SWAP else (BM, BN), dtype=tl.float32)
        for step in range(0, tl.cdiv(k, BK)):
            x = a.load([pm * BM, step * BK])
            if W_PTR:  # (BN, BK) rows of w, LOGITS only
                c = tl.load(w + cols[:, None] * stride_w + (step * BK + offs_k)[None, :])
            elif LOGITS:
                c = w.load([pn * BN, step * BK])
            else:
                c = w.load([step * BK, pn * BN]).T
            c = c.to(tl.bfloat16)  # a float32 classifier is rounded here, as autocast rounds it
            acc = tl.dot(c, x.T, acc) if SWAP else tl.dot(x, c.T, acc)
        result = acc.T if SWAP else acc
        out.store([pm * BM, pn * BN], result.to(out.dtype))


def run_gemm(a, w, out, *, logits: bool, swap: bool, w_ptr: bool, tile) -> None:
    block_m, block_n, block_k, stages, warps = tile
    m, k = a.shape
    n = out.shape[1]
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [block_m, block_k])
    w_block = [block_n, block_k] if logits else [block_k, block_n]
    w_arg = w if w_ptr else TensorDescriptor(w, list(w.shape), [w.stride(0), 1], w_block)
    out_desc = TensorDescriptor(out, list(out.shape), [out.stride(0), 1], [block_m, block_n])
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(tiles, torch.cuda.get_device_properties(a.device).multi_processor_count)
    _gemm_kernel[(programs,)](
        a_desc, w_arg, out_desc, m, n, k, w.stride(0), LOGITS=logits, SWAP=swap, W_PTR=w_ptr,
        BM=block_m, BN=block_n, BK=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip


def _timed(fn, reps: int) -> float:
    return cuda_time_ms(fn, reps, 3)[0]


def _probe_form(name, a, w32, w16, out, rows, reps) -> None:
    """One GEMM form (``name``: 'logits' or 'd hidden') in every load form and tile."""
    logits = name == "logits"
    operand = w16.T if logits else w16
    reference = torch.mm(a, operand, out_dtype=torch.float32)
    if out.dtype == a.dtype:
        cublas = _timed(lambda: torch.mm(a, operand, out=out), reps)
    else:
        cublas = _timed(lambda: torch.mm(a, operand, out_dtype=out.dtype, out=out), reps)
    print(f"{name}, {rows} rows: cuBLAS bf16 {cublas:.3f} ms", flush=True)
    loads = [("tma", False, False), ("tma-swap", True, False)]
    if logits:
        loads.append(("ptr", False, True))
    for load, swap, w_ptr in loads:
        for w_name, w in (("float32", w32), ("bf16", w16)):
            for tile in TILES:
                kwargs = dict(logits=logits, swap=swap, w_ptr=w_ptr, tile=tile)
                shape = "x".join(map(str, tile[:3]))
                tag = f"  {load:8s} W {w_name:7s} {shape} s{tile[3]} w{tile[4]}"
                try:
                    run_gemm(a, w, out, **kwargs)
                    ms = _timed(functools.partial(run_gemm, a, w, out, **kwargs), reps)
                except Exception as exc:  # out of shared memory, or no compile
                    print(f"{tag}: {type(exc).__name__}: {str(exc)[:90]}", flush=True)
                    continue
                diff = ((out.float() - reference).norm() / reference.norm()).item()
                print(f"{tag}: {ms:.3f} ms = {ms / cublas:.2f}x cuBLAS (rel. diff {diff:.0e})")


def probe_gemms(rows: int, reps: int) -> None:
    h = torch.randn(rows, DIM, device="cuda").bfloat16()
    w32 = torch.randn(VOCAB, DIM, device="cuda") / DIM**0.5
    w16 = w32.bfloat16()
    logits = torch.empty(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
    _probe_form("logits", h, w32, w16, logits, rows, reps)
    dz = (torch.randn(rows, VOCAB, device="cuda") / 100).bfloat16()
    _probe_form("d hidden", dz, w32, w16, torch.empty(rows, DIM, device="cuda"), rows, reps)


def probe_accumulation(rows: int, reps: int) -> None:
    dz = (torch.randn(rows, VOCAB, device="cuda") / 100).bfloat16()
    h = torch.randn(rows, DIM, device="cuda").bfloat16()
    grad32 = torch.zeros(VOCAB, DIM, device="cuda")
    grad16 = torch.zeros(VOCAB, DIM, device="cuda", dtype=torch.bfloat16)
    add32 = _timed(
        lambda: torch.addmm(grad32, dz.t(), h, out_dtype=torch.float32, out=grad32), reps
    )
    add16 = _timed(lambda: grad16.addmm_(dz.t(), h), reps)
    print(
        f"d classifier += dZ.T @ h, {rows} rows: float32 gradient {add32:.3f} ms, bf16 {add16:.3f}"
    )


def _scratch(size: int, align: int, stream) -> torch.Tensor:
    """Triton's allocator for the kernels' device-side TMA descriptors."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1230,2460", help="rows per chunk (E under AMP: 1230)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    triton.set_allocator(_scratch)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for rows in (int(r) for r in args.rows.split(",")):
        probe_gemms(rows, args.reps)
        probe_accumulation(rows, args.reps)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
