#!/usr/bin/env bash
# Session 11, device call 10: skipping ignored rows at C with and without the size floor,
# twice in opposite orders (C's times drift by ~5% between runs: it is host-bound).
set -u
export PYTHONPATH=$PWD
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "synchronisation" \
  > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu_tests.log"
for order in cce_auto,cce_auto_skip_any_size cce_auto_skip_any_size,cce_auto; do
  timeout 120 python3 bench/bench.py --shapes C --scenarios bf16,ign50 --methods torch_compile,$order \
    --reps 100 --warmup 10 --out "$OUT/c_$order" > "$OUT/c_$order.log" 2>&1
  rm -f "$OUT"/c_$order/*.png "$OUT"/c_$order/*.json
done
