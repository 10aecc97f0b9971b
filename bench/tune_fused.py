"""Tile sweep for fast mode's fused pass 1 (kernels/logits_exp.py), run on the device.

For one chunk of each shape (the rows the default's budget gives it): cuBLAS's logits GEMM
(bf16 out, and float32 out as the unfused path writes it), then ``logits_exp`` under several
tile configurations, and pass 2 (``scaled_exp_grad``) after it. Medians of CUDA-event timings.
(Since 41a4248 pass 2 also reduces the partial lse to the rows' lse, which ran as a
``torch.logsumexp`` outside the timing before: its ``pass2_ms`` is not comparable with earlier
runs'.)

    python bench/tune_fused.py --shapes E,B --out $OUT
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench import SHAPES, Scenario, cuda_time_ms, make_inputs  # noqa: E402
from cce_compile import policy  # noqa: E402
from cce_compile.implementations import triton_shared  # noqa: E402
from cce_compile.kernels.common import TileConfig  # noqa: E402
from cce_compile.kernels.logits_exp import exp_blocks, logits_exp  # noqa: E402
from cce_compile.kernels.scaled_exp_grad import scaled_exp_grad  # noqa: E402

# (block_n, block_v, block_d, group_n, num_warps, num_stages, tiles_per_program: unused here)
CANDIDATES = [
    TileConfig(128, 256, 64, 8, 8, 3, 1),
    TileConfig(128, 256, 64, 8, 8, 4, 1),  # out of shared memory on Hopper (262 KB > 227 KB)
    TileConfig(128, 128, 64, 8, 8, 4, 1),
    TileConfig(128, 128, 64, 8, 4, 4, 1),
    TileConfig(128, 256, 64, 16, 8, 3, 1),
    TileConfig(128, 128, 64, 8, 8, 3, 1),
    TileConfig(128, 128, 64, 8, 4, 3, 1),
]
# persistent programs per SM
PROGRAMS_PER_SM = (1, 2)


def chunk_rows(n: int, d: int, v: int, amp: bool) -> int:
    """The default budget's fused chunk for this shape (bf16, or ``amp``: both operands
    rounded from float32, whose float32 classifier gradient sets a higher floor)."""
    problem = policy.Problem(n, v, d, 2, amp, amp)
    budget = policy.budget_bytes(problem, None, 0.2)
    return policy.fast_run_rows(problem, True, budget, fused=True)


def time_pair(h, classifier, targets, exps, cfg, reps, options) -> dict:
    """Pass 1 (``logits_exp`` under ``cfg`` and ``options``) and pass 2 after it (the rows' lse
    from the partials, then the gradient), in ms."""
    rows, v = exps.shape
    ones = torch.ones(rows, device=h.device)
    zeros = torch.zeros(rows, device=h.device)
    block_max = torch.empty(rows, exp_blocks(v, cfg), device=h.device)
    partial = torch.empty_like(block_max)
    target_logit = torch.empty(rows, device=h.device)
    lse = torch.empty(rows, device=h.device)

    def pass1():
        logits_exp(
            h,
            classifier,
            targets,
            exps,
            block_max,
            partial,
            target_logit,
            logit_scale=1.0,
            config=cfg,
            **options,
        )

    def pass2():
        scaled_exp_grad(
            exps,
            block_max,
            partial,
            targets,
            target_logit,
            (ones, None, ones, zeros),
            lse,
            logit_scale=1.0,
            smoothing=False,
            max_block=cfg.block_v,
        )

    try:
        p1 = cuda_time_ms(pass1, reps, 3)[0]
    except (OutOfResources, CompilationError, RuntimeError) as exc:
        # a config that does not fit shared memory or compile (Triton raises RuntimeError
        # from its MLIR passes); anything else is a defect of this script and propagates
        return {"error": str(exc)[:200]}
    return {"pass1_ms": p1, "pass2_ms": cuda_time_ms(pass2, reps, 3)[0]}


def tune_shape(name: str, reps: int, amp: bool) -> dict:
    n, d, v = SHAPES[name]
    hidden, classifier, _ = make_inputs(n, d, v, Scenario.parse("bf16"))
    rows = chunk_rows(n, d, v, amp)
    h = hidden.reshape(-1, d)[:rows]
    targets = torch.randint(0, v, (rows,), device=h.device)
    result = {"chunk_rows": rows}
    bf16_out = torch.empty(rows, -(-v // 8) * 8, dtype=torch.bfloat16, device=h.device)[:, :v]
    f32_out = torch.empty(rows, v, dtype=torch.float32, device=h.device)
    gemm_out = torch.empty(rows, v, dtype=torch.bfloat16, device=h.device)
    result["cublas_bf16_ms"] = cuda_time_ms(
        lambda: torch.mm(h, classifier.T, out=gemm_out), reps, 3
    )[0]
    result["cublas_f32_ms"] = cuda_time_ms(
        lambda: triton_shared.matmul(h, classifier.T, out=f32_out), reps, 3
    )[0]
    default = triton_shared.fused_tile_config(h.device, dim=d, tma=True)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count
    for cfg in [default, *[c for c in CANDIDATES if c != default]]:
        for per_sm in PROGRAMS_PER_SM:
            key = (
                f"{cfg.block_n}x{cfg.block_v}x{cfg.block_d}-g{cfg.group_n}-w{cfg.num_warps}"
                f"-s{cfg.num_stages} x{per_sm}" + (" (default)" if cfg == default else "")
            )
            result[key] = time_pair(
                h,
                classifier,
                targets,
                bf16_out,
                cfg,
                reps,
                dict(programs=per_sm * sms),
            )
            result[key]["pass1_x_bf16_gemm"] = (
                result[key].get("pass1_ms", 0) / result["cublas_bf16_ms"]
            )
            print(name, key, result[key], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="E,B")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--amp", action="store_true", help="AMP's chunk rows (see chunk_rows)")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "amp_chunks": args.amp,
    }
    for name in args.shapes.split(","):
        results[name] = tune_shape(name, args.reps, args.amp)
    out = pathlib.Path(args.out) / ("tune_fused_amp.json" if args.amp else "tune_fused.json")
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
