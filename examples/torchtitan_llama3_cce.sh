#!/usr/bin/env bash
# torchtitan's own trainer with cce_compile's fused loss (docs/torchtitan.md). torchtitan is
# launched from its command line, so the example is the command: the two flags below are all
# that changes from an ordinary torchtitan run. Pass your job config and any other flags:
#
#   examples/torchtitan_llama3_cce.sh --job.config_file path/to/llama3_8b.toml   # torchtitan 0.2.x
#   NGPU=8 examples/torchtitan_llama3_cce.sh --module llama3 --config llama3_8b  # torchtitan 0.3.x
#
# The first step logs "cce_compile: torchtitan loss fused (no logits)". tests/integrations runs
# this on CPU (gloo, 2 ranks, a tiny model) against the unfused run's loss curve.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then  # the comment above, as the usage
  sed -n '2,/^set /p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'
  exit 0
fi
NGPU=${NGPU:-2}
release=$(python -c "import torchtitan; print('.'.join(torchtitan.__version__.split('.')[:2]))")
if [ "$release" = "0.2" ]; then
  fused=(--experimental.custom_import cce_compile.integrations.torchtitan --model.name llama3_cce)
else
  fused=(--override.imports cce_compile.integrations.torchtitan.cce_loss)
fi
exec torchrun --standalone --nproc-per-node "$NGPU" -m torchtitan.train "$@" "${fused[@]}"
