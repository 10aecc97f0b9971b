#!/usr/bin/env bash
# Session 11, device call 7: the largest batch under a 20 GiB allocator cap (HF Llama, 4 layers,
# hidden 2048, V 128256, 2048-token sequences, AMP + AdamW), compile against the default.
set -u
export PYTHONPATH=$PWD
timeout 540 python3 bench/e2e_llama.py --layers 4 --cap-gib 20 --max-batch 24 --variants compile,cce \
  --out "$OUT/cap" > "$OUT/cap.log" 2>&1
echo "rc=$?" >> "$OUT/cap.log"
rm -f "$OUT"/cap/*.png
