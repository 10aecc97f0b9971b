#!/usr/bin/env bash
# Session 11, device call 9: GPU tests after policy.MIN_SKIP_MACS, and run 8's bench again.
set -u
export PYTHONPATH=$PWD
timeout 380 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_pass.py \
  tests/test_compaction.py tests/test_compaction_edges.py tests/test_entropy_argmax.py \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu_tests.log"
M=torch_compile,cce_auto,cce_auto_every_row
timeout 150 python3 bench/bench.py --shapes C,E --scenarios ign0,bf16,ign50 --methods $M \
  --reps 30 --out "$OUT/skip" > "$OUT/skip.log" 2>&1
echo "rc=$?" >> "$OUT/skip.log"
rm -f "$OUT"/skip/*.png
