#!/usr/bin/env bash
# Session 11, device call 8: what skipping ignored rows costs where the problem is small (C) and
# where it is large (E): the default with and without it (CCE_SKIP_IGNORED=0), same run.
set -u
export PYTHONPATH=$PWD
M=torch_compile,cce_auto,cce_auto_every_row
timeout 280 python3 bench/bench.py --shapes C,E --scenarios ign0,bf16,ign50 --methods $M \
  --reps 30 --out "$OUT/skip" > "$OUT/skip.log" 2>&1
echo "rc=$?" >> "$OUT/skip.log"
rm -f "$OUT"/skip/*.png
