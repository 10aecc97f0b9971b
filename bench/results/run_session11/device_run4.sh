#!/usr/bin/env bash
# Session 11, device call 4: quack-kernels (cutlass-dsl cu13 libs as an xz tar in two parts,
# .peers/qa from call 3 and .peers/qb), and the LoRA step at the 4 x 2048 tokens.
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/wheels/*.whl
cat .peers/qa/cu13.part.aa .peers/qb/cu13.part.ab | xz -d | tar -C /tmp/peers -xf -
python3 -m pip install -q --no-index --no-deps --target /tmp/peers .peers/qa/*.whl .peers/qb/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/peers:/tmp/peers/nvidia_cutlass_dsl/dsl_packages
python3 -c "import quack.linear_cross_entropy; print('quack ok')" > "$OUT/quack.log" 2>&1
timeout 200 python3 bench/bench.py --shapes E --scenarios bf16,bf16-ign50 \
  --methods torch_compile,cce_auto,quack --reps 15 --out "$OUT/quack" >> "$OUT/quack.log" 2>&1
timeout 250 python3 bench/e2e_llama.py --layers 16 --steps 8 --batch 4 --lora --variants compile,cce \
  --out "$OUT/e2e" > "$OUT/e2e.log" 2>&1
rm -f "$OUT"/*/*.png "$OUT"/*/*.json
