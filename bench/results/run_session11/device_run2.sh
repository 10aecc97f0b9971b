#!/usr/bin/env bash
# Session 11, device call 2: quack-kernels (its 92 MB cutlass-dsl cu13 wheel carried as an xz
# tar in two parts, .peers/qa and .peers/qb), B under AMP with a frozen head, the LoRA step.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/wheels/*.whl
mkdir -p /tmp/peers && cat .peers/qa/cu13.part.aa .peers/qb/cu13.part.ab | xz -d | tar -C /tmp/peers -xf -
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/qa/*.whl .peers/qb/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/peers
python3 -c "import quack.linear_cross_entropy as q; print('quack ok')" > "$OUT/quack.log" 2>&1
timeout 200 python3 bench/bench.py --shapes E --scenarios bf16,bf16-ign50 \
  --methods torch_compile,cce_auto,quack,apple_cce,trl_fused_head --reps 15 --out "$OUT/quack" >> "$OUT/quack.log" 2>&1
timeout 150 python3 bench/bench.py --shapes B --scenarios amp-frozen \
  --methods torch_compile,cce_auto,cce_lean,cce_fast,liger --reps 10 --out "$OUT/b_amp_frozen" > "$OUT/b.log" 2>&1
timeout 220 python3 bench/e2e_llama.py --layers 16 --steps 8 --lora --variants compile,cce \
  --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1
rm -f "$OUT"/*/*.png "$OUT"/*/*.json
ls -R "$OUT"
