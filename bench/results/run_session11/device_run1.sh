#!/usr/bin/env bash
# Session 11, device call 1: GPU tests of the op's new outputs and the pass, then the AMP
# scenarios at E with the budgeted-fast variants. Run from the repository root on the device.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/wheels/*.whl
export PYTHONPATH=$PWD:/tmp/peers
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_pass.py \
  tests/test_entropy_argmax.py > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?" >> "$OUT/gpu_tests.log"
M=torch_compile,cce_auto,cce_lean,cce_fast,cce_fast_budget1024,cce_fast_budget2048,trl_fused_head,liger
timeout 270 python3 bench/bench.py --shapes E --scenarios amp,amp-frozen,amp-ign50 --methods $M \
  --reps 15 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "bench rc=$?" >> "$OUT/bench.log"
rm -f "$OUT"/bench/*.png
ls -R "$OUT"
