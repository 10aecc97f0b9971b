"""Tile and chunk-size sweep for the Triton path (run on the device; informs the defaults).

For each shape: the lean forward kernel (forward-only, no_grad) and the lean backward's
recompute kernel under several tile configurations; the lean backward's slab budget; the fast
mode's chunk budget. Times are medians of CUDA-event timings, relative to the bare matmul.

    python bench/tune.py --shapes B,E --out $OUT
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from unittest.mock import patch

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import cce_compile  # noqa: E402
from bench import SHAPES, Scenario, cuda_time_ms, make_inputs  # noqa: E402
from cce_compile import config, policy  # noqa: E402
from cce_compile.implementations import triton_path, triton_shared  # noqa: E402
from cce_compile.kernels.common import TileConfig  # noqa: E402

CANDIDATES = [
    TileConfig(128, 256, 64, 8, 8, 3, 4),
    TileConfig(128, 256, 64, 8, 8, 4, 4),
    TileConfig(128, 128, 64, 8, 8, 4, 4),
    TileConfig(128, 128, 64, 8, 8, 5, 4),
    TileConfig(128, 128, 128, 8, 8, 3, 4),
    TileConfig(256, 128, 64, 8, 8, 3, 4),
    TileConfig(128, 256, 64, 8, 8, 3, 1),
    # Small D (the demo's 512): few K steps, so the epilogue is a larger share of each tile;
    # smaller tiles let two programs share an SM and overlap one's epilogue with the other's
    # main loop.
    TileConfig(128, 128, 64, 8, 4, 3, 1),
    TileConfig(128, 128, 64, 8, 8, 3, 1),
    TileConfig(64, 256, 64, 8, 4, 3, 1),
    TileConfig(128, 256, 128, 8, 8, 2, 1),
]


def tune_shape(name, reps, candidates=CANDIDATES, sweeps=True):
    n, d, v = SHAPES[name]
    hidden, classifier, targets = make_inputs(n, d, v, Scenario.parse("bf16"))
    h = hidden.clone().requires_grad_()
    c = classifier.clone().requires_grad_()
    matmul, _ = cuda_time_ms(lambda: hidden @ classifier.T, reps, 2)
    rows = {"matmul_ms": matmul}

    def lean_forward():
        with torch.no_grad():
            cce_compile.linear_cross_entropy(hidden, classifier, targets, mode="lean")

    def step(mode):
        h.grad = c.grad = None
        cce_compile.linear_cross_entropy(h, c, targets, mode=mode).backward()

    def record(key, value):
        rows[key] = value
        print(name, key, value, flush=True)

    for cfg in candidates:
        key = (
            f"{cfg.block_n}x{cfg.block_v}x{cfg.block_d}-w{cfg.num_warps}-s{cfg.num_stages}"
            f"-t{cfg.tiles_per_program}"
        )
        try:
            with patch.object(triton_shared, "tile_config", lambda *args, cfg=cfg, **kwargs: cfg):
                fwd, _ = cuda_time_ms(lean_forward, reps, 2)
                lean, _ = cuda_time_ms(lambda: step("lean"), max(3, reps // 2), 1)
            record(key, {"fwd_x_matmul": fwd / matmul, "lean_x_floor": lean / matmul / 3})
        except Exception as exc:
            record(key, {"error": str(exc)[:200]})
    if not sweeps:
        return rows
    for slab_mb in (32, 64, 128, 512):
        with patch.object(triton_path, "SLAB_BYTES", slab_mb * 2**20):
            lean, _ = cuda_time_ms(lambda: step("lean"), max(3, reps // 2), 1)
        record(f"slab_{slab_mb}MB", {"lean_x_floor": lean / matmul / 3})
    for chunk_rows in (1024, 2048, 4096, 8192):
        # A budget far above any chunk, so that the row count alone sizes the chunks.
        with (
            patch.object(policy, "FAST_CHUNK_ROWS", chunk_rows),
            config.override(memory_budget_mb=64 * 1024),
        ):
            torch.cuda.reset_peak_memory_stats()
            fast, _ = cuda_time_ms(lambda: step("fast"), max(3, reps // 2), 1)
            peak = torch.cuda.max_memory_allocated() / 2**30
        record(f"fast_{chunk_rows}rows", {"fast_x_floor": fast / matmul / 3, "peak_gb": peak})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="B,E,A,C")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--configs", default=None, help="comma list of CANDIDATES indices")
    parser.add_argument("--no-sweeps", action="store_true", help="tile configurations only")
    args = parser.parse_args(argv)
    candidates = CANDIDATES
    if args.configs:
        candidates = [CANDIDATES[int(i)] for i in args.configs.split(",")]
    report = {}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.shapes.split(","):
        report[name] = tune_shape(name, args.reps, candidates, not args.no_sweeps)
        torch.cuda.empty_cache()
        (out / "tune.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
