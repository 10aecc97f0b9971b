#!/usr/bin/env bash
# Session 11, device call 3 (after the fast-chunk floor fix): GPU tests, AMP tables at E and B.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/wheels/*.whl
export PYTHONPATH=$PWD:/tmp/peers
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_path.py \
  -k "not random_cases" > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu_tests.log"
M=torch_compile,cce_auto,cce_lean,cce_fast,cce_fast_budget1024,cce_fast_budget2048,trl_fused_head
timeout 240 python3 bench/bench.py --shapes E --scenarios amp,amp-frozen,amp-ign50,bf16-frozen --methods $M \
  --reps 15 --out "$OUT/E" > "$OUT/bench.log" 2>&1
echo "bench E rc=$?" >> "$OUT/bench.log"
timeout 120 python3 bench/bench.py --shapes B --scenarios amp-frozen,bf16-frozen \
  --methods torch_compile,cce_auto,cce_lean --reps 10 --out "$OUT/B" >> "$OUT/bench.log" 2>&1
echo "bench B rc=$?" >> "$OUT/bench.log"
rm -f "$OUT"/*/*.png "$OUT"/*/*.json
